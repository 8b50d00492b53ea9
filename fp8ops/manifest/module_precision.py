"""What the ``precision`` section says about single modules: the shape rule that keeps small
GEMMs out of FP8, the modules taken back to BF16 (``overrides``), and the modules that run
another recipe (``module_recipes``); each of the last two for all of a module's GEMMs or, with
``gemms``, some of them (``fp8ops.gemm_roles``)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator

from fp8ops.gemm_roles import ALL_GEMMS, gemms_problem, in_order
from fp8ops.manifest.base import (
    NonEmptyStr,
    Section,
    Sha256,
    SomeGlobs,
    added_field,
    list_to_tuple,
)


class SmallGemmRule(Section):
    """Keep GEMMs too small to gain from FP8 in the base dtype (applied by admission).

    Shapes are per tensor-parallel rank, the GEMM that actually runs: a linear layer with
    input K and output N (after sharding) is admitted only if ``min(K, N) >= min_dim`` and
    ``2*K*N >= min_flops_per_token``. The token dimension M is left out: in training it is
    micro_batch * seq_length, thousands of rows.
    """

    enabled: bool = Field(
        True, description="Apply the rule; false admits every included module whatever its shape."
    )
    min_dim: int = Field(
        1024,
        ge=1,
        description=(
            "Smallest K or N (per TP rank) worth casting to FP8. torchao measured float8 GEMMs "
            "on H100 with a dimension below ~1024-2048 running slower than bf16 (M,K,N = "
            "1024,2048,1024 gives 0.80x), and TE#445 saw 1024-wide GEMMs 10x slower in FP8: "
            "the casts and scale bookkeeping cost more than the faster matmul saves."
        ),
    )
    min_flops_per_token: int = Field(
        2**23,
        ge=0,
        description=(
            "Smallest 2*K*N (FLOPs per token, per TP rank) worth casting. 2**23 (e.g. K=1024, "
            "N=4096) is twice the K=2048, N=1024 GEMM torchao measured at 0.80x of bf16 on "
            "H100. 0 turns this part of the rule off."
        ),
    )


def _check_fqn(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", value):
        raise ValueError(
            "must be a module's full name such as 'decoder.layers.3.mlp.linear_fc2' "
            "(no wildcards: an override names one module)"
        )
    return value


ModuleFqn = Annotated[str, AfterValidator(_check_fqn)]


def _check_gemms(value: tuple[str, ...]) -> tuple[str, ...]:
    problem = gemms_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return in_order(value)  # one order, so [wgrad, dgrad] and [dgrad, wgrad] hash alike


# A subset of a linear's GEMMs (fprop, dgrad, wgrad), stored in that order.
Gemms = Annotated[tuple[str, ...], BeforeValidator(list_to_tuple), AfterValidator(_check_gemms)]


def _some_gemms(gemms: tuple[str, ...] | None) -> bool:
    """Whether ``gemms`` names fewer than a module's three GEMMs (None: all three)."""
    return gemms is not None and frozenset(gemms) != ALL_GEMMS


# The recipes a module may run instead of precision.scaling: module_recipes' and a phase's.
ModuleScaling = Literal["current", "block", "mxfp8"]


def not_delayed(value: Any) -> Any:
    """Refuse delayed scaling as a module's own recipe (a before-validator)."""
    if value == "delayed":
        raise ValueError(
            "delayed scaling is never a per-module recipe (Megatron-Core refuses it: a "
            "module's own autocast would reduce its amaxes apart from the others'); make "
            "delayed the run's recipe (precision.scaling) and give these modules 'current', "
            "'block' or 'mxfp8'"
        )
    return value


def module_recipe_backend_problem(scaling: str, backend: str, way_out: str) -> str | None:
    """Why ``backend`` cannot run ``scaling`` as a module's own recipe, else None. ``way_out``:
    what to do about MXFP8 on ``scaled_mm``, in the words of the field refused."""
    if backend == "te":
        return (
            "per-module recipes are not wired to Transformer Engine's layers in "
            "fp8ops yet (Megatron-Core's quant_recipe would run them, unchecked "
            "here); use backend 'emulated'"
        )
    if backend == "scaled_mm" and scaling == "mxfp8":
        return mxfp8_on_scaled_mm(way_out)
    return None


def mxfp8_on_scaled_mm(way_out: str) -> str:
    return (
        "MXFP8 on precision.backend 'scaled_mm' would need torch's MXFP8 GEMM "
        "(ScalingType.BlockWise1x32, Blackwell only; Transformer Engine refuses MXFP8 before "
        f"Blackwell), which fp8ops does not call yet; {way_out}"
    )


class Bf16Override(Section):
    """One module taken out of FP8 into the base dtype (a per-layer fallback).

    fp8ops writes these when a resume applies approved overrides from the run's ledger
    (``overrides.jsonl``); ``approval`` is then the hash of the approving record. A hand-written
    override (``approval: null``) is reviewed with the manifest itself.
    """

    module: ModuleFqn = Field(description="Full module name, as in layers.json.")
    dtype: Literal["bf16"] = Field("bf16", description="Where the module falls back to.")
    reason: NonEmptyStr = Field(description="Why (the reason the operator staged it with).")
    approval: Sha256 | None = Field(
        None, description="sha256 of the ledger record that approved it; null if hand-written."
    )
    policy: Sha256 | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "sha256 of the manifest revision whose alerts.auto_degrade policy applied it during "
            "training (no person approved it); null: approved by an operator, or hand-written."
        ),
    )
    gemms: Gemms | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "The module's GEMMs that run in the base dtype, of fprop (y = x W^T), dgrad "
            "(dx = dy W) and wgrad (dW = dy^T x), e.g. [dgrad, wgrad] for saturating "
            "gradients; the others stay FP8. null: all three, the whole module."
        ),
    )

    @property
    def some_gemms(self) -> bool:
        """Whether it takes fewer than the module's three GEMMs out of FP8."""
        return _some_gemms(self.gemms)


class ModuleRecipe(Section):
    """Some modules under another FP8 recipe than ``precision.scaling``: Megatron-Core's
    per-module quantization config (TE's nested autocast), with its rules.

    Only the stateless recipes, at TE's defaults for the run's ``fp8_format``, as Megatron-Core
    builds them for a module (``Float8CurrentScaling``, ``Float8BlockScaling``,
    ``MXFP8BlockScaling``); delayed scaling is never per module (Megatron refuses it: its
    per-module autocasts would reduce amaxes once per module). A resume writes one of these from
    an approved ledger record that staged a module in ``current`` (``approval`` its hash).
    """

    modules: SomeGlobs = Field(description="fnmatch globs on module names, as in layers.json.")
    scaling: ModuleScaling = Field(
        description="The recipe these modules run instead of precision.scaling."
    )
    reason: NonEmptyStr = Field(description="Why these modules need it (reviewed with the rest).")
    approval: Sha256 | None = Field(
        None, description="sha256 of the ledger record that approved it; null if hand-written."
    )
    gemms: Gemms | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "The GEMMs of these modules that run this recipe, of fprop, dgrad and wgrad; the "
            "others run in base_dtype (a module runs one recipe). null: all three."
        ),
    )

    @property
    def some_gemms(self) -> bool:
        """Whether these modules run fewer than their three GEMMs in FP8."""
        return _some_gemms(self.gemms)

    @field_validator("scaling", mode="before")
    @classmethod
    def _not_delayed(cls, value: Any) -> Any:
        return not_delayed(value)
