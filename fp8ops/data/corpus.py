"""The built-in pre-training corpus (data kind ``corpus``): Python's own documentation.

Text present wherever Python is: the docstrings of a fixed list of standard-library modules
and of their public classes, methods and functions (``stdlib_docs.py``), read in a clean
interpreter so the corpus is a function of the Python version alone.

About a tenth of the bytes are lines of the SFT tasks (``tasks.py``) in both of their formats,
so the base model has seen digits and the prompt shapes before fine-tuning. They are generated
from the seed and use only prompts that no ``tasks`` evaluation split can contain.

Documents are shuffled with the seed (so the held-out tail of the corpus is a sample of all of
it, not the last modules alphabetically) and each is followed by the end-of-document id.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fp8ops.data.tasks import MAX_EVAL_FRACTION, example_stream, split_key, split_point
from fp8ops.data.tokenizer import EOD
from fp8ops.errors import ManifestError

MAX_BYTES = 2 * 1024 * 1024  # the cap; the documentation alone is about 0.6 MB on Python 3.11
TASK_SHARE = 0.1  # fraction of the corpus bytes that are task lines
TASK_LINES_PER_DOCUMENT = 32


@dataclass(frozen=True)
class Corpus:
    """The corpus as the model reads it: ``data`` is the token stream (a byte is a token)."""

    documents: tuple[str, ...]  # in stream order
    data: bytes  # each document's UTF-8 bytes followed by EOD
    docs_bytes: int  # how many bytes of data are documentation (the rest: task lines)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the exact bytes."""
        return hashlib.sha256(self.data).hexdigest()


def build_corpus(seed: int, max_bytes: int = MAX_BYTES, *, split_version: int) -> Corpus:
    """The corpus for ``seed`` (task lines and document order), at most ``max_bytes`` long.
    ``split_version`` (``data.split_version``) decides which task problems are kept out."""
    docs = []
    budget = int(max_bytes * (1 - TASK_SHARE))
    used = 0
    for doc in stdlib_documents():
        size = len(doc.encode("utf-8")) + 1
        if used + size > budget:
            break  # the cap cuts at a document boundary, in the fixed module order
        docs.append(doc)
        used += size
    docs_bytes = used
    # Task lines up to TASK_SHARE of the total: task / (docs + task) = share.
    task_budget = int(docs_bytes * TASK_SHARE / (1 - TASK_SHARE))
    # Streams of their own, not seed itself: the corpus should not pre-teach the exact
    # examples the tasks kind trains on.
    docs += _task_documents(f"fp8ops corpus tasks {seed}", task_budget, split_version)
    random.Random(f"fp8ops corpus order {seed}").shuffle(docs)
    data = b"".join(doc.encode("utf-8") + bytes([EOD]) for doc in docs)
    return Corpus(documents=tuple(docs), data=data, docs_bytes=docs_bytes)


def stdlib_documents() -> list[str]:
    """The documentation documents (``stdlib_docs.py``), collected in a clean interpreter.

    Not in this process: installed packages patch the standard library (importing torch
    replaces ``inspect.getfile``, docstring and all), and ``-OO`` strips docstrings. A fresh
    ``python -I -S`` sees only the standard library as shipped.
    """
    script = Path(__file__).with_name("stdlib_docs.py")
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(script)], capture_output=True, check=False
    )
    if result.returncode:
        error = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ManifestError(
            "data.kind: 'corpus' could not read this Python's documentation "
            f"({error[-1] if error else f'exit code {result.returncode}'}); "
            "use data.kind 'jsonl' with your own text instead"
        )
    return json.loads(result.stdout)


def _task_documents(seed: str, budget: int, split_version: int) -> list[str]:
    """Documents of task lines (prompt immediately followed by answer), ``budget`` bytes in all."""
    # Only prompts on the training side of every evaluation split a manifest can ask for; from
    # version 2 on, under both versions' keys, so a fine-tune of either version has none of
    # its held-out problems here.
    versions = (1,) if split_version == 1 else (1, 2)
    lines = (
        e.prompt + e.answer
        for e in example_stream(seed)
        if all(split_point(split_key(e, v)) >= MAX_EVAL_FRACTION for v in versions)
    )
    documents: list[str] = []
    used = 0
    while True:
        doc = "\n".join(itertools.islice(lines, TASK_LINES_PER_DOCUMENT))
        used += len(doc.encode("utf-8")) + 1
        if used > budget:
            return documents
        documents.append(doc)
