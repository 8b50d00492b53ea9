"""``build_data(manifest)``: the manifest's ``data`` section as train and eval sequences.

Reads ``data`` (kind, path, num_examples, eval_fraction, fingerprint, pad_to), ``tokenizer``,
``model.seq_length``, ``model.vocab_size`` (it must hold the tokenizer's ids) and ``seeds.data``,
and checks ``data.fingerprint`` when set.
"""

from __future__ import annotations

import hashlib
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fp8ops.data.batches import (
    TokenizedData,
    chat_sequences,
    id_dtype,
    refused,
    sft_sequences,
    text_sequences,
)
from fp8ops.data.corpus import build_corpus
from fp8ops.data.jsonl import JsonlData, read_jsonl
from fp8ops.data.tasks import Example, generate_examples, split_examples, split_point
from fp8ops.data.tokenizer import TextRefused, Tokenizer, tokenizer_for
from fp8ops.errors import ManifestError

if TYPE_CHECKING:
    from fp8ops.manifest.schema import DataConfig, Manifest


def build_data(manifest: Manifest, tokenizer: Tokenizer | None = None) -> TokenizedData:
    """Tokenized train and eval data for ``manifest``; deterministic for a given manifest.
    ``tokenizer``: the manifest's, when the caller has built it already."""
    config = manifest.data
    tokenizer = tokenizer_for(manifest.tokenizer) if tokenizer is None else tokenizer
    seq_length = manifest.model.seq_length
    seed = manifest.seeds.data
    source: dict = {"tokenizer": tokenizer.kind, "tokenizer_fingerprint": tokenizer.fingerprint()}

    if tokenizer.vocab_size > manifest.model.vocab_size:
        raise ManifestError(
            f"model.vocab_size: {manifest.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids; set it to at least {tokenizer.vocab_size}"
        )
    if config.kind == "corpus":
        if tokenizer.kind != "byte":
            raise ManifestError(
                f"data.kind: 'corpus' is fp8ops' byte-level demo text, for tokenizer.kind "
                f"'byte', not '{tokenizer.kind}'; use data.kind 'jsonl' with your own text"
            )
        corpus = build_corpus(seed, split_version=config.split_version)
        source |= {
            "corpus_bytes": len(corpus.data),
            "corpus_documents": len(corpus.documents),
            "corpus_fingerprint": corpus.fingerprint,
            # The corpus is Python's own documentation: another version, other bytes.
            "python": platform.python_version(),
        }
        data = _pretraining(config.kind, corpus.data, seq_length, config.eval_fraction, source)
    elif config.kind == "tasks" and config.as_chat:
        from fp8ops.data.chat import task_conversation

        train, evaluation = split_examples(
            generate_examples(seed, config.num_examples), config.eval_fraction, config.split_version
        )
        splits = [[task_conversation(e) for e in split] for split in (train, evaluation)]
        data = _chat(config, seq_length, tokenizer, source, splits=splits)
    elif config.kind == "tasks":
        examples = generate_examples(seed, config.num_examples)
        data = _sft(config, examples, seq_length, tokenizer, source)
    elif config.kind == "chat":
        data = _chat(config, seq_length, tokenizer, source)
    else:  # jsonl
        file = read_jsonl(config.path)
        source |= {"path": str(file.path), "file_sha256": file.sha256}
        if file.kind == "text":
            stream = _text_stream(file, tokenizer, config.split_version)
            data = _pretraining(config.kind, stream, seq_length, config.eval_fraction, source)
        else:
            data = _sft(config, file.examples, seq_length, tokenizer, source)

    if len(data.train) == 0:
        raise ManifestError(
            f"data: no training sequences ({len(data.eval)} went to evaluation); add data "
            "(data.num_examples, a longer file), lower data.eval_fraction or model.seq_length"
        )
    if config.fingerprint is not None and config.fingerprint != data.fingerprint:
        raise ManifestError(
            f"data.fingerprint: the manifest expects {config.fingerprint} but the data built "
            f"from it now hashes to {data.fingerprint}. The data changed (a different data "
            "file; for kind 'corpus', a different Python version; or a different fp8ops). "
            "Restore the original data, or if the change is intended, derive a revision with "
            "data.fingerprint set to the new value (or null to record it without checking)."
        )
    return data


def _pretraining(
    kind: str, stream: bytes | np.ndarray, seq_length: int, eval_fraction: float, source: dict
) -> TokenizedData:
    windows = text_sequences(stream, seq_length)
    # The held-out windows are the stream's tail; at least one whenever evaluation is asked for.
    n_eval = math.ceil(len(windows) * eval_fraction) if len(windows) > 1 else 0
    train, evaluation = windows.split_at(len(windows) - n_eval)
    return TokenizedData(kind, "pretrain", train, evaluation, source)


