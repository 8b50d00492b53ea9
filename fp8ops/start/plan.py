"""How a run starts, decided in one place before any process group or model exists.

A command is a request (:class:`TrainRequest` for ``fp8ops train``, :class:`ResumeRequest` for
``fp8ops resume``); :func:`plan_start` turns it into one of four plans (:mod:`fp8ops.start.plans`):

* :class:`New`: a run to start in a free directory (``start_over``: an unfinished attempt of the
  same manifest, without a checkpoint, is set aside first);
* :class:`Resume`: continue a run from a checkpoint, locked to the checkpoint's manifest plus
  approved overrides plus accepted drift (:func:`plan_resume`);
* :class:`Finish`: a run whose checkpoint is at its last step but which never wrote its final
  weights: load it and finish;
* :class:`Complete`: nothing to do (a rerun of a finished run); a result, exit 0.

Every check the decision rests on is in :mod:`fp8ops.start.checks`, each failing closed. Those
that need what only the ranks build (the tokenizer and data, the admission table, the loaded
checkpoint) are called by the rank start-up (``fp8ops.train.startup``) with them.

What :func:`plan_resume` decides, from the checkpoint's metadata (one JSON file):

1. the requested manifest: the checkpoint's own (``fp8ops resume``), or a file
   (``fp8ops train MANIFEST --resume``), with ``--set`` changes on top;
2. drift = its fields, the environment fingerprint, or the FP8 state layout differ from the
   checkpoint's. Refused (``DriftRefused``, exit 4) unless ``accept_drift`` gives a reason: the
   requested content then becomes a new revision whose parent is the checkpoint's manifest and
   whose reason names the reason and the changed fields;
3. approved overrides in the run's ledger become one more revision on top
   (``precision.overrides``), and overrides revoked after they were applied come off. These are
   not drift: they were reviewed in the ledger;
4. a run a Stop alert halted resumes only when something answers the alert: a manifest other
   than the one it stopped under, or ``after_stop`` (an operator's reason to go on as it is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.checkpoint.consistency import read_consistent
from fp8ops.checkpoint.directory import CheckpointDir
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash
from fp8ops.manifest.canonical import content_dict
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunLayout
from fp8ops.run import environment as run_environment
from fp8ops.run.layout import MANIFEST
from fp8ops.start import checks
from fp8ops.start.drift import Drift, environment_drift, manifest_drift
from fp8ops.start.plans import Complete, Finish, New, Resume, StartPlan

# -- what a command asks for ---------------------------------------------------------------------


@dataclass(frozen=True)
class TrainRequest:
    """``fp8ops train MANIFEST``: ``resume`` continues ``run_dir`` from its latest checkpoint
    if it has one (locked: see :func:`plan_resume`) and starts it otherwise."""

    manifest_path: Path
    run_dir: Path
    assignments: dict = field(default_factory=dict)  # --set: a derived revision of the file
    resume: bool = False
    accept_drift: str | None = None
    after_stop: str | None = None
    stop_at: int | None = None
    # A Hugging Face base compared with transformers' logits: None where transformers is
    # installed, True required to match (else refused), False not compared.
    verify: bool | None = None


@dataclass(frozen=True)
class ResumeRequest:
    """``fp8ops resume RUN_DIR``: continue from a checkpoint (default: the latest) under the
    checkpoint's manifest."""

    run_dir: Path
    checkpoint: str | None = None
    assignments: dict = field(default_factory=dict)
    accept_drift: str | None = None
    after_stop: str | None = None
    stop_at: int | None = None


# -- the decision --------------------------------------------------------------------------------


def plan_start(request: TrainRequest | ResumeRequest) -> StartPlan:
    """Decide how ``request`` starts; the refusals are :mod:`fp8ops.start.checks`'."""
    checks.check_not_imported(Path(request.run_dir))
    if isinstance(request, ResumeRequest):
        return _plan_resume_command(request)
    return _plan_train_command(request)


