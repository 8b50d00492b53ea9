"""What telemetry costs a training step: the CPU default with telemetry on and off, one run.

    .venv/bin/python ci/bench_telemetry_overhead.py [--steps 300] [--set K=V ...]

One fine-tuning run of ``manifests/tiny-gpt-cpu.yaml`` (it needs the base checkpoint from the
README's first command). Steps alternate: odd step numbers run with telemetry off (probes
removed; a NaN row still goes to the store, so its steps stay consecutive: one memcpy), even ones
with telemetry on (probes on every FP8 module, the collector's row, the alert rules, the store's
append). Same run, model and data; alternating step by step puts drift in the machine's speed on
both. The on-steps are of two kinds: ordinary ones (scales and histories read) and measuring
ones (cast statistics every ``telemetry.every_steps``, the FP8-vs-reference error every
``error_sample_every``; with even cadences they all land on even steps). The table gives both,
and the average a run pays at the manifest's cadence:
((every - 1) x ordinary + measuring) / every, over the off-step mean.

Besides the ratio the table shows the writer's background time per step (zarr compression and
writes, off the training thread) and how long ``append`` ever made a step wait for it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from fp8ops.manifest import derive, load_manifest, parse_assignments
from fp8ops.start import New
from fp8ops.train import open_trainer
from fp8ops.train.distributed import init_distributed, shutdown_distributed

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out")
    parser.add_argument("--set", dest="changes", action="append", default=[], metavar="K=V")
    args = parser.parse_args()

    manifest = load_manifest(MANIFEST)
    changes = {"schedule.train_steps": args.steps, **parse_assignments(args.changes)}
    if changes != {"schedule.train_steps": manifest.schedule.train_steps}:
        manifest = derive(manifest, changes, "telemetry overhead benchmark")
    ranks = init_distributed(manifest.topology, source=str(MANIFEST))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = open_trainer(
                New(manifest, [manifest], Path(tmp) / "run", "bench"), ranks, progress=False
            )
            seconds: dict[str, list[float]] = {"off": [], "ordinary": [], "measuring": []}
            telemetry = manifest.telemetry
            for step in range(args.steps):
                number = step + 1
                observed = number % 2 == 0
                trainer.collector.set_active(observed)
                started = time.perf_counter()
                record = trainer.train_step(step)
                trainer.observe(record)
                elapsed = time.perf_counter() - started
                measuring = number % telemetry.every_steps == 0 or (
                    number % telemetry.error_sample_every == 0
                )
                kind = "off" if not observed else "measuring" if measuring else "ordinary"
                if step >= args.warmup:
                    seconds[kind].append(elapsed)
            trainer.telemetry.close()
            stats = trainer.telemetry.stats
    finally:
        shutdown_distributed()
    report(manifest, seconds, stats)


def report(manifest, seconds: dict[str, list[float]], stats) -> None:
    telemetry = manifest.telemetry
    mean = {kind: statistics.mean(values) for kind, values in seconds.items() if values}
    table = Table(title=f"telemetry overhead, {MANIFEST.name}, one run, steps alternating")
    for column in ("steps", "count", "mean ms/step", "median ms/step", "vs off"):
        table.add_column(column, justify="right")
    for kind, label in (
        ("off", "telemetry off"),
        ("ordinary", "on, ordinary"),
        ("measuring", "on, measuring"),
    ):
        values = seconds[kind]
        if not values:
            continue
        table.add_row(
            label,
            str(len(values)),
            f"{1e3 * mean[kind]:.1f}",
            f"{1e3 * statistics.median(values):.1f}",
            f"{mean[kind] / mean['off']:.3f}x",
        )
    every = min(telemetry.every_steps, telemetry.error_sample_every)
    average = mean["ordinary"]
    if "measuring" in mean:
        average = ((every - 1) * mean["ordinary"] + mean["measuring"]) / every
    console = Console()
    console.print(
        f"cadence: cast statistics every {telemetry.every_steps} steps, FP8-vs-reference error "
        f"every {telemetry.error_sample_every}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    console.print(table)
    console.print(
        f"average overhead at this cadence: {average / mean['off']:.3f}x "
        f"({100 * (average / mean['off'] - 1):+.1f}%), goal <= 3%"
    )
    console.print(
        f"store writer: {stats.write_ms_per_step:.2f} ms per step in its background thread "
        f"({stats.blocks} blocks), steps kept waiting {1e3 * stats.blocked_seconds:.1f} ms in all"
    )


if __name__ == "__main__":
    main()
