"""The ways a run ends, each leaving its run directory resumable or finished:

* completed: after the last step, the final checkpoint, then ``final/``
  (:func:`save_final_weights`), then status completed (:func:`complete`);
* paused: ``--stop-at`` (status paused) or a stop request (status interrupted; the command exits
  75, for a requeue): a checkpoint at the step boundary (:func:`pause`);
* stopped: a Stop alert (:class:`StopRun`, exit 3): a checkpoint of the step that raised it,
  resumable with an approved override, and status stopped (:func:`stop`);
* failed: anything else raised: the telemetry measured up to the failure kept, status failed
  (:func:`fail`).

What a run (or a segment of it, between resumes) reports to the command line is a
:class:`TrainResult`. ``save_checkpoint(step, reason)``: the trainer's collective save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fp8ops.checkpoint import read_meta, weights
from fp8ops.errors import Fp8opsError
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunDir
from fp8ops.telemetry import TelemetryWriter

SaveCheckpoint = Callable[[int, str], Path]


class StopRun(Fp8opsError):
    """A Stop alert: the run saved a checkpoint and its telemetry and ended (exit code 3)."""

    exit_code = 3
    collective = True  # every rank raises it; rank 0 says so

    def __init__(self, message: str, alerts: list[dict]):
        super().__init__(f"stopped by an alert: {message}")
        self.alerts = alerts


@dataclass(frozen=True)
class TrainResult:
    """What a run (or a segment of it, between resumes) reports to the command line."""

    run_dir: Path
    steps: int  # the step the run stands at
    first_loss: float
    last_loss: float
    last_eval_loss: float | None
    seconds: float
    first_step: int = 1  # of this segment
    paused: bool = False  # --stop-at or a stop request: checkpointed and left to resume
    interrupted_by: str | None = None  # the stop request (signal, request file) that ended it
    resume_summary: list[str] | None = None
    capability_accuracy: float | None = None  # the segment's last capability evaluation


def save_final_weights(
    run: RunDir,
    model: nn.Module,
    manifest: Manifest,
    checkpoint: Path,
    last_loss: float,
    *,
    is_main: bool,
) -> None:
    """``final/``: the weights of the final ``checkpoint`` (the model holds them)."""
    # The same weights: the checkpoint already gathered and hashed them.
    saved = read_meta(checkpoint)
    meta = {
        "architecture": weights.architecture(manifest.model),
        "fingerprint": saved.weights_fingerprint,
        "fingerprint_scheme": saved.weights_fingerprint_scheme,
        "manifest": saved.manifest,  # what trained them (a finish may run under a later one)
        "steps": manifest.schedule.train_steps,
        "last_loss": last_loss,
    }
    weights.save_weights(model, run.layout.final, meta, is_main=is_main)
    run.event("weights_saved", path="final", fingerprint=saved.weights_fingerprint)


def complete(run: RunDir, manifest: Manifest, started: float) -> float:
    """Mark the run completed (final weights written); the seconds since ``started``."""
    seconds = time.perf_counter() - started
    run.completed(manifest.schedule.train_steps, seconds)
    return seconds


def pause(
    run: RunDir,
    telemetry: TelemetryWriter | None,
    save_checkpoint: SaveCheckpoint,
    step: int,
    why: str,
) -> None:
    """Stop at a step boundary with a checkpoint, ready for ``fp8ops resume``: ``why`` is
    ``stop-at`` (status paused) or a stop request's reason (status interrupted: requeue)."""
    requested = why != "stop-at"
    path = save_checkpoint(step, f"requested: {why}" if requested else why)
    if telemetry is not None:
        telemetry.close()
    run.paused(step, path.name, why, requested=requested)


def stop(
    run: RunDir,
    telemetry: TelemetryWriter | None,
    save_checkpoint: SaveCheckpoint,
    stopped: StopRun,
) -> None:
    """The Stop path: telemetry flushed, a checkpoint of the step that raised the alert
    (resumable, e.g. with an approved override), the run marked stopped."""
    first = stopped.alerts[0]
    try:
        path = save_checkpoint(first["step"], f"alert-stop: {first['rule']}")
        _close_telemetry_after(run, telemetry, stopped)
        run.stopped(first, path.name)
    except BaseException as exc:  # the Stop path itself failed: say so, not "running"
        run.failed(exc)
        raise


def fail(run: RunDir, telemetry: TelemetryWriter | None, failure: BaseException) -> None:
    """Any other end: the telemetry measured up to the failure kept, the run marked failed."""
    _close_telemetry_after(run, telemetry, failure)
    run.failed(failure)


def _close_telemetry_after(
    run: RunDir, telemetry: TelemetryWriter | None, failure: BaseException
) -> None:
    """Flush telemetry on a failure path; a writer error then is recorded, not raised, so
    the failure that stopped the run stays the one reported."""
    try:
        if telemetry is not None:
            telemetry.close()
    except Exception as exc:  # noqa: BLE001 - secondary to `failure`
        run.event("telemetry_lost", error=str(exc), during=type(failure).__name__)
