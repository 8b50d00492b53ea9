"""The three escalating thresholds of each per-layer alert metric (the ``alerts`` section's
``saturation``, ``underflow``, ``blocks_at_floor``, ``scale_change`` and ``fp8_rel_error``)."""

from __future__ import annotations

import itertools
from typing import Annotated

from pydantic import Field, model_validator

from fp8ops.manifest.base import Fraction, Section, raise_problems


class Levels(Section):
    """Three escalating thresholds for one per-layer metric; null turns a level off.

    observe: log it. degrade: propose a BF16 override for the layer. stop: checkpoint and halt.
    Set levels must be ordered observe <= degrade <= stop. A level you don't write keeps the
    metric's default; write null to turn it off.
    """

    @model_validator(mode="after")
    def _ordered(self) -> Levels:
        levels = [(name, getattr(self, name)) for name in ("observe", "degrade", "stop")]
        present = [(name, value) for name, value in levels if value is not None]
        problems = []
        for (low_name, low), (high_name, high) in itertools.pairwise(present):
            if low <= high:
                continue
            # Blame the level the user wrote, not the default it collides with.
            if high_name in self.model_fields_set:
                default = "" if low_name in self.model_fields_set else ", its default"
                problems.append(((high_name,), high, f"must be >= {low_name} ({low:g}{default})"))
            else:
                problems.append(
                    ((low_name,), low, f"must be <= {high_name} ({high:g}, its default)")
                )
        raise_problems(type(self).__name__, problems)
        return self


class SaturationLevels(Levels):
    """Fraction of a tensor's elements that clip at the FP8 maximum after scaling."""

    observe: Fraction | None = Field(
        1e-4,
        description=(
            "More than one element in ten thousand clipped, sustained: the delayed scale is "
            "stale. (A single clipped element of a 64k-element weight as it grows is 1.5e-5.)"
        ),
    )
    degrade: Fraction | None = Field(
        1e-3, description="0.1% clipped outliers: they carry much of the signal; propose BF16."
    )
    stop: Fraction | None = Field(
        1e-2, description="1% clipped: amax is running away (the pattern before FP8 NaNs)."
    )


class UnderflowLevels(Levels):
    """Fraction of a tensor's non-zero elements that flush to zero in FP8."""

    observe: Fraction | None = Field(0.01, description="1% of values lost to zero: worth watching.")
    degrade: Fraction | None = Field(
        0.05, description="5% lost: the scale is too small for this tensor's range; propose BF16."
    )
    stop: Fraction | None = Field(
        None,
        description=(
            "Off by default: underflow degrades quality gradually; the evaluation gates catch it."
        ),
    )


class BlocksAtFloorLevels(Levels):
    """Share of a block-scaled tensor's non-zero blocks whose scale sat at its floor (block
    scaling and MXFP8 only): no scale was large enough, so the block's values flush to zero.

    Every level is off by default: the rule came after runs of these recipes existed, and a
    default must leave them as they ran (``added_field``). Suggested: observe 1e-3 (one block in
    a thousand beyond any scale's reach), degrade 1e-2 (1% of blocks lost whole: propose BF16)."""

    observe: Fraction | None = Field(None, description="Off by default; suggested 1e-3.")
    degrade: Fraction | None = Field(None, description="Off by default; suggested 1e-2.")
    stop: Fraction | None = Field(
        None, description="Off by default: like underflow, the evaluation gates catch the damage."
    )


class ScaleChangeLevels(Levels):
    """Step-to-step factor by which a tensor's scale moved (max(new/old, old/new), > 1)."""

    observe: Annotated[float, Field(gt=1)] | None = Field(
        4.0, description="Amax moved two binades in one step."
    )
    degrade: Annotated[float, Field(gt=1)] | None = Field(
        16.0, description="Four binades: the layer's distribution is unstable."
    )
    stop: Annotated[float, Field(gt=1)] | None = Field(
        1024.0,
        description="Ten binades, sustained: an amax spike of the kind that precedes divergence.",
    )


class Fp8ErrorLevels(Levels):
    """Relative error ||y_fp8 - y_ref|| / ||y_ref|| of a sampled GEMM against the base dtype."""

    observe: Annotated[float, Field(ge=0)] | None = Field(
        0.06,
        description=(
            "Rounding both operands to E4M3 gives ~0.037 on well-scaled data; 0.06 is clearly "
            "above that floor."
        ),
    )
    degrade: Annotated[float, Field(ge=0)] | None = Field(
        0.10, description="10%: FP8 is measurably changing the layer; propose BF16."
    )
    stop: Annotated[float, Field(ge=0)] | None = Field(
        0.25,
        description="A quarter of the output is error: the layer no longer computes its function.",
    )
