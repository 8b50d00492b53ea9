"""Per-layer FP8 admission: which module of a built model runs FP8, and why.

The manifest's ``precision`` section says which modules *may* run FP8 (include and exclude
globs, the small-GEMM rule, ``enabled``, the ``backend`` whose GEMM sizes they must fit); only
the built model says which modules exist, how they are sharded and what shape their GEMMs have
on a rank. Admission puts the two together once, before training, into a table with one row per
linear-like module::

    table = decide_admission(model, manifest.precision, tensor_parallel=tp)  # decide
    apply_admission(table, model)                 # set fp8_enabled on the FP8 linears

The table's rows are what the run records in ``layers.json`` (``fp8ops.run.records``: the
row types, ``write_layers_json``, ``read_layers_json`` and the ``table_hash`` checkpoints
carry); ``fp8ops inspect RUN_DIR --layers`` prints it. Two lessons
from other stacks shape the rules: a filter that matches nothing must be an error, not a silent
no-op (torchtitan PR#4008 quantised the LM head of its 405B config through a stale filter
name), and small GEMMs lose in FP8 (the casts cost more than the faster matmul saves), so the
size rule looks at the GEMM that actually runs: the per-rank shard.

Megatron and torch are imported inside the functions that walk a model.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from fp8ops.errors import ManifestError
from fp8ops.gemm_roles import ALL_GEMMS, GEMMS, describe
from fp8ops.run.records import (
    AdmissionRow,
    AdmissionTable,
    Formats,
    GemmPrecision,
    GemmPrecisions,
    GemmShape,
    Reason,
    ReasonCode,
)

if TYPE_CHECKING:
    from torch import nn

    from fp8ops.manifest.precision_schedule import Phase
    from fp8ops.manifest.schema import PrecisionPolicy, SmallGemmRule


class AdmissionError(ManifestError):
    """The precision policy does not fit the model (a glob matches no module), or an
    admission table does not fit the model it is applied to."""


# --------------------------------------------------------------------------------------
# Shapes and the small-GEMM rule (pure functions)
# --------------------------------------------------------------------------------------


def per_rank_shape(parallel: str, global_shape: GemmShape, tensor_parallel: int) -> GemmShape:
    """The GEMM one tensor-parallel rank runs.

    Column-parallel splits the outputs (weight ``[N/tp, K]`` per rank), row-parallel the inputs
    (``[N, K/tp]``), a vocab-parallel embedding its rows (the vocabulary, K here); replicated
    modules run whole on every rank.
    """
    k, n = global_shape.k, global_shape.n
    split = {
        "column": (1, tensor_parallel),
        "row": (tensor_parallel, 1),
        "vocab": (tensor_parallel, 1),
        "replicated": (1, 1),
    }[parallel]
    if k % split[0] or n % split[1]:
        raise ValueError(
            f"a {parallel}-parallel GEMM of {global_shape} does not split evenly over "
            f"tensor_parallel={tensor_parallel}"
        )
    return GemmShape.of(k // split[0], n // split[1])


def small_gemm_verdict(rule: SmallGemmRule, rank_shape: GemmShape) -> str | None:
    """None when a per-rank GEMM is large enough for FP8, else the sentence saying why not."""
    k, n = rank_shape.k, rank_shape.n
    failures = []
    if min(k, n) < rule.min_dim:
        failures.append(f"min(K,N) {min(k, n)} < precision.small_gemm.min_dim {rule.min_dim}")
    if 2 * k * n < rule.min_flops_per_token:
        failures.append(
            f"2*K*N {2 * k * n} < precision.small_gemm.min_flops_per_token "
            f"{rule.min_flops_per_token}"
        )
    if not failures:
        return None
    return f"small GEMM: K={k}, N={n} per rank; " + " and ".join(failures)


@dataclass(frozen=True)
class GemmSizes:
    """The per-rank GEMM sizes a backend's FP8 kernels take: K and N in multiples, and why."""

    k_multiple: int
    n_multiple: int
    why: str

    def fits(self, rank_shape: GemmShape) -> bool:
        return rank_shape.k % self.k_multiple == 0 and rank_shape.n % self.n_multiple == 0


def fp8_gemm_sizes(backend: str, scaling: str = "delayed") -> GemmSizes | None:
    """The sizes an FP8 module's per-rank GEMM must have on ``precision.backend`` under
    ``precision.scaling``; None: any.

    ``torch._scaled_mm`` takes K and N in multiples of 16. The GEMM pads what is not (exactly:
    with zeros), which is right for the token dimension, set by the batch; but a *module* that is
    not aligned would have its FP8 weight copied into a padded buffer on every GEMM, for a GEMM
    too narrow or oddly shaped to gain from FP8. TE takes K in multiples of 16 and N in
    multiples of 8, and fails at the module's first FP8 forward otherwise. The emulated GEMM
    takes any size. MXFP8 scales blocks of 32 along both sides of every operand, so K and N
    must be multiples of 32 on every backend (TE's ``get_scale_shape`` refuses others; the
    token dimension is padded to 32, as Megatron pads it).
    """
    from fp8ops.precision.scaled_mm import ALIGNMENT  # torch: only when a model is decided

    sizes = {
        "scaled_mm": GemmSizes(
            ALIGNMENT, ALIGNMENT, "torch._scaled_mm needs them; padding would copy weights"
        ),
        # TE: a weight's rows in multiples of 8, as the tokens are; its columns of 16.
        "te": GemmSizes(
            16, 8, "Transformer Engine's FP8 GEMMs refuse others (assert_dim_for_fp8_exec)"
        ),
    }
    found = sizes.get(backend)
    if scaling != "mxfp8":
        return found
    mx = GemmSizes(32, 32, "MXFP8 scales blocks of 32 elements along K and N")
    if found is None:
        return mx
    return GemmSizes(
        math.lcm(found.k_multiple, 32), math.lcm(found.n_multiple, 32), f"{found.why}; {mx.why}"
    )


