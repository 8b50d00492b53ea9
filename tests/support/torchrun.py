"""Starting processes under torchrun from a test: ``fp8ops`` commands or a worker script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# What a launch whose ranks never connected prints. Seen once in a clean clone's suite, with
# another test's torchrun starting on the other pytest worker: gloo's mesh was closed by a peer
# inside init_process_group, before any fp8ops code ran; the test passed alone three times.
_NOT_CONNECTED = ("connectFullMesh failed", "Address already in use", "RendezvousConnectionError")


def torchrun(
    *args: object, ranks: int = 2, timeout: float = 300, ok: bool = True
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS ARGS...``; fails the
    test with the end of its output unless every rank exits 0 (``ok=False``: the caller checks).
    A launch whose ranks never connected is started once more (``_NOT_CONNECTED``); any other
    failure is the test's.

    Every process computes on one thread: torchrun sets that for several processes, and one
    process gets the same, so runs at different sizes reduce in the same order (a CPU
    kernel's reductions, a layer norm's backward, split work across threads)."""
    for attempt in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            + [f"--nproc-per-node={ranks}", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        connected = not any(sign in done.stderr for sign in _NOT_CONNECTED)
        if done.returncode == 0 or connected or attempt == 2:
            break
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
