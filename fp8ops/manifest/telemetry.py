"""The ``telemetry`` section: how often per-layer FP8 telemetry is measured."""

from __future__ import annotations

from pydantic import Field, field_validator

from fp8ops.manifest.base import Section, added_field


class Telemetry(Section):
    """How often per-layer FP8 telemetry is measured and how fresh the store is."""

    every_steps: int = Field(
        1,
        ge=1,
        description=(
            "Measure cast statistics (saturation, underflow, NaN/Inf) and norms every N steps. "
            "Amax, scales and history statistics are recorded every step (they are there "
            "anyway); the cast statistics cost extra passes over every FP8 tensor."
        ),
    )
    error_sample_every: int = Field(
        10,
        ge=1,
        description=(
            "Measure FP8-vs-reference GEMM error every N steps (costs an extra base-dtype GEMM "
            "per sampled layer)."
        ),
    )
    error_sample_tokens: int | None = added_field(
        None,
        added_in="0.1.0",
        ge=1,
        description=(
            "Compare at most this many tokens of each micro-batch in the FP8-vs-reference error "
            "(every sequence's tokens at evenly spaced positions; at least one position), so "
            "the reference GEMM costs that many tokens, not the whole micro-batch. null: every "
            "token."
        ),
    )
    flush_steps: int = Field(
        256,
        ge=1,
        le=2048,
        description=(
            "Steps per block the store writes and commits: how far behind training a reader "
            "is at most. Must divide 2048 (the store's history shard); smaller blocks mean "
            "fresher reads and more, smaller chunks."
        ),
    )

    @field_validator("flush_steps")
    @classmethod
    def _divides_shard(cls, value: int) -> int:
        if 2048 % value:
            raise ValueError("must divide 2048 (1, 2, 4, ..., 2048)")
        return value