# --------------------------------------------------------------------------------------
# Deciding
# --------------------------------------------------------------------------------------

_PROJECTION_KINDS = {
    "linear_qkv": "qkv",
    "linear_proj": "proj",
    "linear_fc1": "fc1",
    "linear_fc2": "fc2",
}
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class _Found:
    """A linear-like module as the model walk finds it, before any decision."""

    fqn: str
    module: Any
    kind: str
    parallel: str
    global_shape: GemmShape
    fp8_capable: bool
    always_base: ReasonCode | None  # embedding, lm_head, norm: never FP8, whatever the globs


def decide_admission(
    model: nn.Module,
    precision: PrecisionPolicy,
    *,
    tensor_parallel: int,
    refuse_idle_recipes: bool = True,
    phases: Sequence[Phase] = (),
    step: int = 1,
) -> AdmissionTable:
    """Decide, for every linear-like module of ``model``, whether it runs FP8.

    ``model`` is a GPT from :func:`fp8ops.megatron.build_gpt` on this rank, built with
    ``tensor_parallel`` ranks (checked against its weight shards). An FP8-capable projection
    runs FP8 iff ``precision.enabled``, an include glob matches its full name, no exclude glob
    does and (when on) its per-rank GEMM passes ``precision.small_gemm``. Every glob must
    match some module of the table; the ones that don't are reported together as an
    :class:`AdmissionError`.

    Such a module must also fit ``precision.backend``'s FP8 GEMM (:func:`fp8_gemm_sizes`):
    ``scaled_mm`` and ``te`` take only some per-rank K and N. One that does not gets the
    reason ``unaligned``, and then the whole decision is refused (:class:`ManifestError`,
    naming every such module with the two ways out): an unaligned table is never applied or
    written. Only the modules that would run FP8 count: an excluded one never reaches the GEMM.

    A hand-written ``module_recipes`` entry that would change no module's recipe is refused
    too (``refuse_idle_recipes``; a resume passes False: what its checkpoint ran, it runs).

    ``phases``: ``precision.schedule`` resolved (``fp8ops.manifest.precision_schedule``); the
    table is the one for ``step`` (counted from 1), whose covering phases take their GEMMs of
    the FP8 modules they match to the base dtype, or those modules to their recipe (the row's
    ``scaling``, reason ``schedule``). Every phase's globs must match some module that can run
    FP8, two phases that overlap in steps must not switch the same GEMM of a module, and a
    phase's recipe must fit the modules it moves (:func:`_refuse_schedule_problems`): a
    schedule is checked whole, whatever the step.

    Under pipeline parallelism ``model`` is this rank's stage; the globs are checked against,
    and the table lists, the modules of every stage (collective over the pipeline group), so
    every stage decides and records the same table.
    """
    from fp8ops.megatron.stages import every_stage

    found = _walk(model, tensor_parallel)
    _check_globs(precision, every_stage([f.fqn for f in found]))
    formats = _formats(precision.fp8_format)
    rows = []
    for f in found:
        rank_shape = per_rank_shape(f.parallel, f.global_shape, tensor_parallel)
        own = module_recipe(precision, f.fqn)
        scaling = own[1].scaling if own else precision.scaling
        reason = _decide(f, rank_shape, precision, fp8_gemm_sizes(precision.backend, scaling))
        covering = [p for p in phases if p.covers(step)]
        reason, gemms, moved = _decide_gemms(f.fqn, reason, precision, covering)
        fp8 = any(gemm.precision == "fp8" for _, gemm in gemms.items())
        scaling = moved or (own[1].scaling if own and fp8 else None)
        rows.append(
            AdmissionRow(
                fqn=f.fqn,
                kind=f.kind,
                parallel=f.parallel,
                global_shape=f.global_shape,
                rank_shape=rank_shape,
                params_dtype=_params_dtype(f.module),
                precision="fp8" if fp8 else precision.base_dtype,
                formats=formats if fp8 else None,
                reason=reason,
                scaling=scaling,
                gemms=gemms,
            )
        )
    rows = every_stage(rows)
    _refuse_gemms_never_fp8(rows, precision)
    _refuse_schedule_problems(rows, phases, precision)
    if refuse_idle_recipes:
        _refuse_idle_module_recipes(rows, precision)
    _refuse_unaligned(rows, precision)
    return AdmissionTable(rows=tuple(rows), tensor_parallel=tensor_parallel)


