"""Token sequences as the model sees them, and the batches cut from them.

Every sequence is a window of ``seq_length + 1`` token ids; the model reads ``tokens =
window[:-1]`` and predicts ``labels = window[1:]``, so position ``i`` is scored on the token at
``i + 1``. ``loss_mask`` says which positions count:

* pre-training (``text_sequences``): documents, each followed by EOD, are concatenated and cut
  into non-overlapping windows; every position counts. A window may start mid-document and
  hold several; positions are 0..seq_length-1 in every window (no reset at EOD, Megatron's
  default), and attention is plain causal across document boundaries.
* SFT (``sft_sequences``): one example per window, ``prompt + answer + EOD`` right-padded with
  PAD; a position counts exactly when its label is an answer token or that final EOD.

A micro-batch is ``seq_length`` positions wide, or (``data.pad_to: longest``) as wide as its
longest row rounded up to ``LONGEST_MULTIPLE``. The data fingerprint hashes the rows padded to
``seq_length`` either way: it names the data, not how batches are cut from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from fp8ops.data.tasks import Example
from fp8ops.data.tokenizer import TextRefused, Tokenizer
from fp8ops.errors import ManifestError

# How many positions the fingerprint pads and hashes at a time (about 20 MB of padded tensors).
DIGEST_POSITIONS = 1 << 20

# What ``pad_to: longest`` rounds a micro-batch's width up to: FP8 GEMMs take token counts in
# multiples of 16 (cuBLASLt's K in the weight-gradient GEMM, whose K is the tokens; TE asks 8),
# so no GEMM pads again; NeMo pads its FP8 SFT batches to the same multiple.
LONGEST_MULTIPLE = 16


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass worth of sequences."""

    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32, 1 where the label is scored
    position_ids: torch.Tensor  # [b, s] int64, 0..s-1 in every row
    indices: torch.Tensor  # [b] int64, which sequences of their split (for the record)

    def to(self, device: torch.device | str) -> MicroBatch:
        """The batch with what the model reads (tokens, labels, loss mask, positions) on
        ``device``; ``indices`` stay on the host (they index host-side records). On the device
        the batch is already on, this is the batch itself."""
        device = torch.device(device)
        moved = (self.tokens, self.labels, self.loss_mask, self.position_ids)
        if all(t.device == device for t in moved):
            return self
        tokens, labels, loss_mask, position_ids = (t.to(device) for t in moved)
        return MicroBatch(tokens, labels, loss_mask, position_ids, self.indices)


