"""The delayed-scaling recipe: the precision policy a scope applies, as TE's ``DelayedScaling``."""

from __future__ import annotations

from dataclasses import dataclass

from fp8ops.precision.formats import Fp8Format
from fp8ops.precision.scaling import AmaxAlgo, parse_amax_algo


@dataclass(frozen=True, kw_only=True)
class DelayedScalingRecipe:
    """Fields and defaults of TE's ``transformer_engine.common.recipe.DelayedScaling``."""

    fp8_format: Fp8Format = Fp8Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = parse_amax_algo("max")  # noqa: RUF009 - a frozen value
    margin: int = 0
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if self.fp8_format is Fp8Format.E5M2:
            Fp8Format.parse("e5m2")  # raises the explanatory error
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")

    @classmethod
    def from_precision(cls, precision) -> DelayedScalingRecipe:
        """Build from a manifest's ``precision`` section (already validated)."""
        return cls(
            fp8_format=Fp8Format.parse(precision.fp8_format),
            amax_history_len=precision.amax_history_len,
            amax_compute_algo=parse_amax_algo(precision.amax_compute_algo),
            margin=precision.margin,
            reduce_amax=precision.reduce_amax,
        )