def module_recipe(precision: PrecisionPolicy, fqn: str) -> tuple[int, Any] | None:
    """``(index, entry)`` of the first ``precision.module_recipes`` entry with a glob matching
    ``fqn`` (the order Megatron-Core's matchers follow when they hand the module its recipe),
    else None: the module runs ``precision.scaling``."""
    for index, entry in enumerate(precision.module_recipes):
        if _matches(fqn, entry.modules):
            return index, entry
    return None


def admitted_under(rows: Sequence[AdmissionRow], precision: PrecisionPolicy) -> list[str]:
    """The modules of a recorded table that ``precision`` would run in FP8: the decision of
    :func:`decide_admission`, made again from the kinds and per-rank shapes ``layers.json``
    holds, for another run of the same model at the same TP (a dual-track BF16 control's table
    says what its FP8 candidate will admit, before it is built). The backend's GEMM sizes are
    not checked here: the candidate's own :func:`decide_admission` refuses an unaligned module."""
    always_base = {"embedding", "lm_head", "norm"}
    admitted = []
    for row in rows:
        code = row.reason.code
        found = _Found(
            row.fqn,
            None,
            row.kind,
            row.parallel,
            row.global_shape,
            fp8_capable=code != "not_fp8_capable",
            always_base=code if code in always_base else None,
        )
        if _decide(found, row.rank_shape, precision, None).code == "fp8":
            admitted.append(row.fqn)
    return admitted


def _decide(
    f: _Found, rank_shape: GemmShape, precision: PrecisionPolicy, sizes: GemmSizes | None
) -> Reason:
    include = _first_match(f.fqn, "include_modules", precision.include_modules)
    if f.always_base is not None:
        text = _ALWAYS_BASE[f.kind]
        if include:
            text += f"; {include} matches it, but these modules never run FP8"
        return Reason(code=f.always_base, text=text)
    if not precision.enabled:
        return Reason(code="fp8_disabled", text="precision.enabled is false: no module runs FP8")
    if not f.fp8_capable:
        return Reason(
            code="not_fp8_capable",
            text=f"not an FP8-capable module ({type(f.module).__name__}, built from the plain "
            "spec)",
        )
    if not include:
        return Reason(code="not_included", text="matched by no glob in precision.include_modules")
    exclude = _first_match(f.fqn, "exclude_modules", precision.exclude_modules)
    if exclude:
        return Reason(code="excluded", text=f"excluded by {exclude}")
    override = _override(precision, f.fqn)
    if override is not None and not override.some_gemms:  # some GEMMs: _decide_gemms
        return Reason(code="override", text=_override_text(override))
    text = f"included by {include}"
    if precision.small_gemm.enabled:
        too_small = small_gemm_verdict(precision.small_gemm, rank_shape)
        if too_small:
            return Reason(code="small_gemm", text=too_small)
        text += f"; K={rank_shape.k}, N={rank_shape.n} per rank passes precision.small_gemm"
    else:
        text += "; precision.small_gemm is off"
    own = module_recipe(precision, f.fqn)
    if sizes is not None and not sizes.fits(rank_shape):
        return Reason(
            code="unaligned",
            text=f"K={rank_shape.k}, N={rank_shape.n} per rank; "
            f"{_under(precision, own[1].scaling if own else None)} needs K in multiples of "
            f"{sizes.k_multiple} and N in multiples of {sizes.n_multiple}",
        )
    if own is not None:
        index, entry = own
        text += (
            f"; {entry.scaling} scaling, not {precision.scaling}, by "
            f"precision.module_recipes[{index}] ({entry.reason})"
        )
    return Reason(code="fp8", text=text)


def _override(precision: PrecisionPolicy, fqn: str) -> Any:
    return next((o for o in precision.overrides if o.module == fqn), None)


def _override_text(override: Any) -> str:
    approval = (
        f"approved in the ledger as {override.approval[:12]}"
        if override.approval
        else "written in the manifest"
    )
    if override.policy:
        approval += f" by the auto-degrade policy of revision {override.policy[:12]}"
    what = (
        "BF16 override"
        if not override.some_gemms
        else f"BF16 override of {describe(override.gemms)}"
    )
    return f"{what} ({approval}): {override.reason}"


