"""Rank start-up: a start plan (:mod:`fp8ops.start`) becomes ranks that train it.

Reading order: :func:`run_training` (``fp8ops train``) and :func:`resume_training`
(``fp8ops resume``) plan and call :func:`start`, which starts the ranks, opens a
:class:`~fp8ops.train.trainer.Trainer` on the run (:func:`open_trainer`) and trains. What a
run writes when it starts or resumes (``layers.json``, ``run.json``, the ``resumed`` event, the
ledger's applied records, ``fallbacks.json``) is written here, once, by rank 0.

torch, Megatron and the trainer are imported inside :func:`start`: a resume refused for drift
answers from one JSON file in well under two seconds, before any of them loads.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fp8ops.errors import ManifestError, StorageFull
from fp8ops.manifest import manifest_hash
from fp8ops.run import RunDir, RunRecord, read_metrics
from fp8ops.start import (
    Complete,
    Finish,
    New,
    Resume,
    ResumeRequest,
    StartPlan,
    TrainRequest,
    checks,
    plan_start,
)

if TYPE_CHECKING:
    from fp8ops.train.ending import TrainResult
    from fp8ops.train.trainer import Trainer


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
    verify: bool | None = None,
) -> TrainResult | Complete:
    """Everything ``fp8ops train`` does (:class:`~fp8ops.start.TrainRequest` says what each
    argument asks). A finished run rerun is :class:`~fp8ops.start.Complete`."""
    request = TrainRequest(
        Path(manifest_path),
        Path(run_dir),
        assignments=assignments or {},
        resume=resume,
        accept_drift=accept_drift,
        after_stop=after_stop,
        stop_at=stop_at,
        verify=verify,
    )
    return start(plan_start(request), progress=progress)


def resume_training(
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    assignments: dict | None = None,
    accept_drift: str | None = None,
    after_stop: str | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> TrainResult | Complete:
    """Everything ``fp8ops resume`` does: continue ``run_dir`` from a checkpoint under the
    checkpoint's manifest, plus approved overrides, plus accepted drift."""
    request = ResumeRequest(
        Path(run_dir),
        checkpoint=checkpoint,
        assignments=assignments or {},
        accept_drift=accept_drift,
        after_stop=after_stop,
        stop_at=stop_at,
    )
    return start(plan_start(request), progress=progress)


def start(plan: StartPlan, *, progress: bool = True) -> TrainResult | Complete:
    """Start the ranks and train ``plan`` (every rank calls it); a stop request ends in
    :class:`~fp8ops.train.signals.Interrupted` (exit 75: requeue) after its checkpoint."""
    if isinstance(plan, Complete):
        return plan
    from fp8ops.train.distributed import init_distributed, shutdown_distributed
    from fp8ops.train.ending import storage_cause, storage_message
    from fp8ops.train.signals import Interrupted, stop_on_signals

    with stop_on_signals() as stop_request:
        ranks = init_distributed(plan.manifest.topology, source=plan.source)
        try:
            if isinstance(plan, New):
                done = _make_room(plan, ranks)
                if done is not None:
                    return done
            trainer = open_trainer(plan, ranks, progress=progress, stop_request=stop_request)
            try:
                result = (
                    trainer.finish() if isinstance(plan, Finish) else trainer.train(plan.stop_at)
                )
            finally:  # however it ended (a Stop's exit 3 too): sinks and webhooks sent first
                trainer.reporting.close()
                trainer.run.release()
            if isinstance(plan, Resume) and ranks.is_main:
                result = replace(result, resume_summary=resume_summary(plan, trainer))
        except BaseException as exc:  # a full disk before the trainer could say so: said once
            cause = storage_cause(plan.run_dir, exc)
            if cause is None:
                raise
            raise StorageFull(storage_message(plan.run_dir, cause, None)) from exc
        finally:
            shutdown_distributed()
    if result.interrupted_by is not None:
        raise Interrupted(
            f"stopped at step {result.steps} ({result.interrupted_by}) after a checkpoint; "
            f"exit {Interrupted.exit_code} asks the scheduler to requeue the job, which resumes "
            f"with `fp8ops resume {result.run_dir}` (or train --resume)"
        )
    return result


