"""FP8 formats, the saturating cast, delayed scaling (TE-exact), the stateless recipes (current,
block, MXFP8; TE-exact casts), quantize, FP8 linear with its GEMM backends (emulated,
``torch._scaled_mm``), scope."""

from fp8ops.precision.formats import E4M3, E5M2, Fp8Dtype, Fp8Format, saturating_cast
from fp8ops.precision.linear import EmulatedGemm, Fp8Gemm, Fp8Linear, fp8_linear
from fp8ops.precision.quantize import CastStats, QuantizedTensor, amax_of, quantize
from fp8ops.precision.recipe import DelayedScalingRecipe, recipe_from_precision
from fp8ops.precision.scaled_mm import (
    ScaledMmGemm,
    block_scaled_mm_unsupported,
    one_call_block_gemm_unsupported,
    scaled_mm_unsupported,
)
from fp8ops.precision.scaling import AmaxAlgo, parse_amax_algo, update_delayed_scaling
from fp8ops.precision.scope import Fp8Scope, active_scope
from fp8ops.precision.state import Fp8Meta, ScalingState
from fp8ops.precision.stateless import CastRecord, StatelessRecipe

__all__ = [
    "E4M3",
    "E5M2",
    "AmaxAlgo",
    "CastRecord",
    "CastStats",
    "DelayedScalingRecipe",
    "EmulatedGemm",
    "Fp8Dtype",
    "Fp8Format",
    "Fp8Gemm",
    "Fp8Linear",
    "Fp8Meta",
    "Fp8Scope",
    "QuantizedTensor",
    "ScaledMmGemm",
    "ScalingState",
    "StatelessRecipe",
    "active_scope",
    "amax_of",
    "block_scaled_mm_unsupported",
    "fp8_linear",
    "one_call_block_gemm_unsupported",
    "parse_amax_algo",
    "quantize",
    "recipe_from_precision",
    "saturating_cast",
    "scaled_mm_unsupported",
    "update_delayed_scaling",
]
