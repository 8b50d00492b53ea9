"""Megatron-Core GPT with fp8ops' FP8 projections (``pip install 'fp8ops[megatron]'``).

Reading order: ``compat`` (the one place Megatron is imported), ``cpu_shims`` (what a CPU-only
torch needs), ``layers`` (the FP8 tensor-parallel linears), ``spec`` (where they go in a GPT
layer), ``config`` (Megatron's config of the manifest's model), ``model`` (the GPT from a
manifest).
"""

from fp8ops.megatron.config import transformer_config
from fp8ops.megatron.cpu_shims import apply_cpu_shims
from fp8ops.megatron.layers import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    fp8_modules,
    mark_first_microbatch,
)
from fp8ops.megatron.model import (
    amax_reduction_group,
    build_gpt,
    check_gemms_run,
    fp8_state_modules,
)
from fp8ops.megatron.spec import get_gpt_layer_fp8_emulated_spec, with_fp8_projections

__all__ = [
    "Fp8ColumnParallelLinear",
    "Fp8RowParallelLinear",
    "amax_reduction_group",
    "apply_cpu_shims",
    "build_gpt",
    "check_gemms_run",
    "fp8_modules",
    "fp8_state_modules",
    "get_gpt_layer_fp8_emulated_spec",
    "mark_first_microbatch",
    "transformer_config",
    "with_fp8_projections",
]
