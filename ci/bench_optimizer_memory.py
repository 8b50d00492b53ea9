"""Benchmark (not a test): optimizer state and peak memory per rank, replicated vs distributed.

    .venv/bin/python ci/bench_optimizer_memory.py [--params-m 25] [--dp 1,2,4] [--steps 3]

For each data-parallel size, torchrun starts that many ranks on this machine (gloo); each
builds the same bf16 model (``--params-m`` million parameters in 1024 x 1024 linears), gives it
gradients and takes ``--steps`` steps with ``MainParamsOptimizer`` (every rank holds all
float32 main weights and moments) or ``DistributedMainParamsOptimizer`` (``optimizer.distributed``:
each rank holds 1/DP). Per rank: the optimizer's state bytes, and the growth of the process's
peak resident memory from just before the optimizer is built to after its steps (the state,
plus each step's transient float32 gradient buffer and the gathered weights).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN = 1024


def worker(out: Path, distributed: bool, params_m: float, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from fp8ops.manifest.schema import OptimizerConfig
    from fp8ops.train.distributed_optimizer import DistributedMainParamsOptimizer
    from fp8ops.train.optimizer import MainParamsOptimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = max(1, round(params_m * 1e6 / (HIDDEN * HIDDEN)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)))
    model = model.to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(p.dtype) * 1e-3
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cls = DistributedMainParamsOptimizer if distributed else MainParamsOptimizer
    groups = {"tp_group": dist.new_group([rank]), "dp_group": dist.group.WORLD}
    optimizer = cls(model, OptimizerConfig(lr=1e-4), **groups)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.full(p.shape, 1e-3, dtype=p.dtype)
        optimizer.step(lr=1e-4)
    step_s = (time.perf_counter() - started) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "rank": rank,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": optimizer.state_bytes(),
        "peak_growth": peak - before,
        "step_s": step_s,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def run(dp: int, distributed: bool, params_m: float, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={dp}", __file__, "--worker", out]
        command += ["--params-m", str(params_m), "--steps", str(steps)]
        command += ["--distributed"] if distributed else []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(dp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=25.0)
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.distributed, args.params_m, args.steps)
        return

    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title=f"optimizer state per rank, bf16 model of {args.params_m:g}M parameters")
    for column in ("DP", "optimizer", "state / rank", "bytes / param / rank", "peak growth / rank"):
        table.add_column(column, justify="right")
    table.add_column("step", justify="right")
    for dp in (int(d) for d in args.dp.split(",")):
        for distributed in (False, True):
            ranks = run(dp, distributed, args.params_m, args.steps)
            params = ranks[0]["params"]
            state = max(r["state_bytes"] for r in ranks)
            growth = [r["peak_growth"] / mib for r in ranks]
            table.add_row(
                str(dp),
                "distributed" if distributed else "replicated",
                f"{state / mib:,.1f} MiB",
                f"{state / params:.2f}",
                f"{min(growth):,.0f}-{max(growth):,.0f} MiB",
                f"{max(r['step_s'] for r in ranks) * 1e3:,.0f} ms",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