def _decide_gemms(
    fqn: str, reason: Reason, precision: PrecisionPolicy, covering: Sequence[Phase] = ()
) -> tuple[Reason, GemmPrecisions, str | None]:
    """Each of a module's GEMMs (``fp8ops.gemm_roles``) and why, given the module's
    ``reason``: a module in the base dtype runs all three there; an FP8 module runs in FP8 those
    its ``module_recipes`` entry names (all three without ``gemms``) less those its override
    names and those the ``covering`` phases of ``precision.schedule`` to the base dtype name.
    A module left with no FP8 GEMM runs in the base dtype, for its override or phase. A
    covering phase to a recipe gives the FP8 module that recipe, with its reason. Returns the
    module's reason (changed in those cases), its GEMMs, and the phase's recipe or None."""
    base = precision.base_dtype
    if reason.code != "fp8":
        return reason, GemmPrecisions.uniform(base, reason), None
    moved = _recipe_phase(fqn, covering)
    if moved is not None:
        reason = Reason(code="schedule", text=f"{reason.text}; {_phase_text(moved)}")
    own, override = module_recipe(precision, fqn), _override(precision, fqn)
    decided = {}
    for gemm in GEMMS:
        if own is not None and own[1].some_gemms and gemm not in own[1].gemms:
            index, entry = own
            text = (
                f"precision.module_recipes[{index}] runs {describe(entry.gemms)} of these "
                f"modules under {entry.scaling} scaling, the others in {base} ({entry.reason})"
            )
            decided[gemm] = GemmPrecision(
                precision=base, reason=Reason(code="module_recipe", text=text)
            )
        elif override is not None and gemm in override.gemms:
            decided[gemm] = GemmPrecision(
                precision=base, reason=Reason(code="override", text=_override_text(override))
            )
        elif phase := _covering_phase(fqn, gemm, covering):
            decided[gemm] = GemmPrecision(
                precision=base, reason=Reason(code="schedule", text=_phase_text(phase))
            )
        else:
            decided[gemm] = GemmPrecision(precision="fp8", reason=reason)
    if all(d.precision == base for d in decided.values()):
        # The module's reason: its override where it has one (as before the schedule existed,
        # so its row hashes as it did), else the phase.
        reasons = [d.reason for d in decided.values() if d.reason.code in ("override", "schedule")]
        cause = min(reasons, key=lambda r: r.code != "override")
        reason = Reason(code=cause.code, text=cause.text + "; no GEMM left in FP8")
    return reason, GemmPrecisions(**decided), moved.entry.recipe if moved else None


def _covering_phase(fqn: str, gemm: str, covering: Sequence[Phase]) -> Phase | None:
    """The phase among ``covering`` that takes ``gemm`` of ``fqn`` out of FP8 (the manifest and
    :func:`_refuse_schedule_problems` leave at most one)."""
    return next(
        (
            p
            for p in covering
            if p.entry.recipe is None
            and gemm in p.entry.all_gemms
            and _matches(fqn, p.entry.modules)
        ),
        None,
    )


def _recipe_phase(fqn: str, covering: Sequence[Phase]) -> Phase | None:
    """The phase among ``covering`` that moves ``fqn`` to another recipe (at most one: two
    covering phases never share a module's GEMM, and a recipe's phase takes all three)."""
    return next(
        (p for p in covering if p.entry.recipe is not None and _matches(fqn, p.entry.modules)),
        None,
    )


def _phase_text(phase: Phase) -> str:
    to = phase.entry.to if phase.entry.recipe is None else f"{phase.entry.recipe} scaling"
    return f"{phase.where}, steps {phase.first} to {phase.last}: {to} ({phase.entry.reason})"


def _refuse_gemms_never_fp8(rows: list[AdmissionRow], precision: PrecisionPolicy) -> None:
    """An override naming GEMMs of a module that never runs FP8 (an embedding, the LM head, a
    norm, a plain linear) is a mistake: no GEMM of it can leave FP8."""
    by_fqn = {row.fqn: row for row in rows}
    problems = [
        f"  precision.overrides[{i}].gemms: {o.module} is {_NEVER_WORDS[row.reason.code]}, which "
        "never runs FP8"
        for i, o in enumerate(precision.overrides)
        if o.gemms is not None
        and (row := by_fqn.get(o.module)) is not None
        and row.reason.code in _NEVER_FP8
    ]
    if problems:
        raise AdmissionError(
            "per-GEMM overrides of modules that have no FP8 GEMM:\n"
            + "\n".join(problems)
            + "\nRemove them in a new revision (fp8ops manifest derive --set "
            "'precision.overrides=[...]' ...)."
        )


def _refuse_schedule_problems(
    rows: list[AdmissionRow], phases: Sequence[Phase], precision: PrecisionPolicy
) -> None:
    """Refuse a schedule that does not fit the model: a phase's glob that matches no module, or
    only modules that never run FP8 (nothing to switch), two phases overlapping in steps
    that both switch a GEMM of one module (the schema catches only the same glob written
    twice), and a phase's recipe that does not fit a module it moves (:func:`_recipe_problems`).
    """
    problems = []
    for phase in phases:
        problems += _recipe_problems(rows, phase, precision)
        for i, glob in enumerate(phase.entry.modules):
            matched = [r for r in rows if fnmatchcase(r.fqn, glob)]
            where = f"  {phase.where}.modules[{i}] {glob!r}"
            if not matched:
                suggestion = _suggest(glob, [r.fqn for r in rows])
                hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
                problems.append(f"{where}: matches no module{hint}")
            elif all(r.reason.code in _NEVER_FP8 for r in matched):
                kinds = ", ".join(sorted({_NEVER_WORDS[r.reason.code] for r in matched}))
                problems.append(f"{where}: matches only modules that never run FP8 ({kinds})")
    for later in phases:
        for earlier in phases[: later.index]:
            gemms = earlier.entry.all_gemms & later.entry.all_gemms
            both = [
                r.fqn
                for r in rows
                if _matches(r.fqn, earlier.entry.modules) and _matches(r.fqn, later.entry.modules)
            ]
            if later.overlaps(earlier) and gemms and both:
                problems.append(
                    f"  {later.where}.modules: switches {describe(gemms)} of {_few(both)} in "
                    f"steps {earlier.where} covers too ({max(earlier.first, later.first)} to "
                    f"{min(earlier.last, later.last)})"
                )
    if problems:
        raise AdmissionError(
            "precision.schedule does not fit the model:\n"
            + "\n".join(problems)
            + "\nFix the phases (module names as in `fp8ops inspect RUN_DIR --layers`; phases "
            "that switch one module's GEMM must follow each other)."
        )