def _make_room(plan: New, ranks) -> Complete | None:
    """Now that every rank is up: ``train --resume`` without a checkpoint sets an unfinished
    attempt aside, and every rank checks the directory is (still) free."""
    import torch.distributed as dist

    if plan.start_over and ranks.is_main:
        moved = RunDir.set_aside_unfinished(plan.run_dir, plan.manifest)
        if moved is not None:
            print(
                f"{plan.run_dir}: no checkpoint to resume from; the unfinished attempt "
                f"there was moved to {moved} and the run starts over",
                file=sys.stderr,
            )
    dist.barrier()
    done = checks.check_free(plan.run_dir, plan.manifest)  # again, now that every rank is up
    dist.barrier()  # nobody checks after rank 0 has started writing
    return Complete(plan.run_dir, done) if done is not None else None


def open_trainer(plan: New | Resume, ranks, *, progress: bool = True, stop_request=None) -> Trainer:
    """A :class:`~fp8ops.train.trainer.Trainer` for ``plan`` on the run directory, ready to
    train (collective). Everything that can refuse runs before the directory is claimed, so a
    refused run leaves nothing behind; a manifest problem names the manifest's file."""
    import torch.distributed as dist

    with _naming(plan.source):
        trainer = _built(plan, ranks, progress=progress, stop_request=stop_request)
        dist.barrier()  # every rank has passed every check
        run = _claimed(plan, ranks)
        try:
            _write_start_records(plan, trainer, run)
            trainer.open(run)
        except BaseException as exc:
            run.failed(exc)
            run.release()
            raise
    return trainer


def _built(plan: New | Resume, ranks, *, progress: bool, stop_request) -> Trainer:
    from fp8ops.train.inputs import build_inputs
    from fp8ops.train.phases import resume_at
    from fp8ops.train.trainer import Trainer

    resume = plan if isinstance(plan, Resume) else None
    if resume is None:
        inputs = build_inputs(plan.manifest, is_main=ranks.is_main)
    else:
        inputs = build_inputs(
            plan.manifest,
            is_main=ranks.is_main,
            check_tokenizer=lambda tokenizer: checks.check_same_tokenizer(resume, tokenizer),
            check_data=lambda data: checks.check_same_data(resume, data),
        )
    trainer = Trainer(
        plan.manifest,
        inputs,
        ranks,
        from_base=resume is None,
        verify_base=plan.verify if isinstance(plan, New) else None,
        progress=progress,
        stop_request=stop_request,
    )
    if resume is not None:
        resume_at(trainer, resume.step + 1)  # under the phases of the schedule that cover it
        checks.check_admission(resume, trainer.admission_hash())
        with checks.reading_checkpoint(resume.run_dir, resume.seen, resume.checkpoint):
            trainer.restore(resume)  # loaded and verified before anything is written
        checks.check_not_moved_on(resume)  # loading took a while: nobody trained it meanwhile
    return trainer


@contextlib.contextmanager
def _naming(source: str):
    """A manifest error names the file, as load errors do."""
    try:
        yield
    except ManifestError as exc:
        if str(exc).startswith(source):
            raise
        raise type(exc)(f"{source}: {exc}") from None


def _claimed(plan: New | Resume, ranks) -> RunDir:
    """The run directory, claimed (a new run) or reopened (a resume) by rank 0; the other
    ranks' hold writes nothing."""
    if not ranks.is_main:
        return RunDir(plan.run_dir, writer=False)
    if isinstance(plan, New):
        return RunDir.claim(plan.run_dir, plan.manifest, plan.lineage)
    return RunDir.reopen(
        plan.run_dir,
        plan.manifest,
        plan.new_revisions,
        step=plan.step,
        checkpoint=plan.checkpoint.name,
    )