def _text_stream(file: JsonlData, tokenizer: Tokenizer, split_version: int) -> bytes | np.ndarray:
    """The documents' ids, each followed by end-of-document: byte tokens as bytes, others in
    ``id_dtype(tokenizer.vocab_size)``. From split version 2 in hash order, as the corpus is shuffled: the held-out tail is
    then a fair sample of the file, not its last topic when the file is sorted by one."""
    documents = list(zip(file.texts, file.text_lines, strict=True))
    if split_version >= 2:
        documents.sort(key=lambda document: split_point(document[0]))
    if tokenizer.kind == "byte":  # the file is UTF-8 without NUL (read_jsonl checked)
        return b"".join(text.encode("utf-8") + b"\x00" for text, _ in documents)
    try:
        encoded = tokenizer.encode_many([text for text, _ in documents])
    except TextRefused as exc:
        raise refused(f"{file.path}: line {documents[exc.index][1]}", exc) from None
    dtype = id_dtype(tokenizer.vocab_size)
    end = np.array([tokenizer.eod], dtype=dtype)
    parts = [part for ids in encoded for part in (np.asarray(ids, dtype=dtype), end)]
    return np.concatenate(parts) if parts else end[:0]


def _chat(
    config: DataConfig, seq_length: int, tokenizer: Tokenizer, source: dict, splits=None
) -> TokenizedData:
    """Conversations through the tokenizer's chat template: data.path's (split by a hash of
    each conversation before its last answer), or ``splits``, the built-in tasks already split
    (data.as_chat)."""
    from fp8ops.data import chat

    what = "data.as_chat" if splits is not None else "data.kind: 'chat'"
    if tokenizer.kind != "huggingface":
        raise ManifestError(
            f"{what} renders conversations with a tokenizer's chat template, and "
            f"tokenizer.kind '{tokenizer.kind}' has none; use a chat model's tokenizer "
            "(tokenizer.kind 'huggingface')"
        )
    directory = tokenizer.file.parent
    if splits is None:
        rendered, template = chat.render(chat.read_chat(config.path), tokenizer, directory)
        item_of = {id(item.example): item for item in rendered}
        train, evaluation = split_examples(
            [item.example for item in rendered], config.eval_fraction, config.split_version
        )
        split_items = [[item_of[id(e)] for e in split] for split in (train, evaluation)]
        path = Path(config.path)
        source |= {"path": str(path), "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    else:
        (train, template), (evaluation, _) = (chat.render(s, tokenizer, directory) for s in splits)
        split_items = [train, evaluation]
    parts, counts = [], {}
    for items in split_items:
        sequences, found = chat_sequences(
            items, seq_length, tokenizer, config.pad_to, config.overlong
        )
        parts.append(sequences)
        counts = {k: counts.get(k, 0) + v for k, v in found.items()}
    if config.eval_fraction > 0 and split_items[1] and not len(parts[1]):
        raise ManifestError(
            f"data: every held-out conversation was dropped ({counts}), so the run would never "
            "evaluate; raise model.seq_length, or set data.overlong to 'truncate'"
        )
    if split_items[0] and not len(parts[0]):
        raise ManifestError(
            f"data: every training conversation was dropped ({counts}); raise model.seq_length, "
            "or set data.overlong to 'truncate'"
        )
    source |= {
        "chat_template_sha256": chat.template_sha256(template),
        "overlong": config.overlong,
        **counts,
    }
    return TokenizedData(config.kind, "sft", parts[0], parts[1], source)


def _sft(
    config: DataConfig,
    examples: Sequence[Example],
    seq_length: int,
    tokenizer: Tokenizer,
    source: dict,
) -> TokenizedData:
    eval_fraction = config.eval_fraction
    train, evaluation = split_examples(examples, eval_fraction, config.split_version)
    if eval_fraction > 0 and not evaluation:
        raise ManifestError(
            f"data.eval_fraction: {eval_fraction:g} held out none of the {len(examples)} "
            "examples (each goes to evaluation by a hash of its prompt), so the run would never "
            "evaluate; add examples, raise data.eval_fraction, or set it to 0 to train without "
            "evaluation"
        )
    # Tokenized together, so a length error reports the longest example of either split.
    both = sft_sequences([*train, *evaluation], seq_length, tokenizer, config.pad_to)
    train_sequences, eval_sequences = both.split_at(len(train))
    return TokenizedData(config.kind, "sft", train_sequences, eval_sequences, source)
