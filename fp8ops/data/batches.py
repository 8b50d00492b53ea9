"""Token sequences as the model sees them, and the batches cut from them.

Every sequence is a window of ``seq_length + 1`` token ids; the model reads ``tokens =
window[:-1]`` and predicts ``labels = window[1:]``, so position ``i`` is scored on the token at
``i + 1``. ``loss_mask`` says which positions count:

* pre-training (``pack_documents``): documents, each followed by EOD, are concatenated and cut
  into non-overlapping windows; every position counts. A window may start mid-document and
  hold several; positions are 0..seq_length-1 in every window (no reset at EOD, Megatron's
  default), and attention is plain causal across document boundaries.
* SFT (``sft_sequences``): one example per window, ``prompt + answer + EOD`` right-padded with
  PAD; a position counts exactly when its label is an answer token or that final EOD.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from fp8ops.data.tasks import Example
from fp8ops.data.tokenizer import TextRefused, Tokenizer
from fp8ops.errors import ManifestError


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
    """One split (train or eval): n sequences of s positions."""

    tokens: torch.Tensor  # [n, s] int64
    labels: torch.Tensor  # [n, s] int64
    loss_mask: torch.Tensor  # [n, s] float32
    # SFT only (empty for pre-training): the example behind each row, for generation-based
    # evaluation, and its bucket labels.
    examples: tuple[Example, ...] = ()

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    @cached_property
    def buckets(self) -> tuple[dict[str, str], ...]:
        """Each row's bucket labels (empty for pre-training)."""
        return tuple(example.buckets for example in self.examples)

    def split_at(self, n: int) -> tuple[Sequences, Sequences]:
        """(the first ``n`` rows, the rest)."""
        head = Sequences(self.tokens[:n], self.labels[:n], self.loss_mask[:n], self.examples[:n])
        tail = Sequences(self.tokens[n:], self.labels[n:], self.loss_mask[n:], self.examples[n:])
        return head, tail

    def batch(self, indices: torch.Tensor | Sequence[int]) -> MicroBatch:
        """The rows ``indices``, in that order."""
        indices = torch.as_tensor(indices, dtype=torch.int64)
        b, s = len(indices), self.seq_length
        return MicroBatch(
            tokens=self.tokens[indices],
            labels=self.labels[indices],
            loss_mask=self.loss_mask[indices],
            position_ids=torch.arange(s, dtype=torch.int64).expand(b, s).contiguous(),
            indices=indices,
        )

    def batches(self, micro_batch_size: int) -> Iterator[MicroBatch]:
        """All rows in order, ``micro_batch_size`` at a time (the last batch may be smaller)."""
        for start in range(0, len(self), micro_batch_size):
            yield self.batch(range(start, min(start + micro_batch_size, len(self))))

    def summary(self) -> dict[str, Any]:
        histogram: dict[str, Counter[str]] = {}
        for buckets in self.buckets:
            for name, value in buckets.items():
                histogram.setdefault(name, Counter())[value] += 1
        return {
            "sequences": len(self),
            "tokens": self.tokens.numel(),
            "loss_tokens": int(self.loss_mask.sum().item()),
            "buckets": {
                name: dict(sorted(counts.items())) for name, counts in sorted(histogram.items())
            },
        }


def pack_documents(stream: bytes | np.ndarray, seq_length: int) -> torch.Tensor:
    """Non-overlapping windows ``[n, seq_length + 1]`` (int64) of a token stream: byte tokens
    as ``bytes``, or any tokenizer's ids as an integer array.

    The tail that does not fill a window is dropped.
    """
    width = seq_length + 1
    ids = np.frombuffer(stream, dtype=np.uint8) if isinstance(stream, bytes) else stream
    n = len(ids) // width
    return torch.from_numpy(ids[: n * width].astype(np.int64)).reshape(n, width)


def text_sequences(windows: torch.Tensor) -> Sequences:
    """Pre-training sequences from ``pack_documents`` windows: every position scored."""
    return Sequences(
        tokens=windows[:, :-1].contiguous(),
        labels=windows[:, 1:].contiguous(),
        loss_mask=torch.ones(windows.shape[0], windows.shape[1] - 1, dtype=torch.float32),
    )


def sft_sequences(examples: Sequence[Example], seq_length: int, tokenizer: Tokenizer) -> Sequences:
    """One padded sequence per example; the loss only on the answer and its EOD."""
    width = seq_length + 1
    windows = np.full((len(examples), width), tokenizer.pad, dtype=np.int64)
    mask = np.zeros((len(examples), seq_length), dtype=np.float32)
    try:  # prompt, answer, prompt, answer, ...: one batch (a tokenizer.json encodes in threads)
        encoded = tokenizer.encode_many([t for e in examples for t in (e.prompt, e.answer)])
    except TextRefused as exc:
        raise refused(examples[exc.index // 2].origin, exc) from None
    longest, too_long = 0, []
    for row, example in enumerate(examples):
        prompt, answer = encoded[2 * row], encoded[2 * row + 1]
        if not prompt:
            raise ValueError(
                "an SFT prompt must not be empty: no position would predict the answer"
            )
        ids = prompt + answer + [tokenizer.eod]
        longest = max(longest, len(ids))
        if len(ids) > width:
            too_long.append(example)  # reported below with the longest: one fix covers them all
            continue
        windows[row, : len(ids)] = ids
        # Window position p is predicted at position p - 1: the answer occupies window
        # positions [len(prompt), len(ids)), so its labels sit at [len(prompt) - 1, len(ids) - 1).
        mask[row, len(prompt) - 1 : len(ids) - 1] = 1.0
    if too_long:
        where = [example.origin for example in too_long[:3] if example.origin]
        more = f" and {len(too_long) - len(where)} more" if where and len(too_long) > 3 else ""
        at = f" ({'; '.join(where)}{more})" if where else ""
        raise ManifestError(
            f"model.seq_length: {seq_length} is too short for the data: {len(too_long)} of "
            f"{len(examples)} examples do not fit{at}; the longest is {longest} tokens (prompt + "
            f"answer + end-of-document), and a sequence holds seq_length + 1 = {width}. Raise "
            f"model.seq_length to at least {longest - 1} or shorten the examples; fp8ops does "
            "not truncate them."
        )
    windows_t = torch.from_numpy(windows)
    return Sequences(
        tokens=windows_t[:, :-1].contiguous(),
        labels=windows_t[:, 1:].contiguous(),
        loss_mask=torch.from_numpy(mask),
        examples=tuple(examples),
    )


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
            for tensor in (split.tokens, split.labels, split.loss_mask):
                # Fixed little-endian dtypes, so the digest does not depend on the machine.
                dtype = "<f4" if tensor.is_floating_point() else "<i8"
                digest.update(tensor.numpy().astype(dtype, copy=False).tobytes())
            digest.update(json.dumps(list(split.buckets), sort_keys=True).encode())
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