def _plan_train_command(request: TrainRequest) -> StartPlan:
    manifest_path, run_dir = Path(request.manifest_path), Path(request.run_dir)
    layout = RunLayout(run_dir)
    if request.resume and request.accept_drift is None:
        requested = locked_manifest_of(manifest_path, request.assignments)[0]
        if ManifestStore(layout.manifests).path_for(manifest_hash(requested)).exists():
            done = checks.nothing_to_train(run_dir)  # its own manifest: a rerun after the end
            if done is not None:
                return Complete(run_dir, done)
    if request.resume and CheckpointDir(run_dir).complete():
        checks.check_not_trained_now(run_dir)
        if manifest_path.resolve() != layout.manifest.resolve():
            checks.check_unedited(run_dir)  # else the edit is the request, diffed as drift below
        plan = plan_resume(
            run_dir,
            manifest_path=manifest_path,
            assignments=request.assignments,
            accept_drift=request.accept_drift,
            after_stop=request.after_stop,
        )
        return _resumed(plan, str(manifest_path), request.stop_at)
    manifest, lineage = locked_manifest_of(manifest_path, request.assignments)
    plan = New(
        manifest,
        lineage,
        run_dir,
        source=str(manifest_path),
        start_over=request.resume,
        stop_at=request.stop_at,
        verify=request.verify,
    )
    checks.check_stop_at(request.stop_at, 0, manifest.schedule.train_steps)
    if not plan.start_over:
        done = checks.check_free(run_dir, manifest)
        if done is not None:
            return Complete(run_dir, done)
    checks.check_inputs(manifest, plan.source, resuming=False)
    return plan


def _plan_resume_command(request: ResumeRequest) -> StartPlan:
    run_dir = Path(request.run_dir)
    if request.checkpoint is None and not request.assignments and request.accept_drift is None:
        done = checks.nothing_to_train(run_dir)
        if done is not None:
            return Complete(run_dir, done)
    checks.check_not_trained_now(run_dir)
    checks.check_unedited(run_dir)
    plan = plan_resume(
        run_dir,
        checkpoint=request.checkpoint,
        assignments=request.assignments,
        accept_drift=request.accept_drift,
        after_stop=request.after_stop,
    )
    return _resumed(plan, str(plan.checkpoint / MANIFEST), request.stop_at)


def _resumed(plan: Resume, source: str, stop_at: int | None) -> StartPlan:
    """The resume as it runs: to the end, a finish (the last step's checkpoint, no final
    weights), or nothing left to do."""
    plan.source, plan.stop_at = source, stop_at
    steps = plan.manifest.schedule.train_steps
    if plan.step >= steps:
        if plan.step == steps and not checks.finished(plan.run_dir):
            finish = Finish(**vars(plan))
            checks.check_inputs(finish.manifest, source, resuming=True)
            return finish
        return Complete(
            plan.run_dir,
            f"{plan.checkpoint} is at step {plan.step} of {steps}: nothing to train. To train "
            'longer, raise schedule.train_steps (--set schedule.train_steps=N --accept-drift "why")',
        )
    checks.check_stop_at(stop_at, plan.step, steps)
    checks.check_inputs(plan.manifest, source, resuming=True)
    return plan


def locked_manifest_of(path: Path, assignments: dict) -> tuple[Manifest, list[Manifest]]:
    """The manifest a new run of ``path`` is locked to, and its lineage (root first)."""
    manifest = load_manifest(path)
    if not assignments:
        return manifest, [manifest]
    reason = "fp8ops train --set " + " ".join(f"{k}={v}" for k, v in assignments.items())
    child = derive(manifest, assignments, reason, source=f"{path} with --set")
    return child, [manifest, child]


# -- the resume ----------------------------------------------------------------------------------


