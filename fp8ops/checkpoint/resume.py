"""The resume decision, made before any process group or model exists.

:func:`plan_resume` reads the checkpoint's metadata (one JSON file), works out the manifest
the resumed run will be locked to, and refuses drift:

1. the requested manifest: the checkpoint's own (``fp8ops resume``), or a file
   (``fp8ops train MANIFEST --resume``), with ``--set`` changes on top;
2. drift = its fields, the environment fingerprint, or the FP8 state layout differ from the
   checkpoint's. Refused (:class:`DriftRefused`, exit 4) unless ``accept_drift`` gives a reason:
   the requested content then becomes a new revision whose parent is the checkpoint's
   manifest and whose reason names the reason and the changed fields;
3. approved overrides in the run's ledger become one more revision on top
   (``precision.overrides``), and overrides revoked after they were applied come off. These are
   not drift: they were reviewed in the ledger;
4. a run a Stop alert halted resumes only when something answers the alert: a manifest other
   than the one it stopped under (an override applied or lifted, a manifest change accepted),
   or ``after_stop`` (an operator's reason to go on as it is). Otherwise
   :class:`StopUnanswered` (exit 3): a chain's next job, or a requeue, would train up to the
   same Stop again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.checkpoint.directory import LATEST, CheckpointDir, CheckpointError
from fp8ops.checkpoint.drift import (
    Drift,
    DriftRefused,
    environment_drift,
    manifest_drift,
    refuse,
)
from fp8ops.checkpoint.meta import CheckpointMeta, read_meta
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash
from fp8ops.manifest.canonical import content_dict
from fp8ops.manifest.schema import Manifest


class StopUnanswered(Fp8opsError):
    """A resume of a run a Stop alert halted, with nothing that answers the alert."""

    exit_code = 3  # the Stop's own: the run is still stopped
    collective = True  # every rank raises it; rank 0 says so


@dataclass
class ResumePlan:
    """Everything the trainer needs to continue a run from a checkpoint."""

    run_dir: Path
    checkpoint: Path
    meta: CheckpointMeta
    saved_manifest: Manifest  # what the checkpoint was trained under
    manifest: Manifest  # what the resumed run is locked to
    new_revisions: list[Manifest]  # revisions this resume adds, in order (may be empty)
    drift: Drift
    accepted_reason: str | None
    applied_overrides: list = field(default_factory=list)  # ledger Overrides applied now
    lifted_overrides: list = field(default_factory=list)  # ledger Overrides revoked after use
    fp8_read: str = "own"  # "own": each state group reads its slice; "group0": all read slice 0
    accept_drift: str | None = None  # the operator's reason, for drift found after the plan
    after_stop: str | None = None  # the operator's reason to resume a stopped run as it is
    seen: tuple[str | None, str | None] = (None, None)  # (latest checkpoint, state) when planned

    @property
    def step(self) -> int:
        return self.meta.step


def plan_resume(
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    manifest_path: Path | None = None,
    assignments: dict | None = None,
    accept_drift: str | None = None,
    after_stop: str | None = None,
    environment: dict | None = None,
) -> ResumePlan:
    """Decide how to resume ``run_dir``; raises :class:`DriftRefused` on unaccepted drift and
    :class:`StopUnanswered` for a stopped run that nothing answers."""
    from fp8ops.train.environment import environment_fingerprint

    run_dir = Path(run_dir)
    _check_is_run(run_dir)
    directory = CheckpointDir(run_dir).find(checkpoint)
    meta = read_meta(directory)
    saved = load_manifest(directory / "manifest.yaml")
    if manifest_hash(saved) != meta.manifest:
        raise ManifestError(
            f"{directory / 'manifest.yaml'}: hashes to {manifest_hash(saved)[:12]} but the "
            f"checkpoint was saved under {meta.manifest[:12]}. Either the file was changed (the "
            "checkpoint is damaged), or the checkpoint was written by an fp8ops whose manifest "
            "schema differs from this one's in more than added fields: resume it with the "
            "fp8ops that wrote it"
        )
    _check_run_revisions(run_dir, directory, meta)
    if accept_drift is not None and not accept_drift.strip():
        raise ManifestError(
            "--accept-drift: give the reason the drift is acceptable; it is recorded in the "
            "new revision and the run's events (an empty reason was given)"
        )
    if after_stop is not None and not after_stop.strip():
        raise ManifestError(
            "--after-stop: give the reason the run may go on after its Stop alert; it is "
            "recorded in the run's events (an empty reason was given)"
        )
    requested = saved
    if manifest_path is not None:
        requested = _with_ledger_overrides(load_manifest(manifest_path), saved)
    if assignments:
        requested = derive(requested, assignments, "--set", source="--set")

    drift = Drift(manifest_drift(saved, requested))
    drift.changes += environment_drift(meta.environment, environment or environment_fingerprint())
    fp8_read, fp8_problem = _fp8_mapping(meta, requested)
    problem = fp8_problem or _unloadable(drift) or _store_problem(drift, run_dir)
    if problem:  # no --accept-drift helps: the checkpoint cannot be loaded into that run
        raise DriftRefused(f"refusing to resume from {directory}: {problem}")
    if drift and accept_drift is None:
        raise refuse(drift, str(directory), _hint(run_dir, manifest_path))

    manifest, new = saved, []
    content_changed = any(c.what == "manifest" for c in drift.changes)
    if drift:
        reason = f"resume accepted drift ({drift.summary()}): {accept_drift}"
        if content_changed:
            manifest = _rebase(saved, requested, reason)
            new.append(manifest)
    plan = ResumePlan(
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
        seen=where_the_run_is(run_dir),
    )
    _apply_ledger(plan)
    _check_stop_answered(plan)
    return plan


def _check_stop_answered(plan: ResumePlan) -> None:
    """A run a Stop alert halted goes on only when something answers the alert (module 4.):
    the resumed manifest differs from the one the Stop fired under (an override applied or
    lifted, a manifest change accepted), or ``plan.after_stop`` gives a reason. Accepted drift of
    the environment alone (another node) changes nothing the Stop was about, and an override
    applied again after a rewind to an older checkpoint is what the run stopped under."""
    from fp8ops.train.run_dir import read_status

    status = read_status(plan.run_dir) or {}
    if status.get("state") != "stopped":
        return
    stopped_under = status.get("manifest", manifest_hash(plan.saved_manifest))
    if manifest_hash(plan.manifest) != stopped_under or plan.after_stop is not None:
        return
    alert = status.get("alert") or {}
    what = alert.get("message") or alert.get("rule") or "an alert"
    last = plan.step >= plan.manifest.schedule.train_steps
    would = (
        "write the final weights of a run whose last step stopped"
        if last
        else "train up to the same Stop again"
    )
    raise StopUnanswered(
        f"refusing to resume {plan.run_dir}: a Stop alert halted it at step "
        f"{status.get('step', '?')} ({what}), and the resume would change nothing: no override "
        "to apply or lift, no manifest change. Resumed as it is, it would "
        f"{would}. See `fp8ops alerts {plan.run_dir} --level stop`; then approve an override "
        '(`fp8ops overrides`), change the manifest (--set ... --accept-drift "why"), or go on '
        'as it is: --after-stop "why"'
    )


def where_the_run_is(run_dir: Path) -> tuple[str | None, str | None]:
    """(the latest checkpoint's name, the status's state): what a resume planned from."""
    from fp8ops.train.run_dir import read_status

    store = CheckpointDir(run_dir)
    try:
        latest = store.latest()
        name = latest.name if latest else None
    except CheckpointError:  # `latest` names what is not there (resumed with --checkpoint)
        name = (store.path / LATEST).read_text(errors="replace").strip()
    return name, (read_status(run_dir) or {}).get("state")


def check_not_moved_on(plan: ResumePlan) -> None:
    """Refuse a resume whose run moved on while it loaded: another job on the same run directory
    (a resubmission beside a requeued attempt) saved checkpoints or finished the run. Taking the
    run lock only after loading, this resume would otherwise rewind that work. Called on every
    rank after loading, before the lock: every rank reads the same files and refuses alike."""
    now = where_the_run_is(plan.run_dir)
    if now != plan.seen:
        raise DriftRefused(
            f"refusing to resume {plan.run_dir}: it moved on while this resume loaded "
            f"{plan.checkpoint.name} (latest checkpoint {plan.seen[0]} -> {now[0]}, status "
            f"{plan.seen[1]} -> {now[1]}): another job trains or trained it. Resume again to "
            "continue from where it is now (or stop the other job first)"
        )


def _check_is_run(run_dir: Path) -> None:
    """A directory to resume, not a typo; and a run stopped before its first checkpoint says
    how to start it over."""
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise CheckpointError(f"{run_dir} {what}: give the run directory to resume")
    from fp8ops.train.run_dir import read_status

    status = read_status(run_dir)
    if not CheckpointDir(run_dir).complete() and status is not None:
        if status.get("state") == "completed":
            raise CheckpointError(
                f"{run_dir} is a completed run whose checkpoints are gone: nothing to resume. "
                f"Its weights are in {run_dir / 'final'}; to train on, start a new run from them"
            )
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from: the run stopped before its first one. "
            f"Start it over with `fp8ops train MANIFEST --resume --run-dir {run_dir}` (the "
            "unfinished attempt is kept in its attempts/ folder)"
        )


def _check_run_revisions(run_dir: Path, directory: Path, meta: CheckpointMeta) -> None:
    """The checkpoint was saved under one of the run's own revisions, and the run's copies of
    its revision chain still hash to their names. Checked here, before anything is trained: a
    checkpoint copied in from another run would otherwise train on under that run's manifest,
    and an edited revision would be found only at the next save, losing the steps since."""
    store = ManifestStore(run_dir / "manifests")
    if not store.path_for(meta.manifest).exists():
        raise ManifestError(
            f"{directory}: saved under manifest {meta.manifest[:12]}, which is not one of this "
            f"run's revisions ({store.directory}): the checkpoint belongs to another run. Resume "
            "it in its own run directory, or start a new run from its weights"
        )
    for digest in meta.revisions:
        if store.path_for(digest).exists():
            store.get(digest)  # raises RevisionError, naming the file, if it was edited


# Changes a checkpoint cannot be loaded into, accepted or not: other tensor shapes, another data
# order, FP8 state that was never saved.
_ARCHITECTURE = "model."
_NOT_ARCHITECTURE = ("model.init_checkpoint", "model.fingerprint")
_UNLOADABLE = {  # path prefix -> what changing it would do
    "seeds.data": "the data order mid-run (the sampler's position means nothing in another order)",
    "data.": "the training set mid-run (the sampler's position means nothing in another set)",
    "tokenizer.": "what the token ids the model learned mean",
    "precision.enabled": "FP8 on or off: a checkpoint of a BF16 run holds no FP8 state to "
    "resume with",
}


def _unloadable(drift: Drift) -> str | None:
    for change in drift.changes:
        if change.what != "manifest":
            continue
        path = change.path
        if path == "precision.enabled" and change.new is False:
            continue  # FP8 off: the saved FP8 state is simply not used
        if path == "data.pad_to":
            continue  # how far batches are padded: the same rows, in the same order
        if path.startswith(_ARCHITECTURE) and not path.startswith(_NOT_ARCHITECTURE):
            return (
                f"{path} changed ({change.old!r} -> {change.new!r}): the checkpoint's weights "
                "and optimizer state have this model's shapes; start a new run from its weights "
                "instead (model.init_checkpoint)"
            )
        for prefix, what in _UNLOADABLE.items():
            if path.startswith(prefix):
                return (
                    f"{path} changed ({change.old!r} -> {change.new!r}): it would change {what}; "
                    "start a new run instead"
                )
    return None


def _store_problem(drift: Drift, run_dir: Path) -> str | None:
    """The telemetry store writes blocks of the size its arrays were made with: a changed
    ``telemetry.flush_steps`` cannot apply to it (accepted, it would be recorded but not done)."""
    store = run_dir / "telemetry.zarr"
    for change in drift.changes:
        if change.what == "manifest" and change.path == "telemetry.flush_steps" and store.exists():
            return (
                f"telemetry.flush_steps changed ({change.old!r} -> {change.new!r}), but {store} "
                f"writes blocks of {change.old} steps, the size its arrays were made with; keep "
                "it, or move the store aside (a new one is then made with the new size)"
            )
    return None


def _with_ledger_overrides(requested: Manifest, saved: Manifest) -> Manifest:
    """``requested`` with the overrides the checkpoint's run applied from its ledger.

    A manifest file (``train MANIFEST --resume``, every SLURM requeue) never lists them: a resume
    wrote them into the run's own revision, reviewed in the ledger, so they are not drift.
    """
    ledger_backed = [o for o in saved.precision.overrides if o.approval is not None]
    own = [o for o in requested.precision.overrides if o.approval is None]
    # In the saved list's order (manifests compare lists as written; their order means nothing),
    # the file's own overrides the checkpoint does not hold after them.
    order = {o: i for i, o in enumerate(saved.precision.overrides)}
    merged = sorted(ledger_backed + own, key=lambda o: order.get(o, len(order)))
    if not ledger_backed or requested.precision.overrides == tuple(merged):
        return requested
    changes = {"precision.overrides": [o.model_dump(mode="json") for o in merged]}
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


def _fp8_mapping(meta: CheckpointMeta, requested: Manifest) -> tuple[str, str | None]:
    """How the saved FP8 state groups map onto the requested topology: ("own" | "group0",
    None), or (_, why it cannot be mapped)."""
    fp8 = meta.fp8
    if fp8.layout == "none" or not requested.precision.enabled:
        return "own", None
    if fp8.history_len != requested.precision.amax_history_len:
        return "own", (
            f"precision.amax_history_len is {requested.precision.amax_history_len} but the "
            f"checkpoint's histories hold {fp8.history_len} steps; keep the saved length"
        )
    topology, precision = requested.topology, requested.precision
    if not precision.reduce_amax:
        layout, groups = "per_rank", topology.world_size
    elif topology.amax_reduction == "tp_cp" and topology.data_parallel > 1:
        layout, groups = "per_dp_replica", topology.data_parallel
    else:
        layout, groups = "shared", 1
    same = (
        layout == fp8.layout
        and groups == fp8.groups
        and topology.tensor_parallel == meta.topology.tensor_parallel
    )
    if same:
        return "own", None
    # Another layout: well defined only if every saved group holds the same state.
    differing = [m for m, digests in fp8.digests.items() if len(set(digests)) > 1]
    if not differing:
        return "group0", None
    return "own", (
        f"the checkpoint holds {fp8.groups} different FP8 states ({fp8.layout}: amaxes were not "
        f"reduced across those ranks; e.g. {differing[0]}), so which rank's scales a rank of "
        f"the new topology (tensor_parallel {topology.tensor_parallel}, data_parallel "
        f"{topology.data_parallel}) should take is not defined; resume at the saved topology "
        f"(tensor_parallel {meta.topology.tensor_parallel}, data_parallel "
        f"{meta.topology.data_parallel})"
    )


def _apply_ledger(plan: ResumePlan) -> None:
    """Make the manifest's ledger-backed overrides what the ledger says now: approved and
    applied ones on, revoked ones off, as one more revision (none if they already agree).

    Compared with the checkpoint's manifest, not with the ledger's own "applied" records: a
    resume from an older checkpoint (or a crash before the first checkpoint after a resume)
    must apply them again.
    """
    from fp8ops.overrides import Ledger, LedgerError

    ledger = Ledger(plan.run_dir)
    in_force = {o.module: o for o in plan.manifest.precision.overrides if o.approval is not None}
    if not ledger.path.exists() and not in_force:
        return
    overrides = ledger.overrides() if ledger.path.exists() else {}
    approvals = {o.approval: o for o in overrides.values() if o.approval is not None}
    for override in in_force.values():
        if override.approval not in approvals:
            lost = (
                "is gone"
                if not ledger.path.exists()
                else ("no longer holds it: its last records were removed")
            )
            raise LedgerError(
                f"{ledger.path}: the checkpoint's manifest runs {override.module} in BF16 under "
                f"approval {override.approval[:12]}, but the ledger {lost}. Restore the file "
                "from a backup before resuming."
            )
    wanted = {o.module: o for o in overrides.values() if o.status in ("approved", "applied")}
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
    keep = [
        o
        for o in plan.manifest.precision.overrides
        if o.module not in {lift.module for lift in lifted}
    ]
    overrides_now = [o.model_dump(mode="json") for o in keep]
    overrides_now += [o.as_manifest_override().model_dump(mode="json") for o in applied]
    revoked = {o.module: o for o in lifted}
    replaced = revoked.keys() & {o.module for o in applied}
    words = [f"{o.module} to bf16 ({o.id[:12]})" for o in applied if o.module not in replaced]
    words += [
        f"{o.module} back to fp8 ({o.id[:12]} revoked)" for o in lifted if o.module not in replaced
    ]
    words += [
        f"{o.module} stays bf16 under {o.id[:12]} ({revoked[o.module].id[:12]} revoked)"
        for o in applied
        if o.module in replaced
    ]
    child = derive(
        plan.manifest,
        {"precision.overrides": overrides_now},
        "resume applies approved overrides: " + "; ".join(words),
        source="the overrides ledger",
    )
    plan.manifest = child
    plan.new_revisions.append(child)
    plan.applied_overrides, plan.lifted_overrides = applied, lifted


def _hint(run_dir: Path, manifest_path: Path | None) -> str:
    how = (
        f"fp8ops train {manifest_path} --resume --run-dir {run_dir}"
        if manifest_path is not None
        else f"fp8ops resume {run_dir}"
    )
    return (
        "Resume with the checkpoint's own manifest and environment, or accept the drift as a new "
        f'manifest revision: {how} --accept-drift "why this change is safe"'
    )
