"""The four plans a start can make (:func:`fp8ops.start.plan.plan_start` decides which): a new
run, a resume from a checkpoint, a finish of a run that trained its last step, or nothing to do.
The checks of :mod:`fp8ops.start.checks` read them; the rank start-up (``fp8ops.train.startup``)
carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.checkpoint.meta import CheckpointMeta
from fp8ops.manifest.schema import Manifest
from fp8ops.start.drift import Drift


@dataclass(frozen=True)
class New:
    """Start a run in ``run_dir``, locked to ``manifest`` (``lineage``: its revisions, root
    first)."""

    manifest: Manifest
    lineage: list[Manifest]
    run_dir: Path
    source: str  # where the manifest came from, as messages name it
    start_over: bool = False  # train --resume without a checkpoint: set an unfinished try aside
    stop_at: int | None = None
    verify: bool | None = None  # TrainRequest.verify


@dataclass
class Resume:
    """Continue ``run_dir`` from ``checkpoint``, locked to ``manifest``."""

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
    unverified_records: list = field(default_factory=list)  # ledger records not proven signed
    fp8_read: str = "own"  # "own": each state group reads its slice; "group0": all read slice 0
    accept_drift: str | None = None  # the operator's reason, for drift found after the plan
    after_stop: str | None = None  # the operator's reason to resume a stopped run as it is
    seen: tuple[str | None, str | None] = (None, None)  # (latest checkpoint, state) when planned
    source: str = ""  # the manifest file named in messages
    stop_at: int | None = None

    @property
    def step(self) -> int:
        return self.meta.step


class Finish(Resume):
    """A :class:`Resume` at the last step whose final weights were never written: load the
    checkpoint and finish (the last step's evaluations first, if a Stop cut them off)."""


@dataclass(frozen=True)
class Complete:
    """Nothing to train: the run is finished. A result, not an error (exit 0)."""

    run_dir: Path
    message: str


StartPlan = New | Resume | Finish | Complete
