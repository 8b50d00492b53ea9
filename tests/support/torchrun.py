"""Starting processes under torchrun from a test: ``fp8ops`` commands or a worker script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def torchrun(
    *args: object, ranks: int = 2, timeout: float = 300, ok: bool = True
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS ARGS...``; fails the
    test with the end of its output unless every rank exits 0 (``ok=False``: the caller checks).

    Every process computes on one thread: torchrun sets that for several processes, and one
    process gets the same, so runs at different sizes reduce in the same order (a CPU
    kernel's reductions, a layer norm's backward, split work across threads)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc-per-node={ranks}", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def fp8ops_ranks(*args: object, ranks: int = 2) -> subprocess.CompletedProcess:
    """An ``fp8ops`` command on ``ranks`` processes, without progress output."""
    return torchrun("-m", "fp8ops", *args, "--no-progress", ranks=ranks)


def worker_records(worker: Path, out: Path, *args: object, ranks: int) -> list[dict]:
    """Run ``worker OUT ARGS...`` on ``ranks`` processes; each writes ``OUT/rank{r}.json``."""
    out.mkdir()
    torchrun(worker, out, *args, ranks=ranks, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