@dataclass(frozen=True)
class Sequences:
    """One split (train or eval): ``len(self)`` sequences of ``seq_length`` positions.

    Held ragged: the windows' ids back to back in ``ids`` (in :func:`id_dtype`: one byte per
    token for the byte tokenizer), and ``starts``, where each window begins. Window ``i`` is
    ``ids[starts[i]:starts[i + 1]]``; one shorter than ``seq_length + 1`` (an SFT example) is
    right-padded with ``pad`` only when a batch is cut. Its loss counts from label position
    ``scored_from[i]`` to the window's end.
    Held padded ([n, seq_length] tokens, labels and mask: 20 bytes a position), a 3.8 MB SFT
    file of 20,000 short examples at seq_length 4096 took 1.6 GB per rank (``ci/bench_data.py``).
    """

    ids: np.ndarray  # 1-D, any integer dtype (id_dtype's when built here)
    starts: np.ndarray  # [n + 1] int64, offsets into ids
    scored_from: np.ndarray  # [n] int64, the first label position in the loss
    seq_length: int
    pad: int
    # data.pad_to: "seq_length" (every batch seq_length wide) or "longest" (batch_width).
    pad_to: str = "seq_length"
    # SFT only (empty for pre-training): the example behind each row, for generation-based
    # evaluation, and its bucket labels.
    examples: tuple[Example, ...] = ()
    # Chat only: aligned with ``ids``, 1 where that id is an assistant token (a label position
    # is scored when the id it predicts is); ``scored_from`` is then 0. None: scored_from rules.
    scored: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.pad_to not in ("seq_length", "longest"):
            raise ValueError(f"pad_to must be 'seq_length' or 'longest', not {self.pad_to!r}")

    def __len__(self) -> int:
        return len(self.starts) - 1

    @cached_property
    def buckets(self) -> tuple[dict[str, str], ...]:
        """Each row's bucket labels (empty for pre-training)."""
        return tuple(example.buckets for example in self.examples)

    def split_at(self, n: int) -> tuple[Sequences, Sequences]:
        """(the first ``n`` rows, the rest), sharing ``ids``."""

        def part(starts: np.ndarray, scored_from: np.ndarray, examples: tuple) -> Sequences:
            return dataclasses.replace(
                self, starts=starts, scored_from=scored_from, examples=examples
            )

        return (
            part(self.starts[: n + 1], self.scored_from[:n], self.examples[:n]),
            part(self.starts[n:], self.scored_from[n:], self.examples[n:]),
        )

    def rows(self, indices: torch.Tensor | Sequence[int] | np.ndarray) -> np.ndarray:
        """``indices`` as an int64 array of this split's rows (a row outside ``0 … n - 1``,
        negative ones included, is an error: ``starts[-1]`` would read as an empty row)."""
        rows = np.asarray(indices, dtype=np.int64)
        if rows.ndim != 1:
            raise IndexError(f"rows must be a 1-D sequence of indices, not shape {rows.shape}")
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            bad = rows[(rows < 0) | (rows >= len(self))][0]
            raise IndexError(f"row {bad} is not one of this split's {len(self)} rows")
        return rows

    def batch_width(self, rows: np.ndarray) -> int:
        """How many positions a micro-batch of ``rows`` holds: ``seq_length``, or under
        ``pad_to: longest`` its longest row's label positions rounded up to
        ``LONGEST_MULTIPLE`` (at most ``seq_length``)."""
        if self.pad_to == "seq_length" or not len(rows):
            return self.seq_length
        longest = int((self.starts[rows + 1] - self.starts[rows]).max()) - 1
        return min(self.seq_length, -(-longest // LONGEST_MULTIPLE) * LONGEST_MULTIPLE)

    def windows(self, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        """The rows ``rows`` (from :meth:`rows`) as padded windows ``[b, width + 1]``
        (``width``: ``seq_length`` unless given; no row may be longer)."""
        start = self.starts[rows]
        length = self.starts[rows + 1] - start
        position = np.arange((self.seq_length if width is None else width) + 1)
        if (length == len(position)).all():  # every window exactly full, nothing to pad
            return self.ids[start[:, None] + position].astype(np.int64)
        inside = position < length[:, None]
        # Positions past a window's end read ids[0] (any valid index) and are then replaced.
        gathered = self.ids[np.where(inside, start[:, None] + position, 0)] if self.ids.size else 0
        return np.where(inside, gathered, self.pad).astype(np.int64)

    def loss_mask(self, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        """The rows' loss masks ``[b, width]`` (float32; ``width``: ``seq_length`` unless
        given): 1 from ``scored_from`` up to the window's last label position."""
        position = np.arange(self.seq_length if width is None else width)
        last = self.starts[rows + 1] - self.starts[rows] - 1
        scored = (position >= self.scored_from[rows, None]) & (position < last[:, None])
        if self.scored is not None:  # label p predicts id p + 1 of the window
            at = np.where(scored, self.starts[rows, None] + position + 1, 0)
            scored &= self.scored[at].astype(bool)
        return scored.astype(np.float32)

    def batch(self, indices: torch.Tensor | Sequence[int]) -> MicroBatch:
        """The rows ``indices``, in that order."""
        indices = torch.as_tensor(indices, dtype=torch.int64)
        rows = self.rows(indices.numpy())
        b, s = len(rows), self.batch_width(rows)
        windows = self.windows(rows, s)
        return MicroBatch(
            tokens=torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
            labels=torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
            loss_mask=torch.from_numpy(self.loss_mask(rows, s)),
            position_ids=torch.arange(s, dtype=torch.int64).expand(b, s).contiguous(),
            indices=indices,
        )

    def batches(self, micro_batch_size: int) -> Iterator[MicroBatch]:
        """All rows in order, ``micro_batch_size`` at a time (the last batch may be smaller)."""
        for start in range(0, len(self), micro_batch_size):
            yield self.batch(range(start, min(start + micro_batch_size, len(self))))

    def loss_tokens(self) -> int:
        lengths = np.diff(self.starts)
        if self.scored is not None:
            return int(sum(self.scored[a + 1 : b].sum() for a, b in pairwise(self.starts)))
        return int((lengths - 1 - self.scored_from).sum())

    def summary(self) -> dict[str, Any]:
        histogram: dict[str, Counter[str]] = {}
        for buckets in self.buckets:
            for name, value in buckets.items():
                histogram.setdefault(name, Counter())[value] += 1
        return {
            "sequences": len(self),
            "tokens": len(self) * self.seq_length,
            "loss_tokens": self.loss_tokens(),
            "buckets": {
                name: dict(sorted(counts.items())) for name, counts in sorted(histogram.items())
            },
        }


def id_dtype(vocab_size: int) -> type[np.integer]:
    """The smallest dtype that holds a vocabulary's ids: bytes take one byte a token, a 50k
    vocabulary two, Llama 3's 128k four."""
    return np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.int32


def text_sequences(stream: bytes | np.ndarray, seq_length: int) -> Sequences:
    """Pre-training sequences: non-overlapping windows of ``seq_length + 1`` ids of a token
    stream (byte tokens as ``bytes``, any tokenizer's ids as an integer array), every position
    scored. The tail that does not fill a window is dropped."""
    width = seq_length + 1
    ids = np.frombuffer(stream, dtype=np.uint8) if isinstance(stream, bytes) else stream
    n = len(ids) // width
    return Sequences(
        ids=ids[: n * width],
        starts=np.arange(n + 1, dtype=np.int64) * width,
        scored_from=np.zeros(n, dtype=np.int64),
        seq_length=seq_length,
        pad=0,  # never read: every window is full
    )


def sft_sequences(
    examples: Sequence[Example], seq_length: int, tokenizer: Tokenizer, pad_to: str = "seq_length"
) -> Sequences:
    """One sequence per example, ``prompt + answer + EOD``; the loss only on the answer and
    its EOD. Padded with ``tokenizer.pad`` when batched, as far as ``pad_to`` says."""
    width = seq_length + 1
    try:  # prompt, answer, prompt, answer, ...: one batch (a tokenizer.json encodes in threads)
        encoded = tokenizer.encode_many([t for e in examples for t in (e.prompt, e.answer)])
    except TextRefused as exc:
        raise refused(examples[exc.index // 2].origin, exc) from None
    parts, lengths, prompts, longest, too_long = [], [], [], 0, []
    longest_example: Example | None = None
    dtype = id_dtype(tokenizer.vocab_size)
    for row, example in enumerate(examples):
        prompt, answer = encoded[2 * row], encoded[2 * row + 1]
        if not prompt:
            raise ValueError(
                "an SFT prompt must not be empty: no position would predict the answer"
            )
        ids = prompt + answer + [tokenizer.eod]
        if len(ids) > longest:
            longest, longest_example = len(ids), example
        if len(ids) > width:
            too_long.append(example)  # reported below with the longest: one fix covers them all
            continue
        parts.append(np.asarray(ids, dtype=dtype))
        lengths.append(len(ids))
        prompts.append(len(prompt))
    if too_long:
        where = [example.origin for example in too_long[:3] if example.origin]
        more = f" and {len(too_long) - len(where)} more" if where and len(too_long) > 3 else ""
        at = f" ({'; '.join(where)}{more})" if where else ""
        found = f", {longest_example.origin}" if longest_example and longest_example.origin else ""
        raise ManifestError(
            f"model.seq_length: {seq_length} is too short for the data: {len(too_long)} of "
            f"{len(examples)} examples do not fit{at}; the longest is {longest} tokens (prompt + "
            f"answer + end-of-document{found}), and a sequence holds seq_length + 1 = {width}. "
            f"Raise model.seq_length to at least {longest - 1} or shorten the examples; fp8ops "
            "does not truncate them."
        )
    return Sequences(
        ids=np.concatenate(parts) if parts else np.zeros(0, dtype=dtype),
        starts=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        # Window position p is predicted at position p - 1: the answer occupies window
        # positions [len(prompt), len(ids)), so its labels sit at [len(prompt) - 1, len(ids) - 1).
        scored_from=np.asarray(prompts, dtype=np.int64) - 1,
        seq_length=seq_length,
        pad=tokenizer.pad,
        pad_to=pad_to,
        examples=tuple(examples),
    )


def chat_sequences(
    rendered: Sequence, seq_length: int, tokenizer: Tokenizer, pad_to: str, overlong: str
) -> tuple[Sequences, dict[str, int]]:
    """One sequence per rendered conversation (``fp8ops.data.chat.Rendered``), the loss on its
    assistant tokens; one longer than ``seq_length + 1`` dropped or truncated (``overlong``),
    and one left without an assistant token dropped. Returns the sequences and the counts."""
    width = seq_length + 1
    dtype = id_dtype(tokenizer.vocab_size)
    ids, masks, lengths, examples = [], [], [], []
    counts = {"conversations": len(rendered), "overlong_dropped": 0, "overlong_truncated": 0}
    counts["no_assistant_tokens_dropped"] = 0
    for item in rendered:
        row_ids, row_mask = item.ids, item.scored
        if len(row_ids) > width:
            if overlong == "drop":
                counts["overlong_dropped"] += 1
                continue
            counts["overlong_truncated"] += 1
            row_ids, row_mask = row_ids[:width], row_mask[:width]
        if not row_mask[1:].any():  # no label position would be scored
            counts["no_assistant_tokens_dropped"] += 1
            continue
        ids.append(row_ids.astype(dtype))
        masks.append(row_mask)
        lengths.append(len(row_ids))
        examples.append(item.example)
    sequences = Sequences(
        ids=np.concatenate(ids) if ids else np.zeros(0, dtype=dtype),
        starts=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        scored_from=np.zeros(len(lengths), dtype=np.int64),
        seq_length=seq_length,
        pad=tokenizer.pad,
        pad_to=pad_to,
        examples=tuple(examples),
        scored=np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8),
    )
    return sequences, counts


def refused(origin: str, exc: TextRefused) -> ManifestError:
    """The tokenizer's refusal of a text, named by where the text is (``FILE: line N``)."""
    where = f"{origin}: " if origin else ""
    return ManifestError(f"{where}{exc}; remove it from the data")


@dataclass(frozen=True)
class TokenizedData:
    """Train and eval sequences for one manifest, and the fingerprint of what the model sees."""

    kind: str  # the manifest's data.kind
    objective: str  # "pretrain" (every token scored) or "sft" (answers scored)
    train: Sequences
    eval: Sequences
    source: dict[str, Any] = field(default_factory=dict)  # where it came from, for the record

    @property
    def seq_length(self) -> int:
        return self.train.seq_length

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over both splits' tokens, labels, loss masks and bucket labels, in order."""
        digest = hashlib.sha256(b"fp8ops tokenized data v1\n")
        for name, split in (("train", self.train), ("eval", self.eval)):
            digest.update(f"{name} {len(split)} {split.seq_length}\n".encode())
            # The bytes of the padded [n, s] tokens, labels and loss mask, each in turn (the
            # digest of runs made when they were held padded), cut a few rows at a time so that
            # none is held whole. Fixed little-endian dtypes: the same digest on any machine.
            step = max(1, DIGEST_POSITIONS // max(1, split.seq_length))
            chunks = [
                np.arange(start, min(start + step, len(split)), dtype=np.int64)
                for start in range(0, len(split), step)
            ]
            for columns in (slice(None, -1), slice(1, None)):  # tokens, then labels
                for rows in chunks:
                    part = np.ascontiguousarray(split.windows(rows)[:, columns])
                    digest.update(part.astype("<i8", copy=False))
            for rows in chunks:
                digest.update(split.loss_mask(rows).astype("<f4", copy=False))
            digest.update(json.dumps(list(split.buckets), sort_keys=True).encode())
        if "chat_template_sha256" in self.source:  # what rendered the conversations
            digest.update(f"chat template {self.source['chat_template_sha256']}\n".encode())
        return digest.hexdigest()

    def eval_batches(self, micro_batch_size: int) -> Iterator[MicroBatch]:
        """The eval split in its fixed order (the last micro-batch may be smaller)."""
        return self.eval.batches(micro_batch_size)

    def summary(self) -> dict[str, Any]:
        """Plain JSON-able facts: kind, counts, tokens, bucket histograms, fingerprints."""
        return {
            "kind": self.kind,
            "objective": self.objective,
            "fingerprint": self.fingerprint,
            "seq_length": self.seq_length,
            "source": self.source,
            "train": self.train.summary(),
            "eval": self.eval.summary(),
        }
