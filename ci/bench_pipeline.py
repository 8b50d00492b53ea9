"""Benchmark (not a test): the step time at pipeline_parallel 1 and 2 on this machine.

    .venv/bin/python ci/bench_pipeline.py [--reps 3]

Runs ``tests/workers/pipeline.py`` (the small GPT, 4 layers, float32, emulated FP8, two
micro-batches of 2 x 64 tokens per step, through Megatron's pipeline schedule) with torchrun at
PP 1 (one process) and PP 2 (two processes, one stage each), ``--reps`` times each, and prints
the median step time of steps 2-4 (step 1 includes first-call costs) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "tests" / "workers" / "pipeline.py"


def step_seconds(ranks: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={ranks}", str(WORKER), out, "1"]
        subprocess.run(command, check=True, capture_output=True)
        records = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
    # A step ends when its slowest stage does.
    per_step = [max(r["steps"][i]["seconds"] for r in records) for i in range(1, 4)]
    return statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    times = {pp: [step_seconds(pp) for _ in range(args.reps)] for pp in (1, 2)}
    table = Table(title="step time, small GPT (4 layers), FP8 emulated, 2 micro-batches")
    for column in ("PP", "processes", "step (median of runs)", "runs", "ratio to PP 1"):
        table.add_column(column, justify="right")
    base = statistics.median(times[1])
    for pp, runs in times.items():
        median = statistics.median(runs)
        table.add_row(
            str(pp),
            str(pp),
            f"{median * 1e3:.1f} ms",
            ", ".join(f"{t * 1e3:.0f}" for t in runs),
            f"{median / base:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
