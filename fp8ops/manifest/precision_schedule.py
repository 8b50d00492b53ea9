"""``precision.schedule``: phases of training in which some modules' GEMMs leave FP8, e.g.
``fprop`` of every layer in BF16 for the last 10% of steps, or some modules run another FP8
recipe than the run's, e.g. current scaling in a delayed-scaling run.

A phase names the steps it covers, by number (``start``, ``end``) or by fraction of
``schedule.train_steps`` (``start_fraction``, ``end_fraction``), and what changes meanwhile
(``modules`` globs, ``gemms``; ``to``: the base dtype, or a recipe ``module_recipes`` could
give). Admission applies the phases that cover a step on top of the manifest's own decisions,
as overrides would (``fp8ops.admission``); the trainer switches at the step boundary where a
phase starts or ends (``fp8ops.train.phases``).

The step numbers are the ones ``metrics.jsonl`` gives: the first step is 1. A fraction ``f``
stands for step ``floor(f * train_steps)`` computed on the decimal as written (0.29 is 29/100,
not the float just below it): a phase from ``start_fraction: 0.9`` of 100 steps covers steps 91
to 100, one to ``end_fraction: 0.5`` ends with step 50.

Which modules a glob matches, and whether they can run FP8 at all, only the built model says:
admission refuses those problems; here are the ones the manifest alone shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fp8ops.gemm_roles import ALL_GEMMS
from fp8ops.manifest.base import NonEmptyStr, Section, SomeGlobs, raise_problems
from fp8ops.manifest.module_precision import (
    Gemms,
    ModuleScaling,
    module_recipe_backend_problem,
    not_delayed,
)

OpenFraction = float  # checked by the phase: 0 < f < 1


class PrecisionPhase(Section):
    """Steps of training in which some modules' GEMMs run in the base dtype instead of FP8, or
    some modules run another FP8 recipe than the run's."""

    start: int | None = Field(
        None, ge=1, description="The first step of the phase (steps count from 1)."
    )
    start_fraction: OpenFraction | None = Field(
        None,
        description=(
            "Or: the phase starts after this fraction of schedule.train_steps, 0 < f < 1 "
            "(0.9: the last 10% of steps)."
        ),
    )
    end: int | None = Field(
        None, ge=1, description="The last step of the phase; default: the end of training."
    )
    end_fraction: OpenFraction | None = Field(
        None,
        description="Or: the phase ends with this fraction of schedule.train_steps, 0 < f < 1.",
    )
    modules: SomeGlobs = Field(description="fnmatch globs on module names, as in layers.json.")
    gemms: Gemms | None = Field(
        None,
        description=(
            "The GEMMs of these modules that leave FP8, of fprop, dgrad and wgrad; null: all "
            "three, the whole module."
        ),
    )
    to: Literal["bf16", ModuleScaling] = Field(
        "bf16",
        description=(
            "Where they go: bf16, the base dtype (precision.base_dtype); or a recipe these FP8 "
            "modules run instead of precision.scaling, as a module_recipes entry would give "
            "('current', 'block' or 'mxfp8'; whole modules, no gemms)."
        ),
    )
    reason: NonEmptyStr = Field(description="Why (reviewed with the rest of the manifest).")

    @field_validator("to", mode="before")
    @classmethod
    def _not_delayed(cls, value: Any) -> Any:
        return not_delayed(value)

    @model_validator(mode="after")
    def _one_bound_each(self) -> PrecisionPhase:
        problems = []
        if (self.start is None) == (self.start_fraction is None):
            problems.append((("start",), self.start, "give one of start and start_fraction"))
        if self.end is not None and self.end_fraction is not None:
            problems.append((("end",), self.end, "give at most one of end and end_fraction"))
        for name in ("start_fraction", "end_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                problems.append(
                    ((name,), value, "must be between 0 and 1, both excluded (or use start/end)")
                )
        raise_problems("PrecisionPhase", problems)
        return self

    @property
    def recipe(self) -> str | None:
        """The recipe its modules run during the phase; None: the base dtype."""
        return None if self.to == "bf16" else self.to

    @property
    def all_gemms(self) -> frozenset[str]:
        """The GEMMs it takes out of FP8 (all three without ``gemms``)."""
        return frozenset(self.gemms) if self.gemms is not None else ALL_GEMMS


@dataclass(frozen=True)
class Phase:
    """A phase with its steps resolved against ``schedule.train_steps``: it covers the steps
    ``first`` to ``last``, both included. ``index``: its place in ``precision.schedule``."""

    index: int
    first: int
    last: int
    entry: PrecisionPhase

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    @property
    def where(self) -> str:
        return f"precision.schedule[{self.index}]"

    def overlaps(self, other: Phase) -> bool:
        return self.first <= other.last and other.first <= self.last


def fraction_step(fraction: float, train_steps: int) -> int:
    """``floor(fraction * train_steps)``, on the decimal as written (repr: 0.29 is 29/100)."""
    return math.floor(Fraction(repr(fraction)) * train_steps)


