"""The ``schedule`` section: how long, how big, how often."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8ops.manifest.base import Section, raise_problems


class Schedule(Section):
    """How long, how big, how often."""

    train_steps: int = Field(ge=1, description="Optimizer steps.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps; at most train_steps.")
    micro_batch_size: int = Field(
        1, ge=1, description="Sequences per forward pass per data-parallel rank."
    )
    global_batch_size: int = Field(
        ge=1,
        description="Sequences per optimizer step; a multiple of micro_batch_size * data_parallel.",
    )
    lr_decay: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay from lr to min_lr after warm-up."
    )
    log_interval: int = Field(1, ge=1, description="Steps between loss/throughput log lines.")
    eval_interval: int = Field(100, ge=1, description="Steps between evaluations.")
    eval_iters: int | None = Field(
        None,
        ge=1,
        description=(
            "Micro-batches of the held-out set per evaluation, always the same ones; null "
            "evaluates the whole set."
        ),
    )
    checkpoint_interval: int = Field(100, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(
        3, ge=1, description="Checkpoints kept on disk; older ones are deleted."
    )

    @model_validator(mode="after")
    def _warmup_fits(self) -> Schedule:
        problems = []
        if self.warmup_steps > self.train_steps:
            problems.append(
                (
                    ("warmup_steps",),
                    self.warmup_steps,
                    f"must be <= train_steps ({self.train_steps})",
                )
            )
        raise_problems("Schedule", problems)
        return self
