"""The ``precision`` section's fields, each with its description and its own checks.

The rules between fields (which recipe a field belongs to, what ``module_recipes`` may ask for)
are ``PrecisionPolicy``'s, in ``precision.py``: this class is its list of fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from fp8ops.manifest.base import Globs, Section, SomeGlobs, added_field, list_to_tuple
from fp8ops.manifest.module_precision import Bf16Override, ModuleRecipe, SmallGemmRule
from fp8ops.manifest.precision_schedule import PrecisionPhase

if TYPE_CHECKING:
    from fp8ops.amax_algo import AmaxAlgo


class PrecisionFields(Section):
    """The fields of ``PrecisionPolicy`` (``precision.py``), which adds the rules between them."""

    enabled: bool = Field(
        True,
        description=(
            "false: no module runs FP8 and the run is the base-dtype control (pre-training a base, "
            "the BF16 track of a dual-track evaluation). The recipe below is still recorded."
        ),
    )
    base_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16",
        description=(
            "Dtype of everything not in FP8: weights, optimizer math, excluded modules. Training "
            "refuses fp16 (no loss scaling yet)."
        ),
    )
    fp8_format: Literal["hybrid", "e4m3"] = Field(
        "hybrid",
        description=(
            "'hybrid' (TE's default): E4M3 for forward tensors, E5M2 (more range) for gradients. "
            "'e4m3': E4M3 everywhere. Pure E5M2 is rejected, as TE rejects it."
        ),
    )
    scaling: Literal["delayed", "current", "block", "mxfp8"] = Field(
        "delayed",
        description=(
            "Scaling recipe, as Transformer Engine names them: 'delayed' (DelayedScaling: the "
            "scale from the amax history of past steps), 'current' (Float8CurrentScaling: each "
            "tensor by its own amax), 'block' (Float8BlockScaling: a scale per 1x128 block of "
            "activations and gradients and per 128x128 tile of weights), 'mxfp8' "
            "(MXFP8BlockScaling: a power-of-2 scale per 32 elements; Blackwell natively). "
            "fp8_format applies to every recipe, as Megatron passes it. The fields below marked "
            "'delayed only' or for one recipe are refused under another."
        ),
    )
    power_2_scale: bool | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "current and block only: scales rounded down to powers of two. null: TE's default "
            "(off for current, on for block)."
        ),
    )
    amax_epsilon: float = added_field(
        0.0,
        added_in="0.1.0",
        ge=0,
        description="current and block only: an amax below this is raised to it (TE's QParams).",
    )
    x_block_scaling_dim: Literal[1, 2] = added_field(
        1, added_in="0.1.0", description="block only: 1 (1x128 blocks) or 2 (128x128) for inputs."
    )
    w_block_scaling_dim: Literal[1, 2] = added_field(
        2, added_in="0.1.0", description="block only: the same for weights."
    )
    grad_block_scaling_dim: Literal[1, 2] = added_field(
        1, added_in="0.1.0", description="block only: the same for gradients."
    )
    amax_history_len: int = Field(
        1024,
        ge=1,
        description=(
            "Length of the amax history window per tensor (TE's default, 1024, is conservative: "
            "a spike keeps scales low for 1024 steps; 16-32 adapt faster but need watching)."
        ),
    )
    amax_compute_algo: str = Field(
        "max",
        description=(
            "How the window becomes one amax: 'max' (TE default), 'most_recent', "
            "'quantile:Q' (0 < Q <= 1) or 'trimmed_max:K' (drop the K largest; "
            "K < amax_history_len)."
        ),
    )
    margin: int = Field(
        0,
        ge=0,
        description=(
            "Headroom in powers of two: scale = fp8_max / amax / 2**margin. 0 in every "
            "published recipe."
        ),
    )
    reduce_amax: bool = Field(
        True,
        description=(
            "All-reduce (MAX) amaxes across ranks before the scale update, so every shard of a "
            "tensor shares one scale."
        ),
    )
    backend: Literal["emulated", "scaled_mm", "te"] = Field(
        "emulated",
        description=(
            "The GEMM that multiplies the FP8 casts; the casts, amax histories and scale updates "
            "are the same for 'emulated' and 'scaled_mm'. 'emulated': the FP8 values multiplied "
            "in float32 (any device; a CPU rehearsal). 'scaled_mm': torch._scaled_mm, FP8 tensor "
            "cores on GPUs of compute capability 8.9+ (H100/H200, Blackwell) and oneDNN on CPUs; "
            "every FP8 module's per-rank K and N must be multiples of 16; block scaling runs "
            "one row-wise GEMM per K block where the device has them (checked when the model is "
            "built); no MXFP8. 'te': Megatron's "
            "Transformer Engine layer spec under TE's own fp8_autocast (GPU with Transformer "
            "Engine only; refused elsewhere)."
        ),
    )
    include_modules: SomeGlobs = Field(
        ("*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2"),
        description=(
            "fnmatch globs on module names that may run FP8 (default: the four attention/MLP "
            "projections of a Megatron GPT layer). Embedding, LM head and norms are never FP8."
        ),
    )
    exclude_modules: Globs = Field(
        (), description="Globs removed from include_modules; exclusion wins."
    )
    small_gemm: SmallGemmRule = Field(
        default_factory=SmallGemmRule, description="Shape rule that keeps tiny GEMMs in base_dtype."
    )
    overrides: Annotated[tuple[Bf16Override, ...], BeforeValidator(list_to_tuple)] = Field(
        (),
        description=(
            "Per-module fallbacks to the base dtype, applied on top of the globs (usually added "
            "by a resume from approved ledger records; see docs/resume.md)."
        ),
    )
    module_recipes: Annotated[tuple[ModuleRecipe, ...], BeforeValidator(list_to_tuple)] = (
        added_field(
            (),
            added_in="0.1.0",
            description=(
                "Modules that run another recipe than precision.scaling (e.g. current scaling "
                "for the first and last layers, delayed elsewhere): the first entry whose glob "
                "matches a module decides, as Megatron-Core's matchers do. Only modules that run "
                "FP8 are affected; exclude_modules and overrides still keep a module in "
                "base_dtype."
            ),
        )
    )

    schedule: Annotated[tuple[PrecisionPhase, ...], BeforeValidator(list_to_tuple)] = added_field(
        (),
        added_in="0.1.0",
        description=(
            "Phases of training in which some modules' GEMMs run in base_dtype instead of "
            "FP8, by step or by fraction of schedule.train_steps (e.g. fprop of every layer "
            "for the last 10%); switched at the step boundary (docs/precision.md)."
        ),
    )

    @field_validator("fp8_format", mode="before")
    @classmethod
    def _no_pure_e5m2(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() == "e5m2":
            raise ValueError(
                'pure E5M2 training is not supported (Transformer Engine rejects it: "Pure E5M2 '
                "training is not supported\"); use 'hybrid', which gives E5M2 to gradients and "
                "keeps E4M3 for forward tensors"
            )
        return value

    @field_validator("amax_compute_algo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        _parse_amax_algo(value)
        return value

    @property
    def amax_algo(self) -> AmaxAlgo:
        """The parsed ``amax_compute_algo``."""
        return _parse_amax_algo(self.amax_compute_algo)


def _parse_amax_algo(name: str) -> AmaxAlgo:
    # One parser, one truth: fp8ops.amax_algo, shared with fp8ops.precision (which imports
    # torch, as loading a manifest must not).
    from fp8ops.amax_algo import parse_amax_algo

    return parse_amax_algo(name)