def _recipe_problems(
    rows: list[AdmissionRow], phase: Phase, precision: PrecisionPolicy
) -> list[str]:
    """A phase's recipe moves only modules of the run's recipe: one a ``module_recipes`` entry
    gives its own already is refused (which of the two would decide is not the phase's to
    say), and so is one whose GEMM the recipe cannot take on ``precision.backend``. The
    modules that may run FP8 at some step count: the FP8 ones, and those a phase takes out."""
    recipe = phase.entry.recipe
    if recipe is None:
        return []
    moved = [
        r
        for r in rows
        if r.reason.code in ("fp8", "schedule") and _matches(r.fqn, phase.entry.modules)
    ]
    where, problems = f"  {phase.where}.to {phase.entry.to!r}", []
    owned = [(r.fqn, own[0]) for r in moved if (own := module_recipe(precision, r.fqn))]
    if owned:
        names = [f"{fqn} (precision.module_recipes[{index}])" for fqn, index in owned]
        problems.append(
            f"{where}: {_few(names)} run their own recipe by module_recipes already, and a phase "
            "moves modules of the run's recipe only; narrow the phase's globs or the entry's"
        )
    sizes = fp8_gemm_sizes(precision.backend, recipe)
    if sizes is not None:
        unfit = [
            f"{r.fqn} (K x N = {r.rank_shape} per rank)"
            for r in moved
            if not sizes.fits(r.rank_shape)
        ]
        if unfit:
            problems.append(
                f"{where}: its GEMMs need K in multiples of {sizes.k_multiple} and N in "
                f"multiples of {sizes.n_multiple} per rank ({sizes.why}), and {_few(unfit)} "
                "are not; narrow the phase's globs, or give them 'block' or 'current'"
            )
    return problems


# Modules no glob can put in FP8, whatever the manifest says.
_NEVER_FP8 = ("embedding", "lm_head", "norm", "not_fp8_capable")
_NEVER_WORDS = {
    "embedding": "an embedding",
    "lm_head": "the LM head",
    "norm": "a norm",
    "not_fp8_capable": "a plain linear (built from the plain spec)",
}


def _refuse_idle_module_recipes(rows: list[AdmissionRow], precision: PrecisionPolicy) -> None:
    """Refuse a hand-written ``module_recipes`` entry that would change nothing: one whose
    globs match only modules that never run FP8, one whose every module an earlier
    hand-written entry decides (the first match decides), or one that gives the run's own
    recipe to modules no later entry would give another (the schema refuses the plain case).

    The ledger's entries (``approval`` set) go first by design and may take a hand-written
    entry's modules, so an entry is judged against the hand-written ones only. Modules that
    could run FP8 but do not now (excluded, too small at this TP, a BF16 override) do not make
    an entry idle: the entry applies again when they return."""
    if not precision.enabled:
        return
    written = [(i, e) for i, e in enumerate(precision.module_recipes) if e.approval is None]
    problems = []
    for position, (index, entry) in enumerate(written):
        matched = [r for r in rows if _matches(r.fqn, entry.modules)]
        can_run = [r for r in matched if r.reason.code not in _NEVER_FP8]
        # The earlier hand-written entry that decides each module, if one does.
        taken = {r.fqn: _first_match_in(r.fqn, written[:position]) for r in can_run}
        decided = [r for r in can_run if taken[r.fqn] is None]
        where = (
            f"  precision.module_recipes[{index}] ({entry.scaling} for {', '.join(entry.modules)})"
        )
        if not can_run:
            kinds = ", ".join(sorted({r.kind for r in matched}))
            problems.append(f"{where}: matches only modules that never run FP8 ({kinds})")
        elif not decided:
            first = ", ".join(str(i) for i in sorted(set(taken.values())))
            problems.append(
                f"{where}: every module it matches is decided by an earlier entry "
                f"(precision.module_recipes[{first}]); the first matching entry decides"
            )
        elif entry.scaling == precision.scaling and not entry.some_gemms:
            later = [e for e in precision.module_recipes[index + 1 :] if e.scaling != entry.scaling]
            if not any(_matches(r.fqn, e.modules) for r in decided for e in later):
                problems.append(
                    f"{where}: '{entry.scaling}' is the run's own recipe (precision.scaling), "
                    "and no later entry would give these modules another"
                )
    if problems:
        raise AdmissionError(
            f"{len(problems)} precision.module_recipes entr{'y' if len(problems) == 1 else 'ies'} "
            "would change no module's recipe:\n"
            + "\n".join(problems)
            + "\nRemove or narrow them in a new revision (fp8ops manifest derive --set "
            "'precision.module_recipes=[...]' ...)."
        )


