"""The ``seeds`` section."""

from __future__ import annotations

from pydantic import Field

from fp8ops.manifest.base import Section

# Megatron adds offsets to the model seed per rank and torch takes at most 64 bits; 32 bits is
# what every generator a run seeds takes.
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
