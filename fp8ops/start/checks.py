"""Every check a run's start rests on, each failing closed: what it cannot verify, it refuses.

In the order a start meets them:

* the directory: :func:`nothing_to_train` (a rerun after the end: the plan is ``Complete``),
  :func:`check_free` (a new run never writes into another run's directory),
  :func:`check_unedited` (``manifest.yaml`` is still a stored revision);
* the request: :func:`check_stop_at`, :func:`check_inputs` (tokenizer, dtype, topology, base,
  the metric sinks' libraries and the webhooks' URLs: :func:`reporting_ready`);
* the resume, from the checkpoint's metadata: :func:`check_is_run`,
  :func:`check_saved_manifest`, :func:`check_run_revisions`, :func:`check_reasons`,
  :func:`check_drift` (manifest and environment drift, FP8 state mapping, changes no
  checkpoint can be loaded into), :func:`check_stop_answered`;
* as the ranks build the inputs: :func:`check_same_tokenizer`, :func:`check_same_data` (against
  ``run.json``), :func:`check_admission` (the per-layer table against the checkpoint's);
* after loading: :func:`check_not_moved_on` (nobody trained the run meanwhile).

A run another live process trains is refused before a resume reads its checkpoint
(:func:`check_not_trained_now`), and a checkpoint that fails to read while one does, or after one
moved the run on, is blamed on that process and not called damaged (:func:`reading_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fp8ops.checkpoint.directory import LATEST, CheckpointDir, CheckpointError
from fp8ops.checkpoint.meta import CheckpointMeta
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.manifest import ManifestStore, load_manifest, manifest_hash
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunLayout, RunRecordError, find_status, read_run_record
from fp8ops.run.layout import MANIFEST
from fp8ops.run.records import read_layers_json
from fp8ops.run.run_dir import lock_holder, trained_elsewhere
from fp8ops.start.drift import Change, Drift, DriftRefused, manifest_drift, refuse
from fp8ops.start.plans import Resume


class StopUnanswered(Fp8opsError):
    """A resume of a run a Stop alert halted, with nothing that answers the alert."""

    exit_code = 3  # the Stop's own: the run is still stopped
    collective = True  # every rank raises it; rank 0 says so


# -- the directory -------------------------------------------------------------------------------


def finished(run_dir: Path) -> bool:
    """The run wrote its final weights and said so (the last thing a run does)."""
    status = find_status(run_dir) if Path(run_dir).is_dir() else None
    return status is not None and status.state == "completed" and RunLayout(run_dir).finished()


def nothing_to_train(run_dir: Path) -> str | None:
    """Why there is nothing to train, for a finished run rerun with one of its own revisions (a
    SLURM requeue or a chain's next link after the end); None otherwise. Said before the drift
    check, so a rerun on a node with another environment succeeds. Another manifest still goes
    through the drift check: a file edited in place for the next experiment is refused with its
    diff, not taken as done."""
    if not Path(run_dir).is_dir() or not finished(run_dir):  # not a run: plan_resume says what
        return None
    return (
        f"{run_dir} completed at step {find_status(run_dir).step}: nothing to train (the "
        "environment is not compared: nothing runs). To train longer, raise "
        'schedule.train_steps (--set schedule.train_steps=N --accept-drift "why")'
    )


def check_not_imported(run_dir: Path) -> None:
    """A run imported from another tool's logs (``fp8ops import-te-debug``) holds no checkpoint,
    manifest or data of fp8ops': nothing continues it, and a new run must not be trained over
    it (``train --resume`` would otherwise take the directory for an unfinished attempt)."""
    status = find_status(run_dir) if Path(run_dir).is_dir() else None
    if status is not None and status.state == "imported":
        raise Fp8opsError(
            f"{run_dir} holds a run imported from another tool's logs ({status.reason}); "
            "fp8ops cannot train or resume it: choose a new --run-dir"
        )


def check_free(path: Path, manifest: Manifest) -> str | None:
    """Refuse a directory that holds another run (on every rank, before anything is written).

    A completed run of this same manifest returns why there is nothing to do (rerunning a
    finished command is not an error); anything else already there is refused, since writing
    into it would mix two runs' records.
    """
    path, layout = Path(path), RunLayout(path)
    if not path.exists():
        return None
    if not path.is_dir():
        raise Fp8opsError(f"--run-dir {str(path)!r} is a file, not a directory")
    leftovers = (layout.attempts, layout.stop_request)
    if not any(p not in leftovers for p in path.iterdir()):
        return None
    status = find_status(path)
    digest = manifest_hash(manifest)
    # The run's own manifest, or one of its revisions (it may have ended under a later one:
    # overrides applied, drift accepted): rerunning the command that started it.
    ended_under = status.manifest if status is not None else None
    own = digest in _revisions_run(path, ended_under)
    if status is not None and status.state == "completed" and own:
        later = "" if ended_under == digest else f"; it ended under revision {ended_under[:12]}"
        return (
            f"{path} already holds a completed run of this manifest (sha256 {digest[:12]}"
            f"{later}); nothing to do. Its results are in that directory."
        )
    holder = lock_holder(path)
    if holder is not None:
        raise Fp8opsError(f"--run-dir: {trained_elsewhere(path, holder)}, or choose a new one")
    if status is None:
        raise Fp8opsError(
            f"--run-dir {str(path)!r} holds files that are not an fp8ops run; choose a new "
            "--run-dir (fp8ops never writes over existing files)"
        )
    resumable = (layout.checkpoints / LATEST).exists()
    if resumable and status.state in ("paused", "interrupted", "failed", "stopped", "running"):
        raise Fp8opsError(
            f"--run-dir {str(path)!r} holds a {status.state} run with checkpoints; "
            f"continue it with `fp8ops resume {path}` (or `fp8ops train MANIFEST --resume "
            f"--run-dir {path}`), or choose a new --run-dir"
        )
    advice = {
        "completed": "choose a new --run-dir (fp8ops never writes over a run)",
        "failed": "read its events.jsonl, then remove the directory to start over, or choose "
        "a new --run-dir",
        "running": "if no fp8ops process is using it, it was interrupted: remove the "
        "directory to start over, or choose a new --run-dir",
    }.get(status.state, "choose a new --run-dir")
    raise Fp8opsError(
        f"--run-dir {str(path)!r} already holds a {status.state} run of manifest "
        f"{str(status.manifest)[:12]}; {advice}"
    )


def _revisions_run(path: Path, ended_under: str | None) -> set[str]:
    """The revisions a run trained under: from the one it ended under back through each
    parent to the one it started with (``run.json``). Not the parents of that one: a manifest
    given with ``--set`` is stored with the run, but never trained."""
    try:  # a damaged record names no start: the walk then goes back as far as the run holds
        started = read_run_record(path).manifest
    except RunRecordError:
        started = None
    layout = RunLayout(path)
    store, found, digest = ManifestStore(layout.manifests), set(), ended_under
    while digest and digest not in found:
        found.add(digest)
        if digest == started or not store.path_for(digest).exists():
            break
        digest = store.get(digest).revision.parent
    return found


def check_unedited(path: Path) -> None:
    """Before a resume: ``manifest.yaml`` is still one of the run's stored revisions. A resume
    runs its checkpoint's revision and writes that back to the file, so an edit there would be
    dropped without a word; it is refused (exit 4), with the fields it changed."""
    layout = RunLayout(path)
    file, store = layout.manifest, ManifestStore(layout.manifests)
    if not file.is_file() or not store.directory.is_dir():  # nothing to hold it to
        return
    status = find_status(path)
    locked = status.manifest if status is not None else None
    known = locked is not None and store.path_for(locked).exists()
    restore = f"cp {store.path_for(locked)} {file}" if known else "restore it from a copy"
    try:
        manifest = load_manifest(file)
    except ManifestError as exc:
        raise DriftRefused(
            f"refusing to resume: {file} was edited after the run wrote it and no longer "
            f"loads ({exc}); restore it: {restore}"
        ) from None
    if store.path_for(manifest_hash(manifest)).exists():
        return
    changes = manifest_drift(store.get(locked), manifest) if known else []
    listed = "".join(f"\n{change.line()}" for change in changes)
    raise DriftRefused(
        f"refusing to resume: {file} was edited after the run wrote it{':' if listed else ''}"
        f"{listed}\nA resume runs its checkpoint's revision and would write over the edit. "
        f"Restore the file ({restore}), then resume; to change the run, add --set FIELD=VALUE "
        f"--accept-drift REASON (a new revision), or resume with the edited file as the "
        f"manifest: fp8ops train {file} --run-dir {Path(path)} --resume --accept-drift REASON"
    )


# -- the request ---------------------------------------------------------------------------------


def check_stop_at(stop_at: int | None, start: int, steps: int) -> None:
    if stop_at is not None and not start < stop_at < steps:
        raise Fp8opsError(
            f"--stop-at {stop_at}: the run is at step {start} of {steps}; give a step after "
            f"{start} and before {steps} (the last step is always checkpointed)"
        )


def check_inputs(manifest: Manifest, source: str, *, resuming: bool) -> None:
    """What can be checked before any process group or model exists."""
    # Imported here: the tokenizer library, and torch for the weights' module, are not needed
    # by a resume refused for drift, which answers in well under two seconds.
    from fp8ops.data.tokenizer import tokenizer_for

    try:
        tokenizer_for(manifest.tokenizer)  # its file, library and end-of-document token
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    reporting_ready(manifest, source)
    if manifest.precision.base_dtype == "fp16":
        # fp16's range ends near 6e-8: small gradients flush to zero unless the loss is scaled,
        # and nothing would show it. bf16 keeps float32's range; it is what FP8 recipes use.
        raise ManifestError(
            f"{source}: precision.base_dtype is fp16, but fp8ops trains without loss scaling, "
            "which fp16 gradients need; use bf16 (or fp32)"
        )
    if manifest.model.init_checkpoint is not None and not resuming:
        from fp8ops.checkpoint.weights import read_base_meta

        read_base_meta(
            Path(manifest.model.init_checkpoint),
            manifest.model,
            field=f"{source}: model.init_checkpoint",
            fingerprint=False,
        )


def reporting_ready(manifest: Manifest, source: str) -> None:
    """The metric sinks' libraries are installed and the webhooks' URLs are in the environment:
    a run must not train for hours before anyone finds its W&B run or its alerts missing."""
    from fp8ops.notify import check_environment
    from fp8ops.sinks import check_libraries

    try:
        check_libraries(manifest.logging)
        check_environment(manifest.notifications)
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None


# -- the resume, from the checkpoint's metadata --------------------------------------------------


def check_is_run(run_dir: Path) -> None:
    """A directory to resume, not a typo; and a run stopped before its first checkpoint says
    how to start it over."""
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise CheckpointError(f"{run_dir} {what}: give the run directory to resume")
    status = find_status(run_dir)
    if not CheckpointDir(run_dir).complete() and status is not None:
        if status.state == "completed":
            raise CheckpointError(
                f"{run_dir} is a completed run whose checkpoints are gone: nothing to resume. "
                f"Its weights are in {RunLayout(run_dir).final}; to train on, start a new run "
                "from them"
            )
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from: the run stopped before its first one. "
            f"Start it over with `fp8ops train MANIFEST --resume --run-dir {run_dir}` (the "
            "unfinished attempt is kept in its attempts/ folder)"
        )


def check_saved_manifest(directory: Path, saved: Manifest, meta: CheckpointMeta) -> None:
    """The checkpoint's ``manifest.yaml`` is the revision its metadata names."""
    if manifest_hash(saved) != meta.manifest:
        raise ManifestError(
            f"{directory / MANIFEST}: hashes to {manifest_hash(saved)[:12]} but the "
            f"checkpoint was saved under {meta.manifest[:12]}. Either the file was changed (the "
            "checkpoint is damaged), or the checkpoint was written by an fp8ops whose manifest "
            "schema differs from this one's in more than added fields: resume it with the "
            "fp8ops that wrote it"
        )


def check_run_revisions(run_dir: Path, directory: Path, meta: CheckpointMeta) -> None:
    """The checkpoint was saved under one of the run's own revisions, and the run's copies of
    its revision chain still hash to their names. Checked here, before anything is trained: a
    checkpoint copied in from another run would otherwise train on under that run's manifest,
    and an edited revision would be found only at the next save, losing the steps since."""
    store = ManifestStore(RunLayout(run_dir).manifests)
    if not store.path_for(meta.manifest).exists():
        raise ManifestError(
            f"{directory}: saved under manifest {meta.manifest[:12]}, which is not one of this "
            f"run's revisions ({store.directory}): the checkpoint belongs to another run. Resume "
            "it in its own run directory, or start a new run from its weights"
        )
    for digest in meta.revisions:
        if store.path_for(digest).exists():
            store.get(digest)  # raises RevisionError, naming the file, if it was edited


def check_reasons(accept_drift: str | None, after_stop: str | None) -> None:
    """An operator's reason is recorded: an empty one says nothing."""
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


def check_drift(
    drift: Drift,
    meta: CheckpointMeta,
    requested: Manifest,
    run_dir: Path,
    directory: Path,
    manifest_path: Path | None,
    accept_drift: str | None,
) -> str:
    """Refuse what the checkpoint cannot be loaded into (accepted or not), then unaccepted
    drift. Returns how the saved FP8 state groups map onto the requested topology."""
    fp8_read, fp8_problem = _fp8_mapping(meta, requested)
    problem = fp8_problem or _unloadable(drift) or _store_problem(drift, run_dir)
    if problem:  # no --accept-drift helps: the checkpoint cannot be loaded into that run
        raise DriftRefused(f"refusing to resume from {directory}: {problem}")
    if drift and accept_drift is None:
        raise refuse(drift, str(directory), _hint(run_dir, manifest_path))
    return fp8_read


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
        if path == "precision.scaling" and change.new == "delayed":
            return (
                f"precision.scaling changed ({change.old!r} -> 'delayed'): the checkpoint of a "
                "stateless recipe holds no amax history for delayed scaling to start from; start "
                "a new run from its weights instead (model.init_checkpoint)"
            )
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
    store = RunLayout(run_dir).telemetry
    for change in drift.changes:
        if change.what == "manifest" and change.path == "telemetry.flush_steps" and store.exists():
            return (
                f"telemetry.flush_steps changed ({change.old!r} -> {change.new!r}), but {store} "
                f"writes blocks of {change.old} steps, the size its arrays were made with; keep "
                "it, or move the store aside (a new one is then made with the new size)"
            )
    return None


def check_fp8_state_saved(plan: Resume) -> None:
    """After the ledger's overrides are applied (a revoked current-scaling override comes off
    there): every module the resumed manifest runs under delayed scaling has saved state."""
    problem = _fp8_state_missing(plan.meta, plan.manifest, plan.run_dir)
    if problem:
        raise DriftRefused(f"refusing to resume from {plan.checkpoint}: {problem}")


def _fp8_state_missing(meta: CheckpointMeta, requested: Manifest, run_dir: Path) -> str | None:
    """A module that resumes under delayed scaling needs its amax history from the checkpoint:
    one that ran a per-module stateless recipe (``precision.module_recipes``) when it was saved
    has none, so moving it back to delayed scaling cannot continue this run."""
    precision = requested.precision
    if meta.fp8.layout == "none" or not precision.enabled or precision.scaling != "delayed":
        return None
    from fp8ops.admission import module_recipe

    saved = set(meta.fp8.modules)
    projections = {"qkv", "proj", "fc1", "fc2"}
    missing = [
        row.fqn
        for row in read_layers_json(run_dir).rows
        if row.kind in projections
        and row.reason.code != "not_fp8_capable"
        and module_recipe(precision, row.fqn) is None
        and row.fqn not in saved
    ]
    if not missing:
        return None
    more = f" and {len(missing) - 3} more" if missing[3:] else ""
    return (
        f"{', '.join(missing[:3])}{more} would run delayed scaling, but the checkpoint holds no "
        "amax history for them (they ran a per-module stateless recipe, "
        "precision.module_recipes, when it was saved); keep their module_recipes entry, or "
        "start a new run from its weights (model.init_checkpoint)"
    )


def _fp8_mapping(meta: CheckpointMeta, requested: Manifest) -> tuple[str, str | None]:
    """How the saved FP8 state groups map onto the requested topology: ("own" | "group0",
    None), or (_, why it cannot be mapped)."""
    fp8 = meta.fp8
    stateless = requested.precision.scaling != "delayed"  # keeps no FP8 state: nothing to map
    if fp8.layout == "none" or not requested.precision.enabled or stateless:
        return "own", None
    if fp8.history_len != requested.precision.amax_history_len:
        return "own", (
            f"precision.amax_history_len is {requested.precision.amax_history_len} but the "
            f"checkpoint's histories hold {fp8.history_len} steps; keep the saved length"
        )
    topology, precision = requested.topology, requested.precision
    if not precision.reduce_amax:
        layout, groups = "per_rank", topology.stage_ranks
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


def check_stop_answered(plan: Resume) -> None:
    """A run a Stop alert halted goes on only when something answers the alert: the resumed
    manifest differs from the one the Stop fired under (an override applied or lifted, a
    manifest change accepted), or ``plan.after_stop`` gives a reason. Accepted drift of the
    environment alone (another node) changes nothing the Stop was about, and an override
    applied again after a rewind to an older checkpoint is what the run stopped under."""
    status = find_status(plan.run_dir)
    if status is None or status.state != "stopped":
        return
    stopped_under = status.manifest or manifest_hash(plan.saved_manifest)
    if manifest_hash(plan.manifest) != stopped_under or plan.after_stop is not None:
        return
    alert = status.alert or {}
    what = alert.get("message") or alert.get("rule") or "an alert"
    last = plan.step >= plan.manifest.schedule.train_steps
    would = (
        "write the final weights of a run whose last step stopped"
        if last
        else "train up to the same Stop again"
    )
    step = "?" if status.step is None else status.step
    raise StopUnanswered(
        f"refusing to resume {plan.run_dir}: a Stop alert halted it at step "
        f"{step} ({what}), and the resume would change nothing: no override "
        "to apply or lift, no manifest change. Resumed as it is, it would "
        f"{would}. See `fp8ops alerts {plan.run_dir} --level stop`; then approve an override "
        '(`fp8ops overrides`), change the manifest (--set ... --accept-drift "why"), or go on '
        'as it is: --after-stop "why"'
    )


# -- after the ranks built the inputs ------------------------------------------------------------


def check_same_tokenizer(plan: Resume, tokenizer) -> None:
    """A resume encodes and decodes with the tokenizer the run started with. Its manifest
    section is locked, but the file it names can be edited: compared with ``run.json`` before
    the data is built with it, so a refusal names the tokenizer and not what it changed
    downstream. A ``run.json`` that cannot say is a refusal too."""
    record = _run_record_for(plan, "the tokenizer")
    recorded = record.tokenizer.fingerprint if record.tokenizer is not None else None
    if recorded is None:
        raise DriftRefused(
            f"refusing to resume from {plan.checkpoint}: {RunLayout(plan.run_dir).run_record} "
            "records no tokenizer fingerprint, so the tokenizer cannot be checked against the "
            f"one the run started with. Restore the run's run.json{_from_these_weights(plan)}"
        )
    now = tokenizer.fingerprint()
    if recorded == now:
        return
    what = (
        f"tokenizer.path {plan.manifest.tokenizer.path} (its bytes or the end-of-document token "
        f"{tokenizer.eod_token!r})"
        if tokenizer.kind != "byte"
        else "fp8ops' byte tokenizer (another fp8ops version)"
    )
    raise DriftRefused(
        f"refusing to resume from {plan.checkpoint}: {what} changed since the run started "
        f"(run.json records tokenizer fingerprint {recorded[:12]}, it now hashes to {now[:12]}); "
        "the data and the capability answers would be encoded and decoded otherwise than the "
        "checkpoint was trained on. Restore the tokenizer the run started with, or train with "
        f"the new one in a new run (another --run-dir){_from_these_weights(plan)}"
    )


def check_same_data(plan: Resume, data) -> None:
    """A resume reads the data the run started on: the sampler's position means nothing in
    other data. ``data.fingerprint: null`` checks nothing when a run starts, so the data are
    compared with what the run recorded in ``run.json`` (which must say)."""
    recorded = _run_record_for(plan, "the data").data
    if recorded is None or recorded.fingerprint is None:
        raise DriftRefused(
            f"refusing to resume from {plan.checkpoint}: {RunLayout(plan.run_dir).run_record} "
            "records no data fingerprint, so the data cannot be checked against what the run "
            f"started on. Restore the run's run.json{_from_these_weights(plan)}"
        )
    if recorded.fingerprint == data.fingerprint:
        return
    # What the record says the data came from, against now: the file's sha256, the corpus.
    before, after = recorded.source or {}, data.source
    changed = [
        f"{key} {str(before.get(key))[:12]} -> {str(after.get(key))[:12]}"
        for key in sorted(before.keys() | after.keys())
        if key != "path" and before.get(key) != after.get(key)
    ]
    origin = f"data.path {after['path']}" if "path" in after else f"data.kind {data.kind}"
    hashes = (
        f"run.json records data fingerprint {recorded.fingerprint[:12]}, the data now "
        f"hash to {data.fingerprint[:12]}"
    )
    raise DriftRefused(
        f"refusing to resume from {plan.checkpoint}: the training data changed since the run "
        f"started ({origin}: {'; '.join([*changed, hashes])}), and the sampler's position means "
        "nothing in other data. Restore the data the run started on, or train on the new data "
        f"in a new run (another --run-dir){_from_these_weights(plan)}"
    )


def _run_record_for(plan: Resume, what: str):
    try:
        return read_run_record(plan.run_dir)
    except RunRecordError as exc:
        raise DriftRefused(
            f"refusing to resume from {plan.checkpoint}: {exc}; {what} the run started with "
            f"cannot be checked without it. Restore the run's run.json"
            f"{_from_these_weights(plan)}"
        ) from None


def _from_these_weights(plan: Resume) -> str:
    return (
        f", from this checkpoint's weights if you want them: fp8ops checkpoints export "
        f"{plan.run_dir} --checkpoint {plan.step} --out DIR, then model.init_checkpoint: "
        "DIR"
    )


def check_admission(plan: Resume, found: str | None) -> None:
    """The per-layer decisions (``found``: the table's hash) must be the checkpoint's unless
    the manifest changed; an accepted drift records the change in the plan."""
    if found == plan.meta.admission or plan.new_revisions:
        return
    change = Change("admission", "layers.json table", plan.meta.admission, found)
    if plan.accept_drift is not None:
        plan.drift.changes.append(change)  # recorded in the resumed event
        plan.accepted_reason = plan.accept_drift
        return
    raise refuse(
        Drift([change]),
        str(plan.checkpoint),
        "The manifest is unchanged, so the admission rules themselves changed (another "
        "fp8ops version?); compare with `fp8ops inspect RUN_DIR --layers`, then accept the "
        'change with --accept-drift "reason"',
    )


# -- after loading -------------------------------------------------------------------------------


def where_the_run_is(run_dir: Path) -> tuple[str | None, str | None]:
    """(the latest checkpoint's name, the status's state): what a resume planned from."""
    store = CheckpointDir(run_dir)
    try:
        latest = store.latest()
        name = latest.name if latest else None
    except CheckpointError:  # `latest` names what is not there (resumed with --checkpoint)
        name = (store.path / LATEST).read_text(errors="replace").strip()
    status = find_status(run_dir)
    return name, status.state if status is not None else None


def check_not_moved_on(plan: Resume) -> None:
    """Refuse a resume whose run moved on while it loaded: another job on the same run directory
    (a resubmission beside a requeued attempt) saved checkpoints or finished the run. Taking the
    run lock only after loading, this resume would otherwise rewind that work. Called on every
    rank after loading, before the lock: every rank reads the same files and refuses alike."""
    _check_not_moved(plan.run_dir, plan.seen, f"loaded {plan.checkpoint.name}")


def _check_not_moved(run_dir: Path, seen: tuple, doing: str) -> None:
    now = where_the_run_is(run_dir)
    if now != seen:
        raise DriftRefused(
            f"refusing to resume {run_dir}: it moved on while this resume {doing} (latest "
            f"checkpoint {seen[0]} -> {now[0]}, status {seen[1]} -> {now[1]}): another job "
            "trains or trained it. Resume again to continue from where it is now (or stop the "
            "other job first)"
        )


def check_not_trained_now(run_dir: Path, *, reading: Path | None = None) -> None:
    """Refuse to resume a run that another live process trains (it holds ``run.lock``), before
    anything is read: that process saves checkpoints, moves ``latest`` and deletes old ones
    (``schedule.keep_checkpoints``) while this one would read them. Exit 2, as the lock's own
    refusal (``RunDir.reopen``) and a new run's (:func:`check_free`)."""
    holder = lock_holder(run_dir)
    if holder is None:
        return
    during = f" (it replaced or removed {reading.name} as this resume read it)" if reading else ""
    raise Fp8opsError(
        f"refusing to resume: {trained_elsewhere(run_dir, holder)}{during}; then resume"
    )


@contextmanager
def reading_checkpoint(
    run_dir: Path, seen: tuple, checkpoint: Path | None = None
) -> Iterator[None]:
    """Around reading a run's checkpoint (planning a resume, loading it): a failure there while
    another process trains the run, or after one moved it on since ``seen``
    (:func:`where_the_run_is` before reading), is that process's doing (a checkpoint it rotated
    away mid-read), said as such; any other failure stands (a damaged checkpoint says so). The
    lock is taken only after loading (``RunDir.reopen``), so a resume that started beside a
    live run gets here."""
    try:
        yield
    except Exception:
        check_not_trained_now(run_dir, reading=checkpoint)
        _check_not_moved(run_dir, seen, f"read {checkpoint.name if checkpoint else 'it'}")
        raise
