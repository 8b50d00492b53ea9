"""The precision schedule during training: between two steps where a phase of
``precision.schedule`` starts or ends, every rank decides admission for the next step from the
same manifest, applies it, and rank 0 records the switch (``layers.json``'s history and a
``precision_phase`` event). The same path as an auto-degrade switch (``degrade.py``), without
a revision: the schedule is in the locked manifest, reviewed and hashed with the rest, so the
manifest is the approval and the ledger, which holds changes made to a run after its review,
gets no record.

The trainer's table is always the one for the step it runs next: a switch into step ``s`` is
made once step ``s - 1`` is done, before its checkpoint, so a checkpoint carries the table its
resume runs first (:func:`resume_at` decides it again, and the resume's admission check
compares the two).

A module switched back into FP8 runs on from its FP8 state as the phase left it: its amax
history and scales are not updated while it runs in BF16 (no FP8 GEMM casts its tensors, and
the amax reduction goes on over the others), as Transformer Engine keeps a module's
``fp8_meta`` while FP8 is off for it and picks it up when it is on again. So it is for a phase
that moves a delayed-scaling module to a stateless recipe (``to: current``): that recipe's
casts keep no state and record nothing in the module's (``fp8ops.megatron.layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fp8ops.admission import AdmissionTable, apply_admission, decide_admission
from fp8ops.gemm_roles import ALL_GEMMS, in_order
from fp8ops.manifest import manifest_hash
from fp8ops.manifest.precision_schedule import Phase, PrecisionPhase, resolve
from fp8ops.run.records import (
    AdmissionRow,
    RecipeRecord,
    TableChange,
    layers_history,
    table_hash,
    write_layers_json,
)

if TYPE_CHECKING:
    from fp8ops.alerts.rules import AlertEngine
    from fp8ops.manifest.schema import Manifest
    from fp8ops.run import RunDir


class Trainer(Protocol):
    """What a switch reads and changes of ``fp8ops.train.trainer.Trainer`` (named here, not
    imported: the trainer imports this module)."""

    manifest: Manifest
    model: Any
    admission: AdmissionTable
    recipe: Any
    alert_engine: AlertEngine
    run: RunDir | None
    start_step: int


def phases_of(manifest: Manifest) -> tuple[Phase, ...]:
    """``precision.schedule`` with its steps resolved against ``schedule.train_steps``."""
    return resolve(manifest.precision.schedule, manifest.schedule.train_steps)


def decide_at(
    model, manifest: Manifest, step: int, *, refuse_idle_recipes: bool = False
) -> AdmissionTable:
    """The admission table of ``manifest`` for ``step`` (counted from 1)."""
    return decide_admission(
        model,
        manifest.precision,
        tensor_parallel=manifest.topology.tensor_parallel,
        refuse_idle_recipes=refuse_idle_recipes,
        phases=phases_of(manifest),
        step=step,
    )


def at_boundary(trainer: Trainer, step: int) -> AdmissionTable:
    """Before ``step``, once the step before it is done (collective): the trainer's table for
    ``step``, switched where a phase starts at ``step`` or ended with the step before."""
    started, ended = _bounds(trainer.manifest, step)
    if not started and not ended:
        return trainer.admission
    table = decide_at(trainer.model, trainer.manifest, step)
    apply_admission(table, trainer.model)
    changed = _follow(trainer, trainer.admission, table)
    run = trainer.run
    if run.writer:
        change = _change(trainer, step, trainer.admission, table)
        write_layers_json(
            run.path,
            table,
            trainer.recipe,
            tensor_parallel=trainer.manifest.topology.tensor_parallel,
            manifest_hash=manifest_hash(trainer.manifest),
            history=(*layers_history(run.path), change),
        )
        run.event(
            "precision_phase",
            step=step,
            started=started,
            ended=ended,
            modules=changed,
            # What each changed module runs in the base dtype from this step on, and where it
            # goes: the recipe its FP8 GEMMs run, or the base dtype when none is FP8.
            base_gemms={m: _base_gemms(table, m) for m in changed},
            to={m: _target(trainer, table.row(m)) for m in changed},
            base_dtype=trainer.manifest.precision.base_dtype,
        )
    return table


def resume_at(trainer: Trainer, step: int) -> None:
    """A resume whose first step is ``step``: the trainer's table for it, the phases that
    cover it applied, as the straight run applied them before its checkpoint (collective)."""
    table = decide_at(trainer.model, trainer.manifest, step)
    apply_admission(table, trainer.model)
    _follow(trainer, trainer.admission, table)
    trainer.admission = table


def resumed_history(trainer: Trainer, run_dir) -> tuple[TableChange, ...]:
    """The history a resume's ``layers.json`` starts from: the switches before its first step
    as they were recorded, and the one into its first step as this resume's manifest makes it
    (a resume under a changed schedule must not keep what the old one switched there)."""
    if not trainer.manifest.precision.schedule:
        return ()  # only a schedule writes a history: without one, layers.json is not read
    step = trainer.start_step + 1
    kept = layers_history(run_dir, before=step)
    started, ended = _bounds(trainer.manifest, step)
    if not started and not ended:
        return kept
    before = decide_at(trainer.model, trainer.manifest, step - 1)
    return (*kept, _change(trainer, step, before, trainer.admission))


def _bounds(manifest: Manifest, step: int) -> tuple[list[int], list[int]]:
    """The phases that start at ``step`` and those that ended with the step before."""
    phases = phases_of(manifest)
    return [p.index for p in phases if p.first == step], [
        p.index for p in phases if p.last == step - 1
    ]


def _change(
    trainer: Trainer, step: int, before: AdmissionTable, after: AdmissionTable
) -> TableChange:
    started, ended = _bounds(trainer.manifest, step)
    schedule = trainer.manifest.precision.schedule
    causes = [f"precision.schedule[{i}] starts{_to_recipe(schedule[i])}" for i in started]
    causes += [f"precision.schedule[{i}] ended with step {step - 1}" for i in ended]
    return TableChange(
        step=step,
        cause="; ".join(causes),
        modules=tuple(_changed(before, after)),
        table_hash=table_hash(after.rows, RecipeRecord.from_recipe(trainer.recipe)),
    )


def _to_recipe(entry: PrecisionPhase) -> str:
    """A phase to a recipe, in a cause: the recipe (one to the base dtype reads as before)."""
    return "" if entry.recipe is None else f" (to {entry.recipe} scaling)"


def _changed(before: AdmissionTable, after: AdmissionTable) -> list[str]:
    """The modules whose FP8 GEMMs or recipe differ between the tables."""
    return [
        row.fqn
        for row in after.rows
        if (row.fp8_gemms, row.scaling)
        != (before.row(row.fqn).fp8_gemms, before.row(row.fqn).scaling)
    ]


def _follow(trainer: Trainer, before: AdmissionTable, after: AdmissionTable) -> list[str]:
    """Tell the alert rules which modules changed between the tables, as an auto-degrade
    switch does; returns them, in the table's order."""
    changed = _changed(before, after)
    engine = trainer.alert_engine
    engine.hold([m for m in changed if not after.row(m).fp8])
    engine.release([m for m in changed if after.row(m).fp8 and not before.row(m).fp8])
    engine.forget([m for m in changed if after.row(m).fp8 and before.row(m).fp8])
    return changed


def _target(trainer: Trainer, row: AdmissionRow) -> str:
    """What a module runs from a switch on: its FP8 GEMMs' recipe, else the base dtype."""
    if not row.fp8:
        return trainer.manifest.precision.base_dtype
    return row.scaling or trainer.manifest.precision.scaling


def _base_gemms(table: AdmissionTable, fqn: str) -> list[str]:
    fp8 = set(table.row(fqn).fp8_gemms) if table.row(fqn).fp8 else set()
    return list(in_order(ALL_GEMMS - fp8))
