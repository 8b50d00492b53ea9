"""Benchmark (not a test): the what-if replay of one module slot, vectorised against one
update call per step.

    .venv/bin/python ci/bench_whatif.py [--steps 10000] [--reps 5]

A synthetic amax series (log-normal, with steps that did not run) replayed under the run's
window and the what-if's, as the console and ``fp8ops whatif`` do for one module slot: the
vectorised :func:`fp8ops.console.whatif.replay` (median of ``--reps``) and the step-by-step
reference (``replay_stepwise``, one ``update_delayed_scaling`` call per step; timed once), with
a check that the two agree bit for bit. Prints a table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from fp8ops.console.whatif import Window, replay, replay_stepwise

PAIRS = [  # (the run's window, the what-if's)
    (Window(1024, "max", 0), Window(64, "max", 0)),
    (Window(16, "most_recent", 0), Window(1024, "max", 1)),
    (Window(1024, "max", 0), Window(128, "quantile:0.99", 0)),
    (Window(1024, "max", 0), Window(1024, "quantile:0.99", 0)),  # a top-k per window
    (Window(1024, "max", 0), Window(1024, "quantile:0.5", 0)),  # kthvalue per window
    (Window(1024, "quantile:0.9", 0), Window(512, "trimmed_max:8", 0)),
]


def seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    amax = np.exp2(rng.standard_normal(args.steps) * 3).astype(np.float32)
    amax[rng.random(args.steps) < 0.02] = np.nan

    table = Table(title=f"what-if replay of one module slot, {args.steps:,} steps, both windows")
    for column in ("run's window", "what-if", "vectorised", "step by step", "speed-up", "equal"):
        table.add_column(column, justify="right")
    for own, other in PAIRS:
        fast = seconds(
            lambda o=own, w=other: (replay(amax, o, 448.0), replay(amax, w, 448.0)), args.reps
        )
        start = time.perf_counter()
        slow = [replay_stepwise(amax, w, 448.0) for w in (own, other)]
        slow_s = time.perf_counter() - start
        equal = all(
            np.array_equal(replay(amax, w, 448.0).scale.view(np.uint32), s.view(np.uint32))
            for w, s in zip((own, other), slow, strict=True)
        )
        table.add_row(
            str(own),
            str(other),
            f"{fast * 1e3:.1f} ms",
            f"{slow_s:.2f} s",
            f"{slow_s / fast:.0f}x",
            "yes" if equal else "NO",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