def _first_match_in(fqn: str, entries: list[tuple[int, Any]]) -> int | None:
    return next((i for i, e in entries if _matches(fqn, e.modules)), None)


def _matches(fqn: str, globs: Sequence[str]) -> bool:
    return any(fnmatchcase(fqn, glob) for glob in globs)


def _refuse_unaligned(rows: list[AdmissionRow], precision: PrecisionPolicy) -> None:
    """Refuse a decision in which a module that would run FP8 does not fit its GEMM (reason
    ``unaligned``), naming each with its per-rank shape and the two ways out. The modules of
    one recipe are named together (a per-module MXFP8 entry has its own rule)."""
    by_scaling: dict[str | None, list[str]] = {}
    for row in rows:
        if row.reason.code == "unaligned":
            own = module_recipe(precision, row.fqn)
            by_scaling.setdefault(own[1].scaling if own else None, []).append(
                f"{row.fqn} (K x N = {row.rank_shape} per rank)"
            )
    if not by_scaling:
        return
    groups = []
    for own_scaling, unaligned in by_scaling.items():
        scaling = own_scaling or precision.scaling
        sizes = fp8_gemm_sizes(precision.backend, scaling)
        more = f"; and {len(unaligned) - 4} more" if unaligned[4:] else ""
        field = "their precision.module_recipes entry" if own_scaling else "precision.scaling"
        if scaling != "mxfp8":
            way_out = "precision.backend 'emulated'"
        else:
            way_out = f"{field} 'block' or 'current'"
        mixed = f"the {scaling}-scaling modules, " if len(by_scaling) > 1 else ""
        groups.append(
            f"{mixed}{_under(precision, own_scaling)}: every FP8 module's GEMM needs K in multiples "
            f"of {sizes.k_multiple} and N in multiples of {sizes.n_multiple} per rank "
            f"({sizes.why}), and {len(unaligned)} are not: {'; '.join(unaligned[:4])}{more}. "
            f"Keep them in {precision.base_dtype} (precision.exclude_modules), or use {way_out}"
        )
    raise ManifestError("\n".join(groups))


def _under(precision: PrecisionPolicy, own_scaling: str | None = None) -> str:
    if own_scaling == "mxfp8":
        return f"MXFP8 by precision.module_recipes on precision.backend {precision.backend!r}"
    if precision.scaling == "mxfp8" and own_scaling is None:
        return f"precision.scaling 'mxfp8' on precision.backend {precision.backend!r}"
    return f"precision.backend {precision.backend!r}"


# Why the embedding, LM head and norms stay in the base dtype, by kind (the practice of TE,
# torchtitan and DeepSeek-V3: the first and last layers are the most precision-sensitive).
_ALWAYS_BASE = {
    "embedding": "the word embedding is never FP8 (a lookup, not a GEMM)",
    "position_embedding": "the position embedding is never FP8 (a lookup, not a GEMM)",
    "lm_head": "the LM head is never FP8 (its logits feed the loss: the most sensitive GEMM)",
    "norm": "norms are never FP8 (no GEMM)",
}


def _first_match(fqn: str, field: str, globs: tuple[str, ...]) -> str | None:
    """``"precision.<field>[i] '<glob>'"`` for the first glob matching ``fqn``, else None."""
    for index, glob in enumerate(globs):
        if fnmatchcase(fqn, glob):
            return f"precision.{field}[{index}] '{glob}'"
    return None


def _formats(fp8_format: str) -> Formats:
    from fp8ops.precision import Fp8Format

    fmt = Fp8Format.parse(fp8_format)
    return Formats(forward=fmt.forward.name.upper(), backward=fmt.backward.name.upper())


def _params_dtype(module: Any) -> str:
    weight = getattr(module, "weight", None)
    # An LM head tied to the embedding has no weight of its own; its config says the dtype.
    dtype = weight.dtype if weight is not None else module.config.params_dtype
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


# --------------------------------------------------------------------------------------
# Walking the model
# --------------------------------------------------------------------------------------


def _walk(model: nn.Module, tensor_parallel: int) -> list[_Found]:
    """The linear-like modules of ``model``: projections, LM head, embeddings, norms, each layer's
    named by its global number (a pipeline stage's local layers start at its offset)."""
    from fp8ops.megatron.layers import global_layer_name

    found = []
    for fqn, module in model.named_modules():
        item = _classify(global_layer_name(model, fqn), module)
        if item is not None:
            _check_shard(item, tensor_parallel)
            found.append(item)
    return found


