"""The run manifest: what a run is, as one frozen and strictly validated object.

One pydantic model per section, a description on every field, checks beside the fields they
check. Three settings hold for every model (``_Section``):

* ``extra="forbid"``: a misspelt key is an error, never a silently ignored option (TE's own
  pydantic recipe drops unknown keywords, which is how ``--no-fp8-wgrad`` became a no-op);
* ``strict=True``: YAML ``"16"`` is not the integer 16 and ``yes`` is not a string. Floats
  still accept YAML integers (``lr: 1`` is 1.0);
* ``frozen=True``: a manifest never changes; a change is a new revision (``revisions.py``).

Lists are stored as tuples so that frozen means frozen all the way down; YAML lists are
accepted and dump back as lists.

Cross-field rules raise every violation at once, each at the location of the field to fix
(``_raise_problems``), so ``load.py`` can report them all with their dotted paths.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUndefined

if TYPE_CHECKING:
    from fp8ops.amax_algo import AmaxAlgo

SCHEMA_VERSION = 1

# The marker of a field added after the schema's first release (``added_field``).
ADDED_IN = "fp8ops_added_in"


def added_field(default: Any = PydanticUndefined, *, added_in: str, **kwargs: Any) -> Any:
    """A field added to the schema after its first release, in fp8ops version ``added_in``.

    Every field added from now on must be declared with this, not ``Field``: the hash leaves
    it out while it holds its default (``canonical.py``), so every manifest written before it
    existed keeps its hash, its stored revisions and its checkpoints' lock. ``default`` must
    therefore mean what runs did before. ``tests/test_manifest.py`` pins the shipped
    manifests' hashes, and fails on a field added with ``Field``.
    """
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra[ADDED_IN] = added_in
    return Field(default, json_schema_extra=extra, **kwargs)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _raise_problems(title: str, problems: list[tuple[tuple[str | int, ...], Any, str]]) -> None:
    """Raise all cross-field problems at once, each located at the field to fix.

    ``problems`` holds ``(loc relative to the model, bad value, message)``; pydantic prefixes
    the model's own location, so a rule in ``Manifest`` names e.g. ``model.num_layers``.
    """
    if problems:
        raise ValidationError.from_exception_data(
            title,
            [
                {
                    "type": PydanticCustomError("manifest_rule", "{detail}", {"detail": message}),
                    "loc": loc,
                    "input": value,
                }
                for loc, value, message in problems
            ],
        )


# --------------------------------------------------------------------------------------
# Shared field types
# --------------------------------------------------------------------------------------


def _list_to_tuple(value: Any) -> Any:
    # Only lists: strict mode must still reject a string or a mapping where a list belongs.
    return tuple(value) if isinstance(value, list) else value


def _check_sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError("must be a sha256 digest: 64 lowercase hex digits")
    return value


def _check_name(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", value):
        raise ValueError(
            "must start with a lowercase letter or digit and use only a-z, 0-9, '.', '_' and '-'"
        )
    return value


# Module FQNs are dotted Python identifiers and layer indices, e.g.
# "decoder.layers.3.self_attention.linear_qkv"; globs add fnmatch's *, ? and [...] / [!...].
_GLOB_CHARS = re.compile(r"[A-Za-z0-9_.*?\[\]!-]")


def _check_glob(pattern: str) -> str:
    if not pattern:
        raise ValueError("must be a non-empty module glob such as '*.linear_qkv'")
    bad = [ch for ch in pattern if not _GLOB_CHARS.fullmatch(ch)]
    if bad:
        raise ValueError(
            f"contains {bad[0]!r}; module globs use letters, digits, '_', '.' "
            "and the wildcards '*', '?', '[...]'"
        )
    # fnmatch treats an unclosed '[' as a literal, which would silently match nothing.
    if re.search(r"\[[^\]]*(\[|$)", pattern) or re.search(r"(^|\])[^\[]*\]", pattern):
        raise ValueError("has an unbalanced '[' or ']'")
    if pattern.startswith(".") or pattern.endswith(".") or ".." in pattern:
        raise ValueError("has an empty name segment (leading, trailing or doubled '.')")
    return pattern


Sha256 = Annotated[str, AfterValidator(_check_sha256)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
ModuleGlob = Annotated[str, AfterValidator(_check_glob)]
Globs = Annotated[tuple[ModuleGlob, ...], BeforeValidator(_list_to_tuple)]
Fraction = Annotated[float, Field(ge=0, le=1)]


def _duplicate_globs(
    field: str, globs: tuple[str, ...]
) -> list[tuple[tuple[str | int, ...], Any, str]]:
    first_seen: dict[str, int] = {}
    problems = []
    for index, glob in enumerate(globs):
        if glob in first_seen:
            problems.append(((field, index), glob, f"duplicate of item [{first_seen[glob]}]"))
        first_seen.setdefault(glob, index)
    return problems


# --------------------------------------------------------------------------------------
# Revision
# --------------------------------------------------------------------------------------


class Revision(_Section):
    """Where this manifest comes from: a root (number 0) or a derived revision of a parent."""

    number: int = Field(
        0, ge=0, description="0 for a root manifest; parent's number + 1 for a derived one."
    )
    parent: Sha256 | None = Field(
        None, description="sha256 of the parent manifest's canonical form; null for a root."
    )
    reason: str | None = Field(
        None,
        description="Why this revision exists (required for a derived revision, null for a root).",
    )

    @model_validator(mode="after")
    def _root_or_derived(self) -> Revision:
        problems = []
        if self.number == 0:
            if self.parent is not None:
                problems.append(
                    (("parent",), self.parent, "must be null for revision 0 (a root has no parent)")
                )
            if self.reason is not None:
                problems.append(
                    (("reason",), self.reason, "must be null for revision 0 (a root has no reason)")
                )
        else:
            if self.parent is None:
                problems.append(
                    (("parent",), None, f"revision {self.number} needs its parent's sha256")
                )
            if self.reason is None or not self.reason.strip():
                problems.append(
                    (("reason",), self.reason, "a derived revision needs a non-empty reason")
                )
        _raise_problems("Revision", problems)
        return self


# --------------------------------------------------------------------------------------
# Precision policy
# --------------------------------------------------------------------------------------


class SmallGemmRule(_Section):
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


class Bf16Override(_Section):
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


class ModuleRecipe(_Section):
    """Some modules under another FP8 recipe than ``precision.scaling``: Megatron-Core's
    per-module quantization config (TE's nested autocast), with its rules.

    Only the stateless recipes, at TE's defaults for the run's ``fp8_format``, as Megatron-Core
    builds them for a module (``Float8CurrentScaling``, ``Float8BlockScaling``,
    ``MXFP8BlockScaling``); delayed scaling is never per module (Megatron refuses it: its
    per-module autocasts would reduce amaxes once per module). A resume writes one of these from
    an approved ledger record that staged a module in ``current`` (``approval`` its hash).
    """

    modules: Globs = Field(description="fnmatch globs on module names, as in layers.json.")
    scaling: Literal["current", "block", "mxfp8"] = Field(
        description="The recipe these modules run instead of precision.scaling."
    )
    reason: NonEmptyStr = Field(description="Why these modules need it (reviewed with the rest).")
    approval: Sha256 | None = Field(
        None, description="sha256 of the ledger record that approved it; null if hand-written."
    )

    @field_validator("scaling", mode="before")
    @classmethod
    def _not_delayed(cls, value: Any) -> Any:
        if value == "delayed":
            raise ValueError(
                "delayed scaling is never a per-module recipe (Megatron-Core refuses it: a "
                "module's own autocast would reduce its amaxes apart from the others'); make "
                "delayed the run's recipe (precision.scaling) and give these modules 'current', "
                "'block' or 'mxfp8'"
            )
        return value

    @field_validator("modules")
    @classmethod
    def _some_module(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must list at least one module glob, e.g. 'decoder.layers.0.*'")
        return value


def recipe_line(recipe: Any) -> str:
    """A recipe in one line, with the fields it has (a stateless recipe has no window), read by
    name from ``recipe``: the manifest's ``precision`` section and ``layers.json``'s recipe
    record alike. A ``power_2_scale`` of None is the recipe's default (on for block only)."""
    r, fmt = recipe, recipe.fp8_format
    if r.scaling == "delayed":
        return (
            f"{fmt}, amax_history_len {r.amax_history_len}, {r.amax_compute_algo}, "
            f"margin {r.margin}, reduce_amax {r.reduce_amax}"
        )
    if r.scaling == "mxfp8":
        return f"MXFP8 scaling, {fmt}, 1x32 blocks, E8M0 scales"
    pow2 = r.power_2_scale if r.power_2_scale is not None else r.scaling == "block"
    text = f"{r.scaling} scaling, {fmt}, power-of-2 scales {'on' if pow2 else 'off'}"
    if r.amax_epsilon:
        text += f", amax_epsilon {r.amax_epsilon}"
    if r.scaling == "block":
        edge = {1: "1x128", 2: "128x128"}
        dims = (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim)
        x, w, grad = (edge[d] for d in dims)
        text += f", blocks: input {x}, weight {w}, grad {grad}"
    return text


def _mxfp8_on_scaled_mm(way_out: str) -> str:
    return (
        "MXFP8 on precision.backend 'scaled_mm' would need torch's MXFP8 GEMM "
        "(ScalingType.BlockWise1x32, Blackwell only; Transformer Engine refuses MXFP8 before "
        f"Blackwell), which fp8ops does not call yet; {way_out}"
    )


class PrecisionPolicy(_Section):
    """Which modules run FP8 and how their scales are kept: one of TE's FP8 recipes."""

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
    include_modules: Globs = Field(
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
    overrides: Annotated[tuple[Bf16Override, ...], BeforeValidator(_list_to_tuple)] = Field(
        (),
        description=(
            "Per-module fallbacks to the base dtype, applied on top of the globs (usually added "
            "by a resume from approved ledger records; see docs/resume.md)."
        ),
    )
    module_recipes: Annotated[tuple[ModuleRecipe, ...], BeforeValidator(_list_to_tuple)] = (
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

    @field_validator("include_modules")
    @classmethod
    def _something_included(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # Not Field(min_length=1): pydantic counts only the items that validated, so a list
        # with one bad glob would also be reported as empty.
        if not value:
            raise ValueError("must list at least one module glob, e.g. '*.linear_fc1'")
        return value

    @field_validator("amax_compute_algo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        _parse_amax_algo(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PrecisionPolicy:
        problems = _duplicate_globs("include_modules", self.include_modules)
        problems += _duplicate_globs("exclude_modules", self.exclude_modules)
        problems += _duplicate_globs("overrides", tuple(o.module for o in self.overrides))
        problems += self._recipe_fields()
        problems += self._module_recipe_rules()
        algo = self.amax_algo
        if algo.kind == "trimmed_max" and algo.k >= self.amax_history_len:
            problems.append(
                (
                    ("amax_compute_algo",),
                    self.amax_compute_algo,
                    f"trimmed_max:K needs K < amax_history_len ({self.amax_history_len})",
                )
            )
        _raise_problems("PrecisionPolicy", problems)
        return self

    def _recipe_fields(self) -> list:
        """A field of another recipe than ``scaling``, set away from its default, is refused:
        it would be ignored, and a run must not look as if it honoured it."""
        owners = {
            "amax_history_len": ("delayed",),
            "amax_compute_algo": ("delayed",),
            "margin": ("delayed",),
            "reduce_amax": ("delayed",),
            "power_2_scale": ("current", "block"),
            "amax_epsilon": ("current", "block"),
            "x_block_scaling_dim": ("block",),
            "w_block_scaling_dim": ("block",),
            "grad_block_scaling_dim": ("block",),
        }
        problems = []
        for name, recipes in owners.items():
            value = getattr(self, name)
            if self.scaling not in recipes and value != type(self).model_fields[name].default:
                problems.append(
                    (
                        (name,),
                        value,
                        f"a setting of {' and '.join(recipes)} scaling, not of scaling "
                        f"'{self.scaling}': remove it (or choose scaling {recipes[0]!r})",
                    )
                )
        if self.scaling != "delayed" and self.backend == "te":
            problems.append(
                (
                    ("backend",),
                    self.backend,
                    f"scaling '{self.scaling}' is not wired to Transformer Engine's layers in "
                    "fp8ops yet (TE runs delayed scaling here); use backend 'emulated'",
                )
            )
        if self.scaling == "mxfp8" and self.backend == "scaled_mm":
            way_out = "use precision.backend 'emulated'"
            problems.append((("backend",), self.backend, _mxfp8_on_scaled_mm(way_out)))
        if self.scaling == "block":
            dims = [self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim]
            if dims.count(2) > 1:
                problems.append(
                    (
                        ("w_block_scaling_dim",),
                        self.w_block_scaling_dim,
                        "only one of x/w/grad_block_scaling_dim may be 2: TE's block GEMM "
                        "multiplies a 128x128-blocked operand only by a 1x128-blocked one",
                    )
                )
        return problems

    def _module_recipe_rules(self) -> list:
        """What ``module_recipes`` may not ask for: a module's recipe the backend cannot run,
        or the run's own recipe again (nothing would change)."""
        problems = []
        seen: set[str] = set()
        for i, entry in enumerate(self.module_recipes):
            where = ("module_recipes", i, "scaling")
            # The ledger's entries go first on purpose: a written glob they repeat still
            # decides the modules they leave to it.
            for glob in entry.modules if entry.approval is None else ():
                if glob in seen:
                    problems.append(
                        (
                            ("module_recipes", i, "modules"),
                            glob,
                            f"{glob!r} is in an earlier entry already; the first matching entry "
                            "decides, so this one would never apply",
                        )
                    )
                seen.add(glob)
            later = self.module_recipes[i + 1 :]
            own = entry.scaling == self.scaling and entry.approval is None
            differing = self._stateless_fields_set() if own else []
            if own and all(e.scaling == self.scaling for e in later):
                # Before an entry of another recipe, it keeps modules from that entry's globs
                # (the first match decides); admission checks that it keeps some.
                problems.append(
                    (
                        where,
                        entry.scaling,
                        f"'{entry.scaling}' is the run's own recipe (precision.scaling) and no "
                        "later entry gives another: these modules run it without the entry; "
                        "remove it",
                    )
                )
            elif differing:
                problems.append(
                    (
                        where,
                        entry.scaling,
                        f"an entry runs '{entry.scaling}' at Transformer Engine's defaults (as "
                        "Megatron builds a module's recipe), not with this run's "
                        f"{', '.join(differing)}: these modules would not "
                        "run the run's recipe. Narrow the later entry's globs instead",
                    )
                )
            elif self.backend == "te":
                problems.append(
                    (
                        where,
                        entry.scaling,
                        "per-module recipes are not wired to Transformer Engine's layers in "
                        "fp8ops yet (Megatron-Core's quant_recipe would run them, unchecked "
                        "here); use backend 'emulated'",
                    )
                )
            elif self.backend == "scaled_mm" and entry.scaling == "mxfp8":
                way_out = "give these modules 'block' or 'current' instead"
                problems.append((where, entry.scaling, _mxfp8_on_scaled_mm(way_out)))
        return problems

    def _stateless_fields_set(self) -> list[str]:
        """The run's current/block fields that differ from TE's defaults for its recipe."""
        defaults = {
            "power_2_scale": self.scaling == "block",
            "amax_epsilon": 0.0,
            "x_block_scaling_dim": 1,
            "w_block_scaling_dim": 2,
            "grad_block_scaling_dim": 1,
        }
        if self.power_2_scale is None:
            defaults.pop("power_2_scale")
        return [name for name, value in defaults.items() if getattr(self, name) != value]

    @property
    def recipe_summary(self) -> str:
        """The recipe in one line, with the fields that apply to it, and the modules that run
        another one."""
        text = recipe_line(self)
        for entry in self.module_recipes:
            text += f"; {entry.scaling} for {', '.join(entry.modules)}"
        return text

    @property
    def amax_algo(self) -> AmaxAlgo:
        """The parsed ``amax_compute_algo``."""
        return _parse_amax_algo(self.amax_compute_algo)


def _parse_amax_algo(name: str) -> AmaxAlgo:
    # One parser, one truth: fp8ops.amax_algo, shared with fp8ops.precision (which imports
    # torch, as loading a manifest must not).
    from fp8ops.amax_algo import parse_amax_algo

    return parse_amax_algo(name)


# --------------------------------------------------------------------------------------
# Model, tokenizer, data
# --------------------------------------------------------------------------------------


class RopeScaling(_Section):
    """Rotary frequencies stretched for a longer context, as Hugging Face's ``rope_type`` names
    the two fp8ops computes exactly (Llama 3.1/3.2 use ``llama3``)."""

    type: Literal["llama3", "linear"] = Field(
        description=(
            "'llama3': low frequencies divided by factor, high ones kept, a smooth blend "
            "between; 'linear': every frequency divided by factor."
        )
    )
    factor: float = Field(gt=0, description="How far the context is stretched.")
    low_freq_factor: float = Field(1.0, gt=0, description="'llama3' only: the blend's low end.")
    high_freq_factor: float = Field(4.0, gt=0, description="'llama3' only: the blend's high end.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, description="'llama3' only: the context the model was first trained at."
    )

    @model_validator(mode="after")
    def _blend_ordered(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            _raise_problems(
                "RopeScaling",
                [
                    (
                        ("high_freq_factor",),
                        self.high_freq_factor,
                        f"must exceed low_freq_factor ({self.low_freq_factor})",
                    )
                ],
            )
        return self


class ModelConfig(_Section):
    """The network: a Megatron-Core GPT, dense layers."""

    arch: Literal["gpt"] = Field(
        "gpt", description="Model family; Megatron-Core GPT is the only one."
    )
    num_layers: int = Field(ge=1, description="Transformer layers.")
    hidden_size: int = Field(ge=1, description="Model width.")
    ffn_hidden_size: int = Field(ge=1, description="MLP inner width (per gate for swiglu).")
    num_attention_heads: int = Field(ge=1, description="Attention heads; must divide hidden_size.")
    num_query_groups: int | None = Field(
        None,
        ge=1,
        description="Key/value heads for grouped-query attention; null means one per head (MHA).",
    )
    seq_length: int = Field(ge=1, description="Tokens per sequence.")
    vocab_size: int = Field(ge=1, description="Vocabulary size (before Megatron's padding for TP).")
    normalization: Literal["LayerNorm", "RMSNorm"] = Field(
        "LayerNorm", description="Normalization layer; never FP8."
    )
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation.")
    position_embedding: Literal["learned_absolute", "rope"] = Field(
        "learned_absolute", description="Position encoding."
    )
    # What Hugging Face's Llama, Qwen and Mistral need (fp8ops manifest from-hf sets them); the
    # defaults are Megatron-Core's, which every run before them trained with.
    layernorm_epsilon: float = added_field(
        1e-5, added_in="0.1.0", gt=0, description="The norms' epsilon (HF: rms_norm_eps)."
    )
    add_bias_linear: bool = added_field(
        True,
        added_in="0.1.0",
        description="A bias on all four projections (Megatron's default; HF Llama, Qwen, Mistral: "
        "false).",
    )
    add_qkv_bias: bool = added_field(
        False, added_in="0.1.0", description="A bias on the QKV projection alone (Qwen2)."
    )
    kv_channels: int | None = added_field(
        None,
        added_in="0.1.0",
        ge=1,
        description="Width of one attention head (HF: head_dim); null: hidden_size / heads.",
    )
    qk_layernorm: bool = added_field(
        False, added_in="0.1.0", description="A norm on each query and key head (Qwen3)."
    )
    tied_embeddings: bool = added_field(
        False,
        added_in="0.1.0",
        description="The output layer shares the input embedding (HF: tie_word_embeddings).",
    )
    rotary_base: float = added_field(
        10000.0, added_in="0.1.0", gt=0, description="RoPE's base (HF: rope_theta)."
    )
    rope_scaling: RopeScaling | None = added_field(
        None, added_in="0.1.0", description="RoPE frequency scaling; null: none."
    )
    init_checkpoint: NonEmptyStr | None = Field(
        None,
        description=(
            "Checkpoint to fine-tune from: an fp8ops weights checkpoint (a run's final/) or a "
            "Hugging Face directory (config.json and safetensors); null initialises from "
            "seeds.model."
        ),
    )
    fingerprint: Sha256 | None = Field(
        None, description="sha256 of the initial weights, checked when the run starts."
    )

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        problems = []
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(
                (
                    ("hidden_size",),
                    self.hidden_size,
                    f"must be divisible by num_attention_heads ({self.num_attention_heads})",
                )
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            problems.append(
                (
                    ("num_query_groups",),
                    self.num_query_groups,
                    f"must divide num_attention_heads ({self.num_attention_heads})",
                )
            )
        if self.position_embedding != "rope":
            for name, default in (("rotary_base", 10000.0), ("rope_scaling", None)):
                if getattr(self, name) != default:
                    problems.append(
                        ((name,), getattr(self, name), "applies only to position_embedding 'rope'")
                    )
        _raise_problems("ModelConfig", problems)
        return self


class TokenizerConfig(_Section):
    """How text becomes token ids."""

    kind: Literal["byte", "sentencepiece", "huggingface"] = Field(
        "byte",
        description=(
            "'byte': raw UTF-8 bytes, ids 0-255, no file. 'huggingface': path's tokenizer.json, "
            "read with the tokenizers library (pip install 'fp8ops[hf]'). 'sentencepiece' is "
            "refused: convert the model to a tokenizer.json."
        ),
    )
    path: NonEmptyStr | None = Field(
        None,
        description="A tokenizer.json or the directory holding it; required unless kind is 'byte'.",
    )
    fingerprint: Sha256 | None = Field(
        None,
        description=(
            "sha256 of what the tokenizer does (for 'huggingface': its tokenizer.json and "
            "end-of-document token), checked when the run starts."
        ),
    )
    eod_token: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "'huggingface' only: the token that ends every document and answer, one of the "
            "file's added tokens (Llama 3: <|end_of_text|>); null: the eos_token of the "
            "tokenizer_config.json beside the file."
        ),
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> TokenizerConfig:
        problems = []
        if self.kind == "byte" and self.path is not None:
            problems.append(
                (("path",), self.path, "must be null for kind 'byte' (it needs no file)")
            )
        if self.kind == "byte" and self.eod_token is not None:
            problems.append(
                (("eod_token",), self.eod_token, "must be null for kind 'byte' (id 0 ends text)")
            )
        if self.kind == "sentencepiece":
            problems.append(
                (
                    ("kind",),
                    self.kind,
                    (
                        "is not supported: convert the model to a tokenizer.json (transformers' "
                        "LlamaTokenizerFast does) and use kind 'huggingface'"
                    ),
                )
            )
        if self.kind == "huggingface" and self.path is None:
            problems.append((("path",), None, f"required for kind '{self.kind}'"))
        _raise_problems("TokenizerConfig", problems)
        return self


class DataConfig(_Section):
    """Training and evaluation data (built by ``fp8ops.data``)."""

    kind: Literal["corpus", "tasks", "jsonl", "chat"] = Field(
        description=(
            "'corpus': fp8ops' built-in byte-level text corpus (the docstrings of a fixed list of "
            "Python standard-library modules, present wherever Python is), for pre-training; "
            "loss on every token. 'tasks': fp8ops' built-in supervised tasks with checkable "
            "answers and evaluation buckets, generated from seeds.data; loss on the answers. "
            "'jsonl': your file at path, one JSON object per line, either {\"text\": ...} "
            '(pre-training) or {"prompt": ..., "answer": ..., "buckets": {...}} (SFT). '
            "'chat': your file at path, one conversation per line, "
            '{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...], '
            '"buckets": {...}}, rendered by the tokenizer\'s own chat template; loss on the '
            "assistant's turns only."
        )
    )
    path: NonEmptyStr | None = Field(
        None, description="The JSONL file; required for 'jsonl', null for the built-in kinds."
    )
    fingerprint: Sha256 | None = Field(
        None,
        description=(
            "sha256 of the data as fp8ops reads it, checked when the run starts; null records "
            "it without checking."
        ),
    )
    num_examples: int = Field(
        6000,
        ge=2,
        description="For 'tasks': how many examples to generate (train and evaluation together).",
    )
    eval_fraction: float = Field(
        0.1, ge=0, le=0.5, description="Fraction of documents held out for evaluation."
    )
    split_version: Literal[1, 2] = added_field(
        1,
        added_in="0.1.0",
        description=(
            "How the held-out split is drawn (docs/data.md). 2: a problem is held out whatever "
            "the order of operands that give its answer (built-in tasks) or the whitespace of "
            "its prompt (jsonl); the evaluation split, and jsonl text before packing, in hash "
            "order, so any prefix is a fair sample. 1: the split of runs made before version 2 "
            "existed (kept so that they resume on the same data); new manifests should use 2."
        ),
    )
    pad_to: Literal["seq_length", "longest"] = added_field(
        "seq_length",
        added_in="0.1.0",
        description=(
            "How far each micro-batch is padded. 'seq_length': every row to model.seq_length. "
            "'longest': to the micro-batch's longest row, rounded up to a multiple of 16 (FP8 "
            "GEMMs' alignment), at most seq_length: SFT examples much shorter than seq_length "
            "then cost their own length, not seq_length. The loss is the same (padding sits "
            "after a row's tokens, which causal attention never lets them see), but FP8 amaxes "
            "see fewer padding positions, so the runs are not bit-identical. No effect on "
            "pre-training windows, which are full."
        ),
    )

    as_chat: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "kind 'tasks' only: each task rendered as a conversation (the prompt a user turn, "
            "the answer the assistant's) by the tokenizer's chat template, as kind 'chat' renders "
            "its file: for fine-tuning a chat model on checkable answers."
        ),
    )
    overlong: Literal["drop", "truncate"] = added_field(
        "drop",
        added_in="0.1.0",
        description=(
            "Conversations (kind 'chat', or tasks with as_chat): one longer than "
            "model.seq_length + 1 tokens is dropped, or truncated to that length (its loss on the "
            "assistant tokens left); either way counted in the run's data record and said at "
            "start. Other data refuses an example that does not fit."
        ),
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> DataConfig:
        problems = []
        if self.kind in ("jsonl", "chat") and self.path is None:
            problems.append((("path",), None, f"required for kind '{self.kind}'"))
        if self.kind not in ("jsonl", "chat") and self.path is not None:
            problems.append(
                (("path",), self.path, f"must be null for kind '{self.kind}' (it reads no file)")
            )
        if self.as_chat and self.kind != "tasks":
            problems.append(
                (("as_chat",), True, f"only for kind 'tasks' (kind '{self.kind}' is not)")
            )
        _raise_problems("DataConfig", problems)
        return self


# --------------------------------------------------------------------------------------
# Optimisation
# --------------------------------------------------------------------------------------


class OptimizerConfig(_Section):
    """The optimizer. Defaults are Megatron/Llama fine-tuning values."""

    name: Literal["adamw", "sgd"] = Field(
        "adamw", description="'adamw', or 'sgd' (beta1 is its momentum; beta2, eps unused)."
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (a fine-tuning default).")
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the end of decay; at most lr.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Weight decay: decoupled for adamw, L2 in the gradient for sgd (torch's).",
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="First-moment decay (momentum for sgd).")
    beta2: float = Field(
        0.95, ge=0, lt=1, description="Second-moment decay; 0.95 is the usual LLM value."
    )
    eps: float = Field(1e-8, gt=0, description="Adam denominator epsilon.")
    clip_grad: float | None = Field(
        1.0, gt=0, description="Global gradient-norm clip; null turns clipping off."
    )
    distributed: bool = added_field(
        False,
        added_in="0.1.0",
        description="Shard the float32 main weights and moments over data-parallel ranks "
        "(Megatron's distributed optimizer, use_distributed_optimizer): 12/DP bytes per "
        "parameter per rank instead of 12; the same results and checkpoints.",
    )

    @model_validator(mode="after")
    def _min_below_peak(self) -> OptimizerConfig:
        problems = []
        if self.min_lr > self.lr:
            problems.append((("min_lr",), self.min_lr, f"must be <= lr ({self.lr:g})"))
        _raise_problems("OptimizerConfig", problems)
        return self


class Schedule(_Section):
    """How long, how big, how often."""

    train_steps: int = Field(ge=1, description="Optimizer steps.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps; at most train_steps.")
    micro_batch_size: int = Field(
        1, ge=1, description="Sequences per forward pass per data-parallel rank."
    )
    global_batch_size: int = Field(
        ge=1,
        description="Sequences per optimizer step; a multiple of micro_batch_size * data_parallel.",
    )
    lr_decay: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay from lr to min_lr after warm-up."
    )
    log_interval: int = Field(1, ge=1, description="Steps between loss/throughput log lines.")
    eval_interval: int = Field(100, ge=1, description="Steps between evaluations.")
    eval_iters: int | None = Field(
        None,
        ge=1,
        description=(
            "Micro-batches of the held-out set per evaluation, always the same ones; null "
            "evaluates the whole set."
        ),
    )
    checkpoint_interval: int = Field(100, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(
        3, ge=1, description="Checkpoints kept on disk; older ones are deleted."
    )

    @model_validator(mode="after")
    def _warmup_fits(self) -> Schedule:
        problems = []
        if self.warmup_steps > self.train_steps:
            problems.append(
                (
                    ("warmup_steps",),
                    self.warmup_steps,
                    f"must be <= train_steps ({self.train_steps})",
                )
            )
        _raise_problems("Schedule", problems)
        return self


class Seeds(_Section):
    """Random seeds, recorded so a rerun is comparable step by step."""

    model: int = Field(
        1234,
        ge=0,
        description="Seed for weight initialisation (when not loading a checkpoint) and dropout.",
    )
    data: int = Field(1234, ge=0, description="Seed for data order and generated data.")


class Topology(_Section):
    """The parallel layout. The world size is their product."""

    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks; must divide heads, query groups and ffn_hidden_size.",
    )
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages; must divide num_layers.")
    data_parallel: int = Field(1, ge=1, description="Data-parallel replicas.")
    sequence_parallel: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "Megatron's sequence parallelism: norms and the residual stream split the sequence "
            "over the tensor-parallel ranks (all-gather before the column-parallel linears, "
            "reduce-scatter after the row-parallel ones). Needs tensor_parallel > 1, amaxes "
            "reduced over TP (precision.reduce_amax), and sequences padded to seq_length."
        ),
    )
    context_parallel: int = added_field(
        1,
        added_in="0.1.0",
        ge=1,
        description=(
            "Megatron's context parallelism (the sequence split over ranks inside attention "
            "too). Only 1 so far: fp8ops' attention and data path do not split sequences; "
            "for long sequences use tensor_parallel with sequence_parallel."
        ),
    )
    amax_reduction: Literal["tp_dp_cp", "tp_cp"] = Field(
        "tp_dp_cp",
        description=(
            "Group the amax all-reduce spans: 'tp_dp_cp' (Megatron's default, every rank that "
            "sees the tensor) or 'tp_cp' (Megatron's tp_only_amax_red: cheaper, DP replicas "
            "may then drift to different scales)."
        ),
    )

    @field_validator("context_parallel")
    @classmethod
    def _no_context_parallel(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError(
                "manifest_rule",
                "context parallelism is not supported yet (fp8ops' attention and data path do "
                "not split sequences); set it to 1, and for long sequences use "
                "topology.sequence_parallel with tensor_parallel > 1",
            )
        return value

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage (all of them without pipelining)."""
        return self.tensor_parallel * self.data_parallel


# --------------------------------------------------------------------------------------
# Alerts, gates, telemetry
# --------------------------------------------------------------------------------------


class Levels(_Section):
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
        _raise_problems(type(self).__name__, problems)
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


# The Degrade rules an auto-degrade policy may let act alone (fp8ops.alerts: the module-level
# rules that propose a BF16 override).
DegradeRule = Literal[
    "saturation",
    "underflow",
    "scale_jitter",
    "fp8_error",
    "fp8_error_growing",
    "grad_spike",
    "blocks_at_floor",
]


class AutoDegrade(_Section):
    """A reviewed policy under which the run takes a module out of FP8 itself: a Degrade alert
    of one of ``rules`` switches that module to BF16 at the next step boundary, without a
    restart and without a person, recorded in the ledger as approved by this manifest revision.
    A person can revoke it; the module returns to FP8 at the next resume."""

    rules: Annotated[tuple[DegradeRule, ...], BeforeValidator(_list_to_tuple)] = Field(
        description="The Degrade rules that may act alone, e.g. [saturation, underflow]."
    )
    max_modules: int = Field(
        ge=1,
        description=(
            "At most this many modules switched by the policy in the run (counted over every "
            "revision's policy); later alerts only propose, as without a policy."
        ),
    )
    until_step: int | None = Field(
        None,
        ge=1,
        description=(
            "The policy acts on alerts up to this training step; after it (overnight is "
            "over) they only propose. null: for the whole run."
        ),
    )

    def acts_on(self, rule: str, step: int) -> bool:
        """Whether an alert of ``rule`` at ``step`` is one this policy may act on alone (its
        ``max_modules`` is counted in the run's ledger)."""
        return rule in self.rules and (self.until_step is None or step <= self.until_step)

    @field_validator("rules")
    @classmethod
    def _some_rule(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one Degrade rule, e.g. [saturation]")
        if len(set(value)) != len(value):
            raise ValueError("names a rule twice")
        return value


class Alerts(_Section):
    """Per-layer alert thresholds, evaluated on every telemetry step (rules: ``fp8ops.alerts``).

    Steps count the steps a metric was measured on (``telemetry.every_steps``); the sampled
    FP8-vs-reference error counts in samples (``telemetry.error_sample_every``).
    """

    saturation: SaturationLevels = Field(
        default_factory=SaturationLevels,
        description="Clipping at the FP8 max (fraction of elements).",
    )
    underflow: UnderflowLevels = Field(
        default_factory=UnderflowLevels,
        description="Flush to zero (fraction of non-zero elements).",
    )
    scale_change: ScaleChangeLevels = Field(
        default_factory=ScaleChangeLevels, description="Step-to-step scale change (ratio > 1)."
    )
    fp8_rel_error: Fp8ErrorLevels = Field(
        default_factory=Fp8ErrorLevels,
        description="Sampled FP8-vs-reference GEMM error (relative).",
    )
    blocks_at_floor: BlocksAtFloorLevels = added_field(
        default_factory=BlocksAtFloorLevels,
        added_in="0.1.0",
        description=(
            "Blocks whose scale sat at its floor (block scaling, MXFP8; fraction of the non-zero "
            "blocks). Not measured under delayed or current scaling. Off unless levels are set "
            "(suggested: observe 1e-3, degrade 1e-2)."
        ),
    )
    nonfinite_stop: bool = Field(
        True,
        description=(
            "Stop at the first NaN/Inf in loss, gradients or scales; never waits for patience. "
            "false reports them as observe alerts (the optimizer still skips such steps)."
        ),
    )
    patience_steps: int = Field(
        3,
        ge=1,
        description=(
            "Consecutive steps over a threshold before the alert fires: one-step spikes (first "
            "step after resume, a big value leaving the history window) are common and harmless."
        ),
    )
    window_steps: int = Field(
        20,
        ge=4,
        description=(
            "Measured steps in the trend windows: rising underflow compares the newer half of "
            "the window with the older half, and a gradient spike is measured against the "
            "module's median over the window. Long enough that a median ignores a few spikes, "
            "short enough to follow a fine-tuning run's moving statistics."
        ),
    )
    underflow_rise_factor: float = Field(
        2.0,
        gt=1,
        description=(
            "Rising zero-value ratio (observe): the newer half of the window flushes at least "
            "this many times more values to zero than the older half. Doubling means the "
            "tensor's range is drifting below what its scale can represent."
        ),
    )
    underflow_rise_floor: Fraction = Field(
        1e-3,
        description=(
            "Rising underflow is reported only once the newer half's mean reaches this "
            "fraction (a tenth of the default observe level): doubling a negligible loss is "
            "noise, not a trend."
        ),
    )
    error_growth_samples: int = Field(
        4,
        ge=3,
        description=(
            "Growing FP8-vs-reference error (degrade): this many consecutive error samples, "
            "each larger than the one before. Counted in samples (telemetry.error_sample_every "
            "steps apart); three rises in a row are unlikely from sampling noise alone."
        ),
    )
    error_growth_floor: Annotated[float, Field(ge=0)] = Field(
        0.04,
        description=(
            "Growth is reported only once the latest sample reaches this relative error: "
            "rounding both operands to E4M3 alone gives ~0.037 on well-scaled data, so growth "
            "below that floor is rounding noise."
        ),
    )
    grad_spike_factor: float = Field(
        5.0,
        gt=1,
        description=(
            "Gradient anomaly (degrade): a module's gradient norm above this many times its "
            "median over the window, for patience_steps steps. In torchtitan#3109 the grad "
            "norm went 105 -> 572 (5.4x) the step before the loss turned NaN."
        ),
    )
    amax_jump_factor: float = Field(
        4.0,
        gt=1,
        description=(
            "Early warning (observe, no patience): a tensor's amax this many times above the "
            "previous step's window max. The scale in use was computed from that history (under "
            "most_recent, from its last amax alone), so the cast clipped unless the margin leaves "
            "that much headroom; a per-layer amax spike is what precedes FP8 NaNs "
            "(torchtitan#3109). Delayed scaling only: a stateless recipe scales each cast by its "
            "own amax."
        ),
    )
    divergence_factor: float = Field(
        2.0,
        gt=1,
        description=(
            "Divergence (stop): the training loss above this many times the lowest loss seen "
            "so far, for patience_steps steps. A run at twice its best loss is not recovering "
            "by itself; a checkpoint taken now is still worth resuming from."
        ),
    )
    divergence_warmup_steps: int = Field(
        10,
        ge=0,
        description=(
            "Observed steps before the lowest loss starts to count: the first steps of a run "
            "swing widely. A resume continues the count (its FP8 scales are restored exactly); "
            "one at another world size or alert configuration starts it again."
        ),
    )

    auto_degrade: AutoDegrade | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "A policy under which a Degrade alert switches its module to BF16 during training, "
            "approved by this revision (docs/overrides.md). null: Degrade only proposes."
        ),
    )

    @model_validator(mode="after")
    def _window_holds_patience(self) -> Alerts:
        # A spike that lasts patience_steps enters the window it is compared with; once it
        # fills half the window it is its own median and never fires.
        problems = []
        if self.window_steps < 2 * self.patience_steps:
            if "window_steps" in self.model_fields_set:
                problems.append(
                    (
                        ("window_steps",),
                        self.window_steps,
                        f"must be >= 2 * patience_steps ({2 * self.patience_steps})",
                    )
                )
            else:
                problems.append(
                    (
                        ("patience_steps",),
                        self.patience_steps,
                        f"must be <= window_steps / 2 ({self.window_steps // 2}, from "
                        "window_steps' default)",
                    )
                )
        _raise_problems("Alerts", problems)
        return self


class Gates(_Section):
    """Acceptance bar for the dual-track (FP8 vs base dtype) evaluation."""

    loss_gap: float = Field(
        0.01,
        ge=0,
        description=(
            "Largest allowed matched-step eval-loss gap, FP8 minus reference (the bar "
            "marin#7298 used)."
        ),
    )
    bucket_accuracy_gap: float = Field(
        0.02, ge=0, description="Largest allowed accuracy drop in any evaluation bucket."
    )
    allow_nonfinite: bool = Field(False, description="Pass a run that ever produced NaN/Inf.")
    allow_skipped_steps: bool = Field(False, description="Pass a run that skipped optimizer steps.")
    bucket_significance: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        0.05,
        description=(
            "A bucket's accuracy drop beyond bucket_accuracy_gap fails the gate only if it is "
            "also unlikely to be noise: the exact one-sided sign test (McNemar's) on the items "
            "the two runs answered differently is significant at this level, with Holm's "
            "correction over the gated buckets (all of them are tested at once). null: the drop "
            "alone decides."
        ),
    )
    min_bucket_items: int = Field(
        20,
        ge=1,
        description=(
            "Buckets with fewer held-out items than this are reported but not gated: one item "
            "more or less right would swing their accuracy by more than the gap allows."
        ),
    )
    require_resume_continuity: bool = Field(
        True,
        description=(
            "Require a resumed run to continue its trajectory: the FP8 state and weights were "
            "verified at load, the steps are contiguous, and the loss does not jump."
        ),
    )
    resume_loss_jump: float = Field(
        0.1,
        ge=0,
        description=(
            "Largest allowed rise of the mean training loss over the 10 steps after a resume "
            "against the 10 steps before it."
        ),
    )


class Capability(_Section):
    """Generation-based evaluation: greedy answers to held-out task items, exact match per bucket.

    Only for SFT data (examples with answers); text data has nothing to check and skips it.
    """

    enabled: bool = Field(True, description="Evaluate generation on held-out items.")
    items: int | None = Field(
        240,
        ge=1,
        description=(
            "Held-out items generated each time: the first N of the evaluation split, always "
            "the same ones; null takes all of them."
        ),
    )
    interval: int | None = Field(
        None,
        ge=1,
        description="Steps between capability evaluations; null: once, after the last step.",
    )
    max_new_tokens: int = Field(
        16, ge=1, description="Generation stops at an end-of-document token or after this many."
    )


class DualTrack(_Section):
    """Which modules the third track (FP8 with fallbacks) keeps in the base dtype."""

    fallback_first_last: bool = Field(
        True,
        description=(
            "The FP8 modules of the first and last transformer layers, the ones published FP8 "
            "recipes most often keep in BF16."
        ),
    )
    fallback_alerted: bool = Field(
        True,
        description="Modules the FP8 candidate track raised Degrade or Stop alerts for.",
    )
    fallback_modules: Globs = Field((), description="More modules, as globs on module names.")


class Telemetry(_Section):
    """How often per-layer FP8 telemetry is measured and how fresh the store is."""

    every_steps: int = Field(
        1,
        ge=1,
        description=(
            "Measure cast statistics (saturation, underflow, NaN/Inf) and norms every N steps. "
            "Amax, scales and history statistics are recorded every step (they are there "
            "anyway); the cast statistics cost extra passes over every FP8 tensor."
        ),
    )
    error_sample_every: int = Field(
        10,
        ge=1,
        description=(
            "Measure FP8-vs-reference GEMM error every N steps (costs an extra base-dtype GEMM "
            "per sampled layer)."
        ),
    )
    error_sample_tokens: int | None = added_field(
        None,
        added_in="0.1.0",
        ge=1,
        description=(
            "Compare at most this many tokens of each micro-batch in the FP8-vs-reference error "
            "(every sequence's tokens at evenly spaced positions; at least one position), so "
            "the reference GEMM costs that many tokens, not the whole micro-batch. null: every "
            "token."
        ),
    )
    flush_steps: int = Field(
        256,
        ge=1,
        le=2048,
        description=(
            "Steps per block the store writes and commits: how far behind training a reader "
            "is at most. Must divide 2048 (the store's history shard); smaller blocks mean "
            "fresher reads and more, smaller chunks."
        ),
    )

    @field_validator("flush_steps")
    @classmethod
    def _divides_shard(cls, value: int) -> int:
        if 2048 % value:
            raise ValueError("must divide 2048 (1, 2, 4, ..., 2048)")
        return value


class Review(_Section):
    """Who may decide a per-layer override in the run's ledger (``overrides.jsonl``)."""

    allow_self_approval: bool = Field(
        False,
        description=(
            "true lets the operator who staged an override approve it too (a one-person team); "
            "by default another operator must."
        ),
    )
    allowed_signers: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "An SSH allowed-signers file (ssh-keygen(1), ALLOWED SIGNERS; a line per operator: "
            'principal namespaces="fp8ops-ledger" ssh-ed25519 AAAA...): operators sign '
            "their ledger records with their SSH key, and the review rule compares the principals "
            "this file binds to the keys that signed (docs/overrides.md). A relative path is read "
            "from the current directory. null: records are not signed and names are typed."
        ),
    )
    allowed_signers_sha256: Sha256 | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "sha256 of the allowed_signers file, checked whenever it is read: a swapped or edited "
            "file is refused. Required with allowed_signers."
        ),
    )
    require_signatures: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "true: an operator's record (staged, approved, rejected, revoked) that is unsigned or "
            "does not verify is refused when written and an error on every read (verify, the "
            "console, a resume). false: it is written and flagged. Needs allowed_signers."
        ),
    )

    @model_validator(mode="after")
    def _signers_pinned(self) -> Review:
        problems = []
        if (self.allowed_signers is None) != (self.allowed_signers_sha256 is None):
            missing = (
                "allowed_signers" if self.allowed_signers is None else "allowed_signers_sha256"
            )
            problems.append(
                (
                    (missing,),
                    None,
                    "allowed_signers and allowed_signers_sha256 go together (sha256sum FILE)",
                )
            )
        if self.require_signatures and self.allowed_signers is None:
            problems.append((("require_signatures",), True, "needs allowed_signers (who may sign)"))
        _raise_problems("Review", problems)
        return self