def _write_start_records(plan: New | Resume, trainer: Trainer, run: RunDir) -> None:
    """``layers.json``; a new run's ``run.json`` (collective: the initial weights' fingerprint
    gathers TP shards) or a resume's ledger records, ``latest`` rewound and ``resumed`` event;
    then ``fallbacks.json``."""
    from fp8ops.run.records import write_layers_json
    from fp8ops.train.phases import resumed_history

    manifest = plan.manifest
    if run.writer:
        write_layers_json(
            run.path,
            trainer.admission,
            trainer.recipe,
            tensor_parallel=manifest.topology.tensor_parallel,
            manifest_hash=manifest_hash(manifest),
            # A resume keeps the schedule's switches up to its first step (phases.py).
            history=resumed_history(trainer, run.path) if isinstance(plan, Resume) else (),
        )
    if isinstance(plan, New):
        record = _run_record(trainer)
        if run.writer:
            run.started(record)
    elif run.writer:
        _record_resume(plan, trainer, run)
    run.write_fallbacks(
        manifest.precision.overrides,
        from_step=trainer.start_step + 1,
        revision=manifest_hash(manifest),
    )


def _run_record(trainer: Trainer) -> RunRecord:
    """What the run starts from (collective: every rank computes the initial fingerprint)."""
    import torch.distributed as dist

    from fp8ops.checkpoint import weights
    from fp8ops.precision.linear import cast_path
    from fp8ops.run.environment import environment_fingerprint

    manifest, topology, base = trainer.manifest, trainer.manifest.topology, trainer.base
    # A weights checkpoint loaded and verified in the model's own dtype is already hashed: the
    # same bytes. (A Hugging Face base's fingerprint is of its files, not of the model's tensors.)
    dtype = str(trainer.model_dtype).removeprefix("torch.")
    if base and base.get("format") != "hf" and base["verified"] and base["dtype"] == dtype:
        initial, scheme = base["fingerprint"], base["fingerprint_scheme"]
    else:
        scheme = weights.FINGERPRINT_SCHEME
        initial = weights.weights_fingerprint(trainer.model, trainer.tp_group, scheme=scheme)
    precision = manifest.precision
    # Which kernels cast (FP8OPS_COMPILED_CASTS, FP8OPS_CAST_KERNEL, or TE's own): the same bits
    # either way, so not part of the environment a resume compares.
    casts = None
    if precision.enabled:
        casts = "transformer_engine" if precision.backend == "te" else cast_path(trainer.device)
    data = trainer.data
    state_bytes: list = [None] * dist.get_world_size()
    dist.all_gather_object(state_bytes, trainer.optimizer.state_bytes())
    return RunRecord.model_validate(
        {
            "manifest": manifest_hash(manifest),
            "revision": manifest.revision.number,
            "run_id": uuid.uuid4().hex,  # rank 0's is written
            "command": sys.argv,
            "environment": environment_fingerprint(),
            "cpu_bf16_gemm": trainer.cpu_bf16_gemm,
            "topology": {
                "tensor_parallel": topology.tensor_parallel,
                "pipeline_parallel": topology.pipeline_parallel,
                "data_parallel": topology.data_parallel,
                "world_size": trainer.ranks.world_size,
                "amax_reduction": topology.amax_reduction,
                "amax_reduction_ranks": dist.get_process_group_ranks(trainer.amax_group),
            },
            "seeds": manifest.seeds.model_dump(),
            "model": {
                "config_fingerprint": weights.architecture_fingerprint(manifest.model),
                "init_checkpoint": manifest.model.init_checkpoint,
                "init_fingerprint": base["fingerprint"] if base else None,
                "init_fingerprint_scheme": base["fingerprint_scheme"] if base else None,
                "init_verified": base["verified"] if base else None,
                "init_hf_verification": base.get("verification") if base else None,
                "initial_weights_fingerprint": initial,
                "initial_weights_fingerprint_scheme": scheme,
                "parameters": _model_parameters(trainer),
            },
            "optimizer": {
                "distributed": manifest.optimizer.distributed,
                "state_bytes_per_rank": state_bytes,
            },
            "tokenizer": {
                "kind": manifest.tokenizer.kind,
                "fingerprint": data.source["tokenizer_fingerprint"],
            },
            "data": {
                **data.summary(),
                "fingerprint": data.fingerprint,
                "sampler": trainer.sampler.describe(),
            },
            "admission": {"fp8_modules": sum(r.precision == "fp8" for r in trainer.admission.rows)},
            "fp8_casts": casts,
        }
    )


