"""The ``seeds`` section."""

from __future__ import annotations

from pydantic import Field

from fp8ops.manifest.base import Section


class Seeds(Section):
    """Random seeds, recorded so a rerun is comparable step by step."""

    model: int = Field(
        1234,
        ge=0,
        description="Seed for weight initialisation (when not loading a checkpoint) and dropout.",
    )
    data: int = Field(1234, ge=0, description="Seed for data order and generated data.")