def _classify(fqn: str, module: Any) -> _Found | None:
    import torch

    from fp8ops.megatron.compat import ColumnParallelLinear, RowParallelLinear, tensor_parallel
    from fp8ops.megatron.layers import FP8_PARALLEL_LINEARS
    from fp8ops.megatron.te_state import is_te_projection

    name = fqn.rsplit(".", 1)[-1]
    if is_te_projection(module):  # Megatron's TE spec (te_backend): TE's own parallel linears
        return _te_projection(fqn, module, _PROJECTION_KINDS.get(name, "other"))
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        parallel = "column" if isinstance(module, ColumnParallelLinear) else "row"
        shape = GemmShape.of(module.input_size, module.output_size)
        if name == "output_layer":
            return _Found(fqn, module, "lm_head", parallel, shape, False, "lm_head")
        kind = _PROJECTION_KINDS.get(name, "other")
        capable = isinstance(module, FP8_PARALLEL_LINEARS)
        return _Found(fqn, module, kind, parallel, shape, capable, None)
    if isinstance(module, tensor_parallel.VocabParallelEmbedding):
        shape = GemmShape.of(module.num_embeddings, module.embedding_dim)
        return _Found(fqn, module, "embedding", "vocab", shape, False, "embedding")
    if isinstance(module, torch.nn.Embedding):  # Megatron's learned absolute positions
        shape = GemmShape.of(module.num_embeddings, module.embedding_dim)
        return _Found(fqn, module, "position_embedding", "replicated", shape, False, "embedding")
    if isinstance(module, torch.nn.Linear):
        shape = GemmShape.of(module.in_features, module.out_features)
        return _Found(fqn, module, "other", "replicated", shape, False, None)
    if _is_norm(module):
        width = module.weight.numel()
        return _Found(fqn, module, "norm", "replicated", GemmShape.of(width, width), False, "norm")
    return None


def _te_projection(fqn: str, module: Any, kind: str) -> _Found:
    """A TE linear keeps only this rank's sizes: its weight is ``[out, in]`` per rank, and
    ``parallel_mode`` says which of the two ``tp_size`` ranks split."""
    out_features, in_features = module.weight.shape
    parallel = module.parallel_mode
    if parallel not in ("column", "row"):
        raise ValueError(f"{fqn}: a TE linear with parallel_mode {parallel!r} is not a projection")
    if parallel == "column":
        shape = GemmShape.of(in_features, out_features * module.tp_size)
    else:
        shape = GemmShape.of(in_features * module.tp_size, out_features)
    return _Found(fqn, module, kind, parallel, shape, True, None)


def _is_norm(module: Any) -> bool:
    import torch

    # torch's own norms (Megatron's local spec), or Apex's FusedLayerNorm, TE's TENorm, ...;
    # a norm without a weight (an IdentityOp slot, an L2 norm) has nothing to list.
    is_norm = isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))
    is_norm = is_norm or type(module).__name__.endswith("Norm")
    return is_norm and isinstance(getattr(module, "weight", None), torch.nn.Parameter)


def _check_shard(item: _Found, tensor_parallel: int) -> None:
    # The small-GEMM rule is only as right as the per-rank shape: a wrong tensor_parallel
    # would admit or refuse modules silently, so check it against the weight this rank holds.
    weight = getattr(item.module, "weight", None)
    if item.parallel not in ("column", "row", "vocab") or weight is None:
        return
    shape = per_rank_shape(item.parallel, item.global_shape, tensor_parallel)
    expected = (shape.k, shape.n) if item.parallel == "vocab" else (shape.n, shape.k)
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} does not fit the model: {item.fqn} holds a "
            f"weight of shape {list(weight.shape)} on this rank, expected {list(expected)}; "
            "pass the tensor-parallel size the model was built with"
        )


# --------------------------------------------------------------------------------------
# Globs that match nothing
# --------------------------------------------------------------------------------------


def _check_globs(precision: PrecisionPolicy, fqns: list[str]) -> None:
    """Every include and exclude glob must match some module: a glob that matches nothing is
    a typo or a stale name, and silently ignoring it changes what runs FP8."""
    problems = []
    for field in ("include_modules", "exclude_modules"):
        for index, glob in enumerate(getattr(precision, field)):
            if not any(fnmatchcase(fqn, glob) for fqn in fqns):
                problems.append(f"  precision.{field}[{index}] '{glob}': {_hint(glob, fqns)}")
    for index, entry in enumerate(precision.module_recipes):
        for j, glob in enumerate(entry.modules):
            if not any(fnmatchcase(fqn, glob) for fqn in fqns):
                problems.append(
                    f"  precision.module_recipes[{index}].modules[{j}] '{glob}': "
                    f"{_hint(glob, fqns)}"
                )
    for index, override in enumerate(precision.overrides):
        if override.module not in fqns:
            close = difflib.get_close_matches(override.module, fqns, n=1)
            hint = (
                f"no module has that name; did you mean '{close[0]}'?"
                if close
                else ("no module has that name")
            )
            problems.append(f"  precision.overrides[{index}].module '{override.module}': {hint}")
    if problems:
        raise AdmissionError(
            f"{len(problems)} module glob(s) in the manifest match no module of this model "
            "(globs match the full module name, fnmatch-style):\n"
            + "\n".join(problems)
            + "\nFix them in a new revision (fp8ops manifest derive --set "
            "'precision.include_modules=[...]' ...)."
        )


def _hint(glob: str, fqns: list[str]) -> str:
    """A corrected glob when one is easy to guess, else a few real names to compare with."""
    # Module names with layer indices as '*': 16 layers are one name to read, not 16.
    patterns = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", fqn) for fqn in fqns))
    suggestion = _suggest(glob, fqns)
    if suggestion:
        matched = [p for p in patterns if fnmatchcase(p, suggestion)] or [
            fqn for fqn in fqns if fnmatchcase(fqn, suggestion)
        ]
        return f"matches nothing; did you mean '{suggestion}'? (it matches {_few(matched, 3)})"
    names = difflib.get_close_matches(glob, patterns, n=3, cutoff=0.5) or patterns[:3]
    return "matches nothing; module names look like " + ", ".join(names)