def resolve(schedule: tuple[PrecisionPhase, ...], train_steps: int) -> tuple[Phase, ...]:
    """The phases with their steps; bounds past ``train_steps`` are left as they are (the
    manifest refuses them: :func:`schedule_problems`)."""
    phases = []
    for index, entry in enumerate(schedule):
        if entry.start is not None:
            first = entry.start
        else:
            first = fraction_step(entry.start_fraction, train_steps) + 1
        if entry.end is not None:
            last = entry.end
        elif entry.end_fraction is not None:
            last = fraction_step(entry.end_fraction, train_steps)
        else:
            last = train_steps
        phases.append(Phase(index, first, last, entry))
    return tuple(phases)


def schedule_problems(
    schedule: tuple[PrecisionPhase, ...],
    train_steps: int,
    *,
    enabled: bool,
    backend: str,
    scaling: str,
) -> list[tuple[tuple[str | int, ...], Any, str]]:
    """What the manifest alone shows wrong in ``precision.schedule`` (locations relative to the
    manifest): a phase outside training or empty, two overlapping phases that name the same
    glob for a common GEMM, a schedule with nothing in FP8 to switch, per-GEMM phases on TE,
    and a recipe ``to`` that ``module_recipes`` would refuse (the run's own ``scaling``, one
    ``backend`` cannot run) or that names some ``gemms``."""
    if not schedule:
        return []
    field = ("precision", "schedule")
    if not enabled:
        return [(field, "...", "precision.enabled is false: no module runs FP8 to switch")]
    problems: list[tuple[tuple[str | int, ...], Any, str]] = []
    phases = resolve(schedule, train_steps)
    for phase in phases:
        entry, at = phase.entry, (*field, phase.index)
        start = "start" if entry.start is not None else "start_fraction"
        if phase.first > train_steps:
            problems.append(
                (
                    (*at, start),
                    getattr(entry, start),
                    f"starts at step {phase.first}, past schedule.train_steps ({train_steps})",
                )
            )
        elif phase.last > train_steps:
            problems.append(
                (
                    (*at, "end"),
                    entry.end,
                    f"past schedule.train_steps ({train_steps}); leave end out to run to the end",
                )
            )
        elif phase.last < phase.first:
            end = "end" if entry.end is not None else "end_fraction"
            problems.append(
                (
                    (*at, end),
                    getattr(entry, end),
                    f"the phase would end at step {phase.last}, before its first step "
                    f"{phase.first}: it covers no step",
                )
            )
        if backend == "te" and entry.gemms is not None and entry.all_gemms != ALL_GEMMS:
            problems.append(
                (
                    (*at, "gemms"),
                    list(entry.gemms),
                    "per-GEMM precision is not wired to Transformer Engine's layers in fp8ops "
                    "yet; remove gemms (the whole module) or use backend 'emulated'",
                )
            )
        problems += _recipe_problems(entry, at, backend=backend, scaling=scaling)
    for later in phases:
        for earlier in phases[: later.index]:
            common = set(earlier.entry.modules) & set(later.entry.modules)
            gemms = earlier.entry.all_gemms & later.entry.all_gemms
            if later.overlaps(earlier) and common and gemms:
                problems.append(
                    (
                        (*field, later.index, "modules"),
                        sorted(common)[0],
                        f"{earlier.where} switches the same modules' "
                        f"{', '.join(sorted(gemms))} in overlapping steps "
                        f"({max(earlier.first, later.first)} to {min(earlier.last, later.last)}); "
                        "merge the phases or make their steps follow each other",
                    )
                )
    return problems


def _recipe_problems(
    entry: PrecisionPhase, at: tuple[str | int, ...], *, backend: str, scaling: str
) -> list[tuple[tuple[str | int, ...], Any, str]]:
    """A phase's recipe under the rules of a ``module_recipes`` entry, and whole modules only:
    a module runs one recipe, so its GEMMs cannot split between two."""
    if entry.recipe is None:
        return []
    problems: list[tuple[tuple[str | int, ...], Any, str]] = []
    if entry.recipe == scaling:
        problems.append(
            (
                (*at, "to"),
                entry.to,
                f"'{entry.to}' is the run's own recipe (precision.scaling): these modules run it "
                "without the phase; name another recipe, or bf16",
            )
        )
    elif problem := module_recipe_backend_problem(
        entry.recipe, backend, "give these modules 'block' or 'current' instead"
    ):
        problems.append(((*at, "to"), entry.to, problem))
    if entry.gemms is not None and entry.all_gemms != ALL_GEMMS:
        problems.append(
            (
                (*at, "gemms"),
                list(entry.gemms),
                f"a phase to '{entry.to}' moves whole modules (a module's GEMMs run one recipe); "
                "remove gemms, or make it a phase to bf16",
            )
        )
    return problems
