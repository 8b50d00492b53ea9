"""GPT layer specs with fp8ops' FP8 projections, swapped in by ModuleSpec.

The four projections of a dense GPT layer become FP8; everything else stays Megatron's plain local
module (norms, core attention; the embedding and the LM head are built by ``GPTModel``, outside the
layer spec). The module names are those of Megatron's Transformer Engine spec,
``decoder.layers.{i}.self_attention.linear_qkv`` and so on, so manifests' module globs, telemetry
and checkpoints name the same modules on the CPU emulation and on a TE run.

The GEMM those projections run is a constructor argument the spec carries (``gemm``): the emulated
FP8 GEMM, or ``torch._scaled_mm`` (``fp8ops.precision.ScaledMmGemm``) for FP8 tensor cores. The
casts and the delayed-scaling state are the same either way; ``build_gpt`` picks the GEMM from
``precision.backend``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from fp8ops.megatron.compat import (
    ColumnParallelLinear,
    ModuleSpec,
    RowParallelLinear,
    TransformerBlockSubmodules,
    block_submodules,
    get_gpt_layer_local_spec,
    with_block_submodules,
)
from fp8ops.megatron.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from fp8ops.megatron.norm import SequenceParallelNorm
from fp8ops.precision import DelayedScalingRecipe, Fp8Gemm, StatelessRecipe


def get_gpt_layer_fp8_emulated_spec(
    recipe: DelayedScalingRecipe | StatelessRecipe,
    *,
    gemm: Fp8Gemm | None = None,
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm",
) -> ModuleSpec:
    """Megatron's local GPT layer spec with the four projections in FP8 under ``recipe``.

    ``gemm`` defaults to the emulated FP8 GEMM (any device); ``ScaledMmGemm()`` runs them on
    ``torch._scaled_mm``. (The name predates the native GEMM: the layers are fp8ops' own either
    way, as opposed to Transformer Engine's.)
    """
    return with_fp8_projections(get_gpt_layer_local_spec(normalization=normalization), recipe, gemm)


def with_fp8_projections(
    layer_spec: ModuleSpec,
    recipe: DelayedScalingRecipe | StatelessRecipe,
    gemm: Fp8Gemm | None = None,
) -> ModuleSpec:
    """A copy of a local-spec GPT layer with ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
    ``linear_fc2`` in FP8. ``layer_spec`` itself is not modified."""
    params = {"recipe": recipe, "gemm": gemm}
    column = ModuleSpec(module=Fp8ColumnParallelLinear, params=params)
    row = ModuleSpec(module=Fp8RowParallelLinear, params=params)
    layer = layer_spec.submodules
    attention, mlp = layer.self_attention, layer.mlp
    _expect(attention, "self_attention", linear_qkv=ColumnParallelLinear)
    _expect(attention, "self_attention", linear_proj=RowParallelLinear)
    _expect(mlp, "mlp", linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    attention = with_block_submodules(attention, linear_qkv=column, linear_proj=row)
    mlp = with_block_submodules(mlp, linear_fc1=column, linear_fc2=row)
    return replace(layer_spec, submodules=replace(layer, self_attention=attention, mlp=mlp))


def with_sequence_parallel_norms(
    layer_spec: ModuleSpec, num_layers: int
) -> TransformerBlockSubmodules:
    """The decoder block of ``num_layers`` copies (a pipeline stage's layers) of a local-spec
    layer whose norms (input, pre-MLP, query/key where it has them, and the block's final norm)
    are :class:`SequenceParallelNorm`: torch's norms, which Megatron's local spec refuses under
    sequence parallelism without Apex. Where Apex is installed its ``FusedLayerNorm`` is replaced
    too, so a run's norms are the same kernels on every machine."""
    layer = layer_spec.submodules
    attention = layer.self_attention
    qk = {
        slot: SequenceParallelNorm
        for slot in ("q_layernorm", "k_layernorm")
        if getattr(block_submodules(attention), slot, None) is not None
        and getattr(block_submodules(attention), slot).__name__ != "IdentityOp"
    }
    layer = replace(
        layer,
        input_layernorm=SequenceParallelNorm,
        pre_mlp_layernorm=SequenceParallelNorm,
        self_attention=with_block_submodules(attention, **qk) if qk else attention,
    )
    return TransformerBlockSubmodules(
        layer_specs=[replace(layer_spec, submodules=layer)] * num_layers,
        layer_norm=SequenceParallelNorm,
    )


def _expect(block, name: str, **slots: type) -> None:
    # A TE spec, an MoE layer or an already swapped one is not what this transform knows.
    for slot, expected in slots.items():
        current = getattr(block_submodules(block), slot, None)
        if current is not expected:
            raise ValueError(
                f"layer spec slot {name}.{slot} holds {current!r}, expected Megatron's "
                f"{expected.__name__} (start from get_gpt_layer_local_spec for a dense layer)"
            )
