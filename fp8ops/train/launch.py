"""``fp8ops train`` and ``fp8ops resume`` as functions: load and check the manifest (or plan the
resume), start the ranks, run a :class:`~fp8ops.train.trainer.Trainer`, shut down.

Reading order: :func:`run_training` (a new run, or ``--resume``), :func:`resume_training`
(``fp8ops resume``), then :func:`_run`, which both end in.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash
from fp8ops.manifest.schema import Manifest
from fp8ops.train.run_dir import RunAlreadyComplete, RunDir, check_unedited, read_status

# torch, Megatron and the trainer are imported inside _run: a resume that is refused for drift
# (fp8ops.checkpoint.plan_resume, from one JSON file) answers in well under two seconds, before
# any of them loads.
if TYPE_CHECKING:
    from fp8ops.train.trainer import TrainResult


def run_training(
    manifest_path: Path,
    run_dir: Path,
    *,
    assignments: dict | None = None,
    progress: bool = True,
    resume: bool = False,
    accept_drift: str | None = None,
    after_stop: str | None = None,
    stop_at: int | None = None,
) -> TrainResult:
    """Everything ``fp8ops train`` does. ``assignments`` (``--set``) derive a new revision of
    the manifest first; the run is locked to that revision. ``resume``: continue ``run_dir``
    from its latest checkpoint if it has one (locked: see :mod:`fp8ops.checkpoint.resume`),
    start it otherwise; ``after_stop``: the reason a run a Stop alert halted may go on as it is.
    ``stop_at``: checkpoint after that step and stop (resumable)."""
    from fp8ops.checkpoint import CheckpointDir, plan_resume

    if resume and accept_drift is None:
        requested = _locked_manifest(Path(manifest_path), assignments or {})[0]
        if ManifestStore(Path(run_dir) / "manifests").path_for(manifest_hash(requested)).exists():
            _refuse_if_complete(Path(run_dir))  # the run's own manifest: a rerun after the end
    if resume and CheckpointDir(run_dir).complete():
        if Path(manifest_path).resolve() != (Path(run_dir) / "manifest.yaml").resolve():
            check_unedited(Path(run_dir))  # else the edit is the request, diffed as drift below
        plan = plan_resume(
            Path(run_dir),
            manifest_path=Path(manifest_path),
            assignments=assignments,
            accept_drift=accept_drift,
            after_stop=after_stop,
        )
        return _resume(plan, str(manifest_path), progress, stop_at)
    manifest, lineage = _locked_manifest(Path(manifest_path), assignments or {})
    source = str(manifest_path)
    return _run(
        manifest, lineage, source, Path(run_dir), progress, stop_at=stop_at, start_over=resume
    )


def resume_training(
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    assignments: dict | None = None,
    accept_drift: str | None = None,
    after_stop: str | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> TrainResult:
    """Everything ``fp8ops resume`` does: continue ``run_dir`` from a checkpoint under the
    checkpoint's manifest, plus approved overrides, plus accepted drift."""
    from fp8ops.checkpoint import plan_resume

    if checkpoint is None and not assignments and accept_drift is None:
        _refuse_if_complete(Path(run_dir))
    check_unedited(Path(run_dir))
    plan = plan_resume(
        Path(run_dir),
        checkpoint=checkpoint,
        assignments=assignments,
        accept_drift=accept_drift,
        after_stop=after_stop,
    )
    return _resume(plan, str(plan.checkpoint / "manifest.yaml"), progress, stop_at)


def _resume(plan, source: str, progress: bool, stop_at: int | None) -> TrainResult:
    if plan.step >= plan.manifest.schedule.train_steps:
        if plan.step == plan.manifest.schedule.train_steps and not _finished(plan.run_dir):
            return _run(plan.manifest, None, source, plan.run_dir, progress, plan=plan)  # finish
        raise RunAlreadyComplete(
            f"{plan.checkpoint} is at step {plan.step} of {plan.manifest.schedule.train_steps}: "
            "nothing to train. To train longer, raise schedule.train_steps "
            '(--set schedule.train_steps=N --accept-drift "why")'
        )
    return _run(plan.manifest, None, source, plan.run_dir, progress, plan=plan, stop_at=stop_at)


def _refuse_if_complete(run_dir: Path) -> None:
    """A finished run, rerun with one of its own revisions (a SLURM requeue or a chain's next
    link after the end), has nothing to train: said before the drift check, so a rerun on a node
    with another environment succeeds. Another manifest still goes through the drift check: a
    file edited in place for the next experiment is refused with its diff, not taken as done."""
    if not run_dir.is_dir() or not _finished(run_dir):  # not a run: plan_resume says what
        return
    step = (read_status(run_dir) or {}).get("step")
    raise RunAlreadyComplete(
        f"{run_dir} completed at step {step}: nothing to train (the environment is not compared: "
        "nothing runs). To train longer, raise schedule.train_steps "
        '(--set schedule.train_steps=N --accept-drift "why")'
    )