# Names other stacks give the same modules (Hugging Face, torchtitan): a manifest written
# with them matches nothing in a Megatron model.
_OTHER_NAMES = {
    "lm_head": "output_layer",
    "output": "output_layer",
    "embed_tokens": "word_embeddings",
    "tok_embeddings": "word_embeddings",
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "wq": "linear_qkv",
    "wk": "linear_qkv",
    "wv": "linear_qkv",
    "o_proj": "linear_proj",
    "wo": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "w1": "linear_fc1",
    "w3": "linear_fc1",
    "down_proj": "linear_fc2",
    "w2": "linear_fc2",
}


def _suggest(glob: str, fqns: list[str]) -> str | None:
    def matches(candidate: str) -> bool:
        return any(fnmatchcase(fqn, candidate) for fqn in fqns)

    # A bare or relative name ("linear_fc1", "layers.0.*"): the match is on the full name.
    if matches("*." + glob):
        return "*." + glob
    # Another stack's name, or a misspelt one, in the last segment.
    head, _, last = glob.rpartition(".")
    segments = sorted({fqn.rsplit(".", 1)[-1] for fqn in fqns})
    replacement = _OTHER_NAMES.get(last) or next(
        iter(difflib.get_close_matches(last, segments, n=1)), None
    )
    if replacement is None:
        return None
    for candidate in (f"{head}.{replacement}" if head else replacement, "*." + replacement):
        if matches(candidate):
            return candidate
    return None


# --------------------------------------------------------------------------------------
# Applying
# --------------------------------------------------------------------------------------


def apply_admission(table: AdmissionTable, model: nn.Module) -> None:
    """Set ``fp8_enabled`` (and ``fp8_gemms``: which GEMMs; the recipe a phase of
    ``precision.schedule`` gives it) on every FP8-capable linear of ``model`` as ``table``
    decided.

    The table must list exactly the model's linear-like modules (one decided for, or read from
    the ``layers.json`` of, the same model); otherwise nothing is changed and
    :class:`AdmissionError` says which names differ. A pipeline stage's model holds some of the
    table's modules: the others are another stage's.
    """
    from fp8ops.megatron.layers import fp8_modules
    from fp8ops.megatron.te_backend import te_projections

    in_model = [f.fqn for f in _walk(model, table.tensor_parallel)]
    in_table = [row.fqn for row in table.rows]
    whole = getattr(model, "pre_process", True) and getattr(model, "post_process", True)
    only_table = sorted(set(in_table) - set(in_model)) if whole else []
    only_model = sorted(set(in_model) - set(in_table))
    if only_table or only_model:
        raise AdmissionError(
            "the admission table does not fit the model (was it decided for another model?): "
            f"only in the table: {_few(only_table)}; only in the model: {_few(only_model)}"
        )
    capable = fp8_modules(model) | te_projections(model)
    here = [row for row in table.rows if row.fqn in set(in_model)]  # a stage: its own rows
    wrong = [row.fqn for row in here if row.fp8 and row.fqn not in capable]
    if wrong:
        raise AdmissionError(
            f"the admission table runs {_few(wrong)} in FP8, but the model built them from the "
            "plain spec (build the model with a recipe)"
        )
    # Megatron handed each module its per-module recipe (quant_config.py); the table decided
    # the same from the same globs. A model built otherwise must not run under this table. A
    # phase's recipe is not built in: the module runs it while the phase lasts (layers.py).
    own = fp8_modules(model)
    wrong = [
        f"{row.fqn} (the table: {_built_scaling(row) or 'the run recipe'}; the model: "
        f"{own[row.fqn].own_scaling or 'the run recipe'})"
        for row in here
        if row.fp8 and row.fqn in own and own[row.fqn].own_scaling != _built_scaling(row)
    ]
    if wrong:
        raise AdmissionError(
            f"the model's modules run other recipes than the admission table says: {_few(wrong)} "
            "(build the model from the manifest the table was decided for)"
        )
    wrong = [row.fqn for row in here if row.some_gemms and row.fqn not in own]
    if wrong:
        raise AdmissionError(
            f"the admission table runs some GEMMs of {_few(wrong)} in FP8 and others not, which "
            "only fp8ops' own FP8 layers do (not Transformer Engine's)"
        )
    for fqn, module in capable.items():
        row = table.row(fqn)
        module.fp8_enabled = row.fp8
        if fqn in own:
            module.fp8_gemms = frozenset(row.fp8_gemms) if row.fp8 else ALL_GEMMS
            module.run_phase_recipe(_phase_scaling(row))


def _phase_scaling(row: AdmissionRow) -> str | None:
    """The recipe a phase of ``precision.schedule`` gives the row's module, if one does."""
    return row.scaling if row.fp8 and row.reason.code == "schedule" else None


def _built_scaling(row: AdmissionRow) -> str | None:
    """The recipe ``module_recipes`` built the row's module with (None: the run's)."""
    return None if _phase_scaling(row) else row.scaling


def _few(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