# --------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------


class Manifest(_Section):
    """A run, completely: hashed (``canonical.py``), never edited, revised by derivation."""

    schema_version: Literal[1] = Field(
        description="Manifest format version; this fp8ops reads version 1."
    )
    name: str = Field(
        description=(
            "Run family name: lowercase letters, digits, '.', '_' and '-', starting with a "
            "letter or digit."
        )
    )
    revision: Revision = Field(
        default_factory=Revision, description="Root manifest or derived revision."
    )
    precision: PrecisionPolicy = Field(
        default_factory=PrecisionPolicy, description="The FP8 policy the run starts with."
    )
    model: ModelConfig = Field(description="The network.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    data: DataConfig = Field(description="Data.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    schedule: Schedule = Field(description="Steps and batch sizes.")
    seeds: Seeds = Field(default_factory=Seeds, description="Random seeds.")
    topology: Topology = Field(default_factory=Topology, description="Parallel layout.")
    alerts: Alerts = Field(default_factory=Alerts, description="Alert thresholds.")
    gates: Gates = Field(default_factory=Gates, description="Dual-track acceptance gates.")
    capability: Capability = Field(
        default_factory=Capability, description="Generation-based evaluation of the task."
    )
    dualtrack: DualTrack = Field(
        default_factory=DualTrack, description="The third track's BF16 modules."
    )
    telemetry: Telemetry = Field(default_factory=Telemetry, description="Telemetry cadence.")
    review: Review = Field(default_factory=Review, description="Override review rules.")

    @field_validator("schema_version", mode="before")
    @classmethod
    def _integer_version(cls, value: Any) -> Any:
        # Literal[1] alone accepts true and 1.0 (they compare equal to 1).
        if type(value) is not int:
            raise PydanticCustomError("manifest_rule", "must be the integer 1")
        return value

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return _check_name(value)

    @model_validator(mode="after")
    def _layout_fits(self) -> Manifest:
        topology, schedule = self.topology, self.schedule
        problems = []

        def divisible(section: str, field: str, by: int, by_name: str) -> None:
            value = getattr(getattr(self, section), field)
            if value is not None and value % by:
                problems.append(((section, field), value, f"must be divisible by {by_name} ({by})"))

        tp = topology.tensor_parallel
        divisible("model", "num_attention_heads", tp, "topology.tensor_parallel")
        divisible("model", "num_query_groups", tp, "topology.tensor_parallel")
        divisible("model", "ffn_hidden_size", tp, "topology.tensor_parallel")
        divisible("model", "num_layers", topology.pipeline_parallel, "topology.pipeline_parallel")
        divisible(
            "schedule",
            "global_batch_size",
            schedule.micro_batch_size * topology.data_parallel,
            "schedule.micro_batch_size * topology.data_parallel",
        )
        if topology.sequence_parallel:
            problems.extend(self._sequence_parallel_problems())
        if topology.pipeline_parallel > 1:
            problems.extend(self._pipeline_problems())
        if self.tokenizer.kind == "byte" and self.model.vocab_size < 256:
            problems.append(
                (("model", "vocab_size"), self.model.vocab_size, "must be >= 256 for byte tokens")
            )
        _raise_problems("Manifest", problems)
        return self

    def _pipeline_problems(self) -> list:
        """What pipeline parallelism cannot run with yet, each at the field to change."""
        problems, pp = [], self.topology.pipeline_parallel
        if self.data.pad_to != "seq_length":
            problems.append(
                (
                    ("data", "pad_to"),
                    self.data.pad_to,
                    f"must be 'seq_length' at topology.pipeline_parallel {pp} (the stages "
                    "exchange activations of one fixed shape)",
                )
            )
        if self.precision.enabled and self.precision.backend == "te":
            problems.append(
                (
                    ("precision", "backend"),
                    "te",
                    f"'te' at topology.pipeline_parallel {pp} is not supported yet (Megatron's "
                    "TE spec is built without stages here); use 'emulated' or 'scaled_mm'",
                )
            )
        return problems

    def _sequence_parallel_problems(self) -> list:
        """What sequence parallelism needs, each at the field to change."""
        problems, tp = [], self.topology.tensor_parallel
        where = ("topology", "sequence_parallel")
        if tp == 1:
            problems.append(
                (
                    where,
                    True,
                    "needs topology.tensor_parallel > 1 (it splits the sequence "
                    "over the tensor-parallel ranks); set it to false at tensor_parallel 1",
                )
            )
        elif self.model.seq_length % tp:
            problems.append(
                (
                    ("model", "seq_length"),
                    self.model.seq_length,
                    f"must be divisible by topology.tensor_parallel ({tp}) under "
                    "topology.sequence_parallel",
                )
            )
        if self.data.pad_to != "seq_length":
            problems.append(
                (
                    ("data", "pad_to"),
                    self.data.pad_to,
                    "must be 'seq_length' under topology.sequence_parallel (every batch's length "
                    "must divide by tensor_parallel)",
                )
            )
        if self.precision.enabled and not self.precision.reduce_amax:
            problems.append(
                (
                    ("precision", "reduce_amax"),
                    False,
                    "must be true under topology.sequence_parallel: Transformer Engine requires "
                    "the amax reduced over TP for it, and fp8ops runs TE's arithmetic",
                )
            )
        if self.precision.enabled and self.precision.backend == "te":
            problems.append(
                (
                    ("precision", "backend"),
                    "te",
                    "'te' with topology.sequence_parallel is not supported yet (not checked on a "
                    "GPU); use 'emulated' or 'scaled_mm'",
                )
            )
        return problems