def _model_parameters(trainer: Trainer) -> int:
    """The whole model's parameter count (collective): every TP shard and every stage, a tied
    embedding's second copy (on the last stage) not counted again."""
    import torch.distributed as dist

    from fp8ops.megatron.stages import every_stage

    tp = dist.get_world_size(trainer.tp_group)
    mine = sum(
        p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        for p in trainer.model.parameters()
        if not getattr(p, "shared", False)
    )
    return sum(every_stage([mine]))


def _record_resume(plan: Resume, trainer: Trainer, run: RunDir) -> None:
    """After the load (rank 0): the ledger's applied records, ``latest`` moved back if the
    resume left later checkpoints behind, a stop request the last attempt never saw removed,
    and the ``resumed`` event."""
    from fp8ops.checkpoint import CheckpointDir
    from fp8ops.overrides import Ledger
    from fp8ops.overrides.anchors import run_anchors
    from fp8ops.run.environment import environment_fingerprint

    digest = manifest_hash(plan.manifest)
    # Only first applications and first lifts are new to the ledger; re-applying after a
    # resume from an older checkpoint is in the event below.
    news = [o.id for o in plan.applied_overrides if o.status == "approved"]
    news += [o.id for o in plan.lifted_overrides if o.to_lift]
    if news:
        # Held to the resume's checkpoint and the drift it accepted, as the plan read it: the
        # `resumed` event that records the drift, and a rewind's `latest`, come after.
        ledger = Ledger(run.path, anchors=run_anchors(run.path, resume=plan))
        ledger.record_applied(news, step=plan.step + 1, revision=digest)
    superseded = CheckpointDir(run.path).rewind(plan.checkpoint)
    stop_request = trainer.stop_request
    if stop_request is not None and stop_request.stale_file(run.path):
        run.layout.stop_request.unlink()  # a request the last attempt never saw
    run.event(
        "resumed",
        step=plan.step,
        checkpoint=plan.checkpoint.name,
        manifest=digest,
        new_revisions=[manifest_hash(m) for m in plan.new_revisions],
        drift=plan.drift.to_json(),
        accepted=plan.accepted_reason,
        after_stop=plan.after_stop,
        cpu_bf16_gemm=trainer.cpu_bf16_gemm,
        overrides_applied=[o.module for o in plan.applied_overrides],
        overrides_lifted=[o.module for o in plan.lifted_overrides],
        unverified_ledger_records=plan.unverified_records,
        superseded=[p.name for p in superseded],
        fp8_state=plan.fp8_read,
        scales_carried=trainer.carried_scales,
        # alert rules the checkpoint predates: their windows start empty
        alert_rules_fresh=trainer.alert_engine.fresh_rules,
        environment=environment_fingerprint(),
        command=sys.argv,
        load_seconds=round(trainer.load_seconds, 3),
    )


def resume_summary(plan: Resume, trainer: Trainer) -> list[str]:
    """What the resume changed, and tokens/s over (up to) 20 steps before and after it."""
    import numpy as np

    lines = [f"resumed from {plan.checkpoint.name} (step {plan.step})"]
    if plan.accepted_reason:
        lines.append(f"accepted drift: {plan.drift.summary()} ({plan.accepted_reason})")
    lines += [f"fallback: {o.module} -> bf16 ({o.reason})" for o in plan.applied_overrides]
    lines += [f"lifted: {o.module} -> fp8" for o in plan.lifted_overrides]
    lines += [f"unverified ledger record: {line}" for line in plan.unverified_records]
    lines += [
        f"{direction} scales carried to the new recipe: x{factor:g}"
        for direction, factor in trainer.carried_scales.items()
    ]
    metrics = read_metrics(plan.run_dir)
    before = [m.tokens_per_s for m in metrics if plan.step - 20 < m.step <= plan.step]
    after = [m.tokens_per_s for m in metrics if plan.step < m.step <= plan.step + 20]
    if before and after:
        b, a = float(np.median(before)), float(np.median(after))
        # Each process's first steps warm up: a median of a handful of steps is mostly them.
        change = f" ({a / b - 1:+.1%})" if min(len(before), len(after)) >= 5 else ""
        lines.append(
            f"tokens/s: median {b:,.0f} over the {len(before)} steps before, "
            f"{a:,.0f} over the {len(after)} after{change}"
        )
    return lines
