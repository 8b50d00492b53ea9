"""How a training process is asked to stop: signals and a request file, turned into one agreed
stop step.

A scheduler warns before it ends a job (SLURM: ``--signal=USR1@N`` before the time limit,
SIGTERM on preemption). Stopping mid-step loses the step; stopping on one rank but not the
others hangs the rest in a collective. So a request only sets a flag, and at every step
boundary the ranks all-reduce their flags (:meth:`StopRequest.agreed`): if any rank was asked,
all of them checkpoint that step and exit with :data:`REQUEUE_EXIT` ("requeue me"), distinct
from failure.

Three ways to ask: SIGUSR1 or SIGTERM to the training processes, or a file
``RUN_DIR/stop.request`` (what a batch script's signal trap writes: launchers such as torchrun
do not forward SIGUSR1 to their workers). More SIGTERMs change nothing: under SLURM every process
of a step gets one and torchrun forwards its own, so a worker often receives two for one
preemption. A run that must end at once is interrupted (SIGINT: the failure path) or killed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.errors import Fp8opsError
from fp8ops.run.layout import STOP_REQUEST

REQUEST_FILE = STOP_REQUEST  # the request file's name (fp8ops.run.layout spells it)
REQUEUE_EXIT = 75  # EX_TEMPFAIL: the job should run again and resume


class Interrupted(Fp8opsError):
    """The run stopped on request at a step boundary, after a checkpoint (exit 75: requeue)."""

    exit_code = REQUEUE_EXIT
    collective = True  # every rank raises it; rank 0 says so


class StopRequest:
    """The flag the signal handlers set and the training loop polls."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.since = time.time()  # a request file older than this process was for another

    def stale_file(self, run_dir: Path) -> bool:
        """Whether ``RUN_DIR/stop.request`` predates this process (left by a run that ended
        before it saw it): a resume removes such a file rather than stop after one step."""
        request = Path(run_dir) / REQUEST_FILE
        return request.exists() and request.stat().st_mtime < self.since

    def ask(self, reason: str) -> None:
        self.reason = self.reason or reason

    def agreed(self, run_dir: Path, group=None) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it each step)."""
        if self.reason is None and (Path(run_dir) / REQUEST_FILE).exists():
            self.ask(f"{REQUEST_FILE} in the run directory")
        flag = torch.tensor(float(self.reason is not None))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and self.reason is None:
            self.reason = "another rank was asked to stop"
        return bool(flag.item())


@contextlib.contextmanager
def stop_on_signals():
    """Yield a :class:`StopRequest` set by SIGUSR1 and SIGTERM (main thread only; elsewhere the
    request is never set by a signal)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def ask(signum, frame):
        request.ask(signal.Signals(signum).name)

    previous = {
        signal.SIGUSR1: signal.signal(signal.SIGUSR1, ask),
        signal.SIGTERM: signal.signal(signal.SIGTERM, ask),
    }
    try:
        yield request
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
