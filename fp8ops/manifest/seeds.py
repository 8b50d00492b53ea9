"""The ``seeds`` section."""

from __future__ import annotations

from pydantic import Field

from fp8ops.manifest.base import Section

# Why 32 bits: Megatron adds offsets to the model seed (+2718, and per rank) that must stay
# within torch's 64-bit seeds, and numpy's legacy seeds take 32 bits; 32 bits leave room for all.
SEED_MAX = 2**32 - 1


class Seeds(Section):
    """Random seeds, recorded so a rerun is comparable step by step."""

    model: int = Field(
        1234,
        ge=0,
        le=SEED_MAX,
        description="Seed for weight initialisation (when not loading a checkpoint) and dropout.",
    )
    data: int = Field(
        1234, ge=0, le=SEED_MAX, description="Seed for data order and generated data."
    )
