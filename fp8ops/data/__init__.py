"""Training and evaluation data: bytes in, fixed-order token batches out.

Reading order:

* ``tokenizer.py``: UTF-8 bytes as token ids; 0 ends a document and pads;
* ``tasks.py``: the built-in SFT tasks (kind ``tasks``), their buckets, ``check`` and the split;
* ``corpus.py``: the built-in pre-training corpus (kind ``corpus``), Python's own docstrings
  (collected by ``stdlib_docs.py``);
* ``jsonl.py``: your own data (kind ``jsonl``), strictly checked line by line;
* ``batches.py``: ragged windows -> padded tokens/labels/loss_mask batches, ``TokenizedData``
  and its fingerprint;
* ``build.py``: ``build_data(manifest)``, the one entry point;
* ``sampler.py``: ``TrainSampler``, the resumable, DP-independent training order.

See ``docs/data.md``.
"""

from fp8ops.data.batches import MicroBatch, Sequences, TokenizedData, sft_sequences, text_sequences
from fp8ops.data.build import build_data
from fp8ops.data.corpus import Corpus, build_corpus
from fp8ops.data.jsonl import JsonlData, read_jsonl
from fp8ops.data.sampler import TrainSampler, epoch_order
from fp8ops.data.stdlib_docs import STDLIB_MODULES
from fp8ops.data.tasks import (
    BUCKETS,
    Example,
    check,
    generate_examples,
    held_out,
    split_examples,
)
from fp8ops.data.tokenizer import EOD, PAD, ByteTokenizer, tokenizer_for

__all__ = [
    "BUCKETS",
    "EOD",
    "PAD",
    "STDLIB_MODULES",
    "ByteTokenizer",
    "Corpus",
    "Example",
    "JsonlData",
    "MicroBatch",
    "Sequences",
    "TokenizedData",
    "TrainSampler",
    "build_corpus",
    "build_data",
    "check",
    "epoch_order",
    "generate_examples",
    "held_out",
    "read_jsonl",
    "sft_sequences",
    "split_examples",
    "text_sequences",
    "tokenizer_for",
]