def _finished(run_dir: Path) -> bool:
    """The run wrote its final weights and said so (the last thing a run does)."""
    from fp8ops.train.weights import META_FILE

    status = read_status(Path(run_dir)) or {}
    return status.get("state") == "completed" and (Path(run_dir) / "final" / META_FILE).is_file()


def _run(
    manifest,
    lineage,
    source: str,
    run_dir: Path,
    progress: bool,
    *,
    plan=None,
    stop_at: int | None = None,
    start_over: bool = False,
) -> TrainResult:
    """Start the ranks and train: a new run (``plan`` None) or a resume. ``start_over``
    (``train --resume`` without a checkpoint): an unfinished attempt of the same manifest is
    set aside first instead of refusing the directory."""
    import torch.distributed as dist

    from fp8ops.train.distributed import init_distributed, shutdown_distributed
    from fp8ops.train.signals import Interrupted, stop_on_signals
    from fp8ops.train.trainer import Trainer

    start = plan.step if plan is not None else 0
    finishing = start == manifest.schedule.train_steps
    if stop_at is not None and not start < stop_at < manifest.schedule.train_steps:
        raise Fp8opsError(
            f"--stop-at {stop_at}: the run is at step {start} of {manifest.schedule.train_steps}; "
            f"give a step after {start} and before {manifest.schedule.train_steps} (the last "
            "step is always checkpointed)"
        )
    if plan is None and not start_over:
        RunDir.check_free(run_dir, manifest)
    _check_inputs(manifest, source, resuming=plan is not None)
    with stop_on_signals() as stop_request:
        ranks = init_distributed(manifest.topology, source=source)
        try:
            if start_over and ranks.is_main:
                moved = RunDir.set_aside_unfinished(run_dir, manifest)
                if moved is not None:
                    print(
                        f"{run_dir}: no checkpoint to resume from; the unfinished attempt "
                        f"there was moved to {moved} and the run starts over",
                        file=sys.stderr,
                    )
            dist.barrier()
            if plan is None:
                RunDir.check_free(run_dir, manifest)  # again, now that every rank is up
            dist.barrier()  # nobody checks after rank 0 has started writing
            try:
                trainer = Trainer(
                    manifest,
                    lineage,
                    Path(run_dir),
                    ranks,
                    progress=progress,
                    resume=plan,
                    stop_request=stop_request,
                )
            except ManifestError as exc:
                if str(exc).startswith(source):
                    raise
                raise type(exc)(f"{source}: {exc}") from None  # name the file, as load errors do
            try:
                result = trainer.finish() if finishing else trainer.train(stop_at=stop_at)
            finally:
                trainer.run.release()
        finally:
            shutdown_distributed()
    if result.interrupted_by is not None:
        raise Interrupted(
            f"stopped at step {result.steps} ({result.interrupted_by}) after a checkpoint; "
            f"exit {Interrupted.exit_code} asks the scheduler to requeue the job, which resumes "
            f"with `fp8ops resume {result.run_dir}` (or train --resume)"
        )
    return result


def _locked_manifest(path: Path, assignments: dict) -> tuple[Manifest, list[Manifest]]:
    """The manifest the run is locked to, and its lineage (root first)."""
    manifest = load_manifest(path)
    if not assignments:
        return manifest, [manifest]
    reason = "fp8ops train --set " + " ".join(f"{k}={v}" for k, v in assignments.items())
    child = derive(manifest, assignments, reason, source=f"{path} with --set")
    return child, [manifest, child]


def _check_inputs(manifest: Manifest, source: str, *, resuming: bool = False) -> None:
    """What can be checked before any process group or model exists."""
    from fp8ops.data.tokenizer import tokenizer_for

    try:
        tokenizer_for(manifest.tokenizer)  # its file, library and end-of-document token
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    if manifest.precision.base_dtype == "fp16":
        # fp16's range ends near 6e-8: small gradients flush to zero unless the loss is scaled,
        # and nothing would show it. bf16 keeps float32's range; it is what FP8 recipes use.
        raise ManifestError(
            f"{source}: precision.base_dtype is fp16, but fp8ops trains without loss scaling, "
            "which fp16 gradients need; use bf16 (or fp32)"
        )
    if manifest.topology.pipeline_parallel != 1:
        raise ManifestError(
            f"{source}: topology.pipeline_parallel is {manifest.topology.pipeline_parallel}, but "
            "fp8ops trains without pipeline parallelism so far; set it to 1"
        )
    if manifest.model.init_checkpoint is not None and not resuming:
        from fp8ops.train import weights

        weights.read_weights_meta(
            Path(manifest.model.init_checkpoint), field=f"{source}: model.init_checkpoint"
        )