def plan_resume(
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    manifest_path: Path | None = None,
    assignments: dict | None = None,
    accept_drift: str | None = None,
    after_stop: str | None = None,
    environment: dict | None = None,
) -> Resume:
    """Decide how to resume ``run_dir`` (module docstring, 1. to 4.); raises ``DriftRefused``
    on unaccepted drift and ``StopUnanswered`` for a stopped run that nothing answers."""
    run_dir = Path(run_dir)
    checks.check_is_run(run_dir)
    seen = checks.where_the_run_is(run_dir)  # before reading: a live run may move it on
    with checks.reading_checkpoint(run_dir, seen):
        directory = CheckpointDir(run_dir).find(checkpoint)
        meta = read_consistent(directory)  # before anything reads or advises on what it says
        saved = load_manifest(directory / MANIFEST)
        checks.check_saved_manifest(directory, saved, meta)
    checks.check_run_revisions(run_dir, directory, meta)
    checks.check_reasons(accept_drift, after_stop)
    requested = saved
    if manifest_path is not None:
        requested = _with_ledger_overrides(load_manifest(manifest_path), saved)
    if assignments:
        requested = derive(requested, assignments, "--set", source="--set")

    drift = Drift(manifest_drift(saved, requested))
    drift.changes += environment_drift(
        meta.environment, environment or run_environment.environment_fingerprint()
    )
    fp8_read = checks.check_drift(
        drift, meta, requested, run_dir, directory, manifest_path, accept_drift
    )

    manifest, new = saved, []
    if drift and any(c.what == "manifest" for c in drift.changes):
        reason = f"resume accepted drift ({drift.summary()}): {accept_drift}"
        manifest = _rebase(saved, requested, reason)
        new.append(manifest)
    plan = Resume(
        run_dir,
        directory,
        meta,
        saved,
        manifest,
        new,
        drift,
        accept_drift if drift else None,
        fp8_read=fp8_read,
        accept_drift=accept_drift,
        after_stop=after_stop,
        seen=seen,
    )
    with checks.reading_checkpoint(run_dir, seen):  # every checkpoint's record is read
        _apply_ledger(plan)
    checks.check_fp8_state_saved(plan)
    checks.check_stop_answered(plan)
    return plan


def _with_ledger_overrides(requested: Manifest, saved: Manifest) -> Manifest:
    """``requested`` with the overrides the checkpoint's run applied from its ledger (BF16
    ``precision.overrides`` and current-scaling ``precision.module_recipes`` entries).

    A manifest file (``train MANIFEST --resume``, every SLURM requeue) never lists them: a resume
    wrote them into the run's own revision, reviewed in the ledger, so they are not drift.
    """
    changes = {}
    for name in ("overrides", "module_recipes"):
        entries_saved = getattr(saved.precision, name)
        entries_requested = getattr(requested.precision, name)
        ledger_backed = [o for o in entries_saved if o.approval is not None]
        own = [o for o in entries_requested if o.approval is None]
        # In the saved list's order (manifests compare lists as written; for module recipes the
        # order decides), the file's own entries the checkpoint does not hold after them.
        order = {o: i for i, o in enumerate(entries_saved)}
        merged = sorted(ledger_backed + own, key=lambda o: order.get(o, len(order)))
        if ledger_backed and entries_requested != tuple(merged):
            changes[f"precision.{name}"] = [o.model_dump(mode="json") for o in merged]
    if not changes:
        return requested
    return derive(requested, changes, "overrides from the run's ledger")


def _rebase(saved: Manifest, requested: Manifest, reason: str) -> Manifest:
    """``requested``'s content as the next revision of ``saved``."""
    old, new = content_dict(saved), content_dict(requested)
    changes = {
        section: new[section]
        for section in new
        if section not in ("revision", "schema_version") and new[section] != old[section]
    }
    return derive(saved, changes, reason, source="the resumed manifest")


