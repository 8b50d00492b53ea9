"""torchrun worker: what every rank comes through together (fp8ops.collective) on two gloo
ranks, each case a failure on one rank only (tests/test_collective.py). A regression leaves a
rank waiting for the other: gloo's timeout (60 s here) then ends it with an error instead.

Writes OUT_DIR/rank{r}.json: per case, what this rank raised (its type, message, whether it is
said once) or returned.
Usage: torchrun --standalone --nproc_per_node 2 collective.py OUT_DIR RUN_DIR
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fp8ops.collective import on_rank0, raise_if_any, together
from fp8ops.errors import Fp8opsError
from fp8ops.run import RunDir
from fp8ops.train.ending import check_releasable


def outcome(call) -> dict:
    try:
        return {"returned": call()}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "collective": getattr(exc, "collective", False),
            "cause": None if exc.__cause__ is None else type(exc.__cause__).__name__,
        }


def fails_on(rank: int, message: str):
    def work():
        if dist.get_rank() == rank:
            raise Fp8opsError(message)
        return "went on"

    return work


def in_together(rank: int):
    def block():
        with together():
            fails_on(rank, "a check of rank 1's")()
        return "went on"

    return block


def main(out_dir: Path, run_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    run = RunDir(run_dir, writer=rank == 0)
    cases = {
        "on_rank0": lambda: on_rank0(rank == 0, fails_on(0, "rank 0's work failed")),
        "on_rank0_ok": lambda: on_rank0(rank == 0, lambda: f"from rank {rank}"),
        "raise_if_any": lambda: raise_if_any("rank 1's problem" if rank == 1 else None),
        "together": in_together(1),
        # Rank 0 reads the records, and a damaged line fails it: rank 1 waited in a broadcast.
        "check_releasable": lambda: check_releasable(run, 4, run_dir / "checkpoints" / "x"),
    }
    found = {name: outcome(case) for name, case in cases.items()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
