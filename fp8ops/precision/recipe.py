"""The delayed-scaling recipe: the precision policy a scope applies, as TE's ``DelayedScaling``."""

from __future__ import annotations

from dataclasses import dataclass

from fp8ops.precision.formats import Fp8Format
from fp8ops.precision.scaling import AmaxAlgo, parse_amax_algo
from fp8ops.precision.stateless import StatelessRecipe


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


def recipe_from_precision(precision) -> DelayedScalingRecipe | StatelessRecipe:
    """The recipe a manifest's ``precision`` section (already validated) names in
    ``scaling``, with TE's defaults where the section leaves a field unset."""
    if precision.scaling == "delayed":
        return DelayedScalingRecipe.from_precision(precision)
    fp8_format = Fp8Format.parse(precision.fp8_format)
    if precision.scaling == "mxfp8":
        return StatelessRecipe.mxfp8(fp8_format)
    power_2 = precision.power_2_scale
    if precision.scaling == "current":
        return StatelessRecipe.current(
            fp8_format, power_2_scale=bool(power_2), amax_epsilon=precision.amax_epsilon
        )
    return StatelessRecipe(
        kind="block",
        fp8_format=fp8_format,
        power_2_scale=True if power_2 is None else power_2,
        amax_epsilon=precision.amax_epsilon,
        x_block_scaling_dim=precision.x_block_scaling_dim,
        w_block_scaling_dim=precision.w_block_scaling_dim,
        grad_block_scaling_dim=precision.grad_block_scaling_dim,
    )