def _apply_ledger(plan: Resume) -> None:
    """Make the manifest's ledger-backed overrides what the ledger says now: approved and
    applied ones on, revoked ones off, as one more revision (none if they already agree).

    Compared with the checkpoint's manifest, not with the ledger's own "applied" records: a
    resume from an older checkpoint (or a crash before the first checkpoint after a resume)
    must apply them again.
    """
    # Imported here: the ledger's module table (layers.json) costs a third of a second that a
    # resume refused for drift, before this point, should not pay.
    from fp8ops.overrides import Ledger, LedgerError
    from fp8ops.overrides.anchors import run_anchors

    # Read as `overrides verify` reads it, held to this resume's checkpoint and manifest: every
    # rule, the signatures the run requires, every checkpoint's anchor (a ledger one saw is gone).
    ledger = Ledger(plan.run_dir, anchors=run_anchors(plan.run_dir, resume=plan))
    overrides = ledger.overrides()
    plan.unverified_records = ledger.unverified()  # signatures not required: flagged
    precision = plan.manifest.precision
    # The ledger's entries in force: BF16 overrides, and one-module current-scaling recipes.
    in_force = {o.module: o for o in precision.overrides if o.approval is not None}
    in_force |= {r.modules[0]: r for r in precision.module_recipes if r.approval is not None}
    approvals = {o.approval: o for o in overrides.values() if o.approval is not None}
    for override in in_force.values():
        if override.approval not in approvals:
            lost = (
                "is gone"
                if not ledger.path.exists()
                else "no longer holds it: its last records were removed"
            )
            module = override.modules[0] if hasattr(override, "modules") else override.module
            where = (
                f"under {override.scaling} scaling" if hasattr(override, "modules") else "in BF16"
            )
            raise LedgerError(
                f"{ledger.path}: the checkpoint's manifest runs {module} {where} under "
                f"approval {override.approval[:12]}, but the ledger {lost}. Restore the file "
                "from a backup before resuming."
            )
    wanted = {
        o.module: o
        for o in overrides.values()
        if o.status in ("approved", "applied")
        and not _redone_by_policy(o, in_force, plan.step, plan.manifest.alerts.auto_degrade)
    }
    # A module in force under another approval than the one wanted now (its override revoked,
    # then a new one approved before a resume lifted it) is lifted and applied again: the
    # revision then names the approval that holds it, and both reach the ledger's records.
    applied = [
        o
        for module, o in wanted.items()
        if module not in in_force or in_force[module].approval != o.approval
    ]
    lifted = [
        approvals[o.approval]
        for module, o in in_force.items()
        if module not in wanted or wanted[module].approval != o.approval
    ]
    if not applied and not lifted:
        return
    lifted_modules = {lift.module for lift in lifted}
    overrides_now = [
        o.model_dump(mode="json")
        for o in precision.overrides
        if not (o.approval is not None and o.module in lifted_modules)
    ]
    overrides_now += [
        o.as_manifest_override().model_dump(mode="json") for o in applied if o.scaling is None
    ]
    # The ledger's recipes go first: the first matching entry decides, and an approved one for
    # a single module must win over a glob written in the manifest.
    recipes_now = [
        o.as_manifest_override().model_dump(mode="json") for o in applied if o.scaling is not None
    ]
    recipes_now += [
        r.model_dump(mode="json")
        for r in precision.module_recipes
        if not (r.approval is not None and r.modules[0] in lifted_modules)
    ]
    revoked = {o.module: o for o in lifted}
    replaced = revoked.keys() & {o.module for o in applied}
    words = [f"{o.module} to {o.target} ({o.id[:12]})" for o in applied if o.module not in replaced]
    words += [
        f"{o.module} back to {plan.manifest.precision.scaling} FP8 ({o.id[:12]} revoked)"
        for o in lifted
        if o.module not in replaced
    ]
    words += [
        f"{o.module} stays {o.target} under {o.id[:12]} ({revoked[o.module].id[:12]} revoked)"
        for o in applied
        if o.module in replaced
    ]
    changes = {}
    if overrides_now != [o.model_dump(mode="json") for o in precision.overrides]:
        changes["precision.overrides"] = overrides_now
    if recipes_now != [r.model_dump(mode="json") for r in precision.module_recipes]:
        changes["precision.module_recipes"] = recipes_now
    child = derive(
        plan.manifest,
        changes,
        "resume applies approved overrides: " + "; ".join(words),
        source="the overrides ledger",
    )
    plan.manifest = child
    plan.new_revisions.append(child)
    plan.applied_overrides, plan.lifted_overrides = applied, lifted


def _redone_by_policy(override, in_force: dict, step: int, policy) -> bool:
    """An override the auto-degrade policy applied during training after the checkpoint's
    ``step``, which the resumed run's own ``policy`` will apply again: the resumed run meets the
    same alert at the same step and the policy switches the module there, so the resume equals
    the straight run instead of switching it early. Under a policy that would not act on it (none,
    other rules, an earlier until_step), the resume applies it now."""
    return (
        override.policy is not None
        and override.status == "applied"
        and override.applied_step is not None
        and override.applied_step > step
        and override.module not in in_force
        and policy is not None
        and any(policy.acts_on(t.rule, override.applied_step) for t in override.triggers)
    )
