"""The training order: which sequences each step and each data-parallel rank sees.

Epoch ``e`` is the permutation ``torch.randperm(n, generator=manual_seed(seed + e))``, walked in
global batches of ``global_batch_size``; an incomplete last batch is dropped and the next
epoch begins. Data-parallel rank ``r`` of ``d`` takes the ``r``-th contiguous slice of each
global batch and splits it into micro-batches. So a step's global batch is the same whatever
the data-parallel size: DP changes who computes what, never what is computed.

The state is two integers and the seed, so a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fp8ops.data.batches import MicroBatch, Sequences
from fp8ops.errors import ManifestError


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of ``range(n)`` that epoch ``epoch`` walks."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


class TrainSampler:
    """Micro-batches of ``sequences`` for one data-parallel rank, step by step."""

    def __init__(
        self,
        sequences: Sequences,
        *,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ManifestError(
                f"schedule.global_batch_size: {global_batch_size} must be divisible by "
                f"schedule.micro_batch_size * topology.data_parallel ({micro_batch_size} * "
                f"{dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in 0..{dp_size - 1}")
        if len(sequences) < global_batch_size:
            raise ManifestError(
                f"schedule.global_batch_size: {global_batch_size} is more than the "
                f"{len(sequences)} training sequences; lower it, or add data "
                "(data.num_examples, a longer corpus or file, a shorter model.seq_length)"
            )
        self.sequences = sequences
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.cursor = 0  # sequences of this epoch's permutation already consumed
        self._order = epoch_order(len(sequences), seed, 0)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sequences) // self.global_batch_size

    def next_global_batch(self) -> torch.Tensor:
        """The indices of the next step's global batch (all ranks), advancing the state."""
        if self.cursor + self.global_batch_size > len(self.sequences):
            self.epoch += 1
            self.cursor = 0
            self._order = epoch_order(len(self.sequences), self.seed, self.epoch)
        batch = self._order[self.cursor : self.cursor + self.global_batch_size]
        self.cursor += self.global_batch_size
        return batch

    def next_step(self) -> list[MicroBatch]:
        """This rank's micro-batches for the next optimizer step."""
        per_rank = self.global_batch_size // self.dp_size
        mine = self.next_global_batch()[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [self.sequences.batch(part) for part in mine.split(self.micro_batch_size)]

    def describe(self) -> dict[str, Any]:
        """How the order is drawn, and a fingerprint of the first epoch's, for the run record."""
        first = epoch_order(len(self.sequences), self.seed, 0).numpy().astype("<i8").tobytes()
        return {
            "order": (
                "epoch e walks torch.randperm(n, seed + e) in global batches, an incomplete last "
                "batch dropped; data-parallel rank r takes the r-th slice of each global batch"
            ),
            "steps_per_epoch": self.steps_per_epoch,
            "epoch0_order_sha256": hashlib.sha256(first).hexdigest(),
            "position": self.state_dict(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain integers (JSON-able): where the next step starts."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s position."""
        if state["seed"] != self.seed:
            raise ManifestError(
                f"seeds.data: the checkpoint's data order was drawn with seed {state['seed']} "
                f"but this run's is {self.seed}; resuming would change the order mid-run. "
                "Resume with the original manifest revision."
            )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= len(self.sequences):
            raise ValueError(f"sampler state {state} does not fit {len(self.sequences)} sequences")
        self.epoch, self.cursor = epoch, cursor
        self._order = epoch_order(len(self.sequences), self.seed, epoch)
