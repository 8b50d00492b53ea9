"""Benchmark (not a test): the ops console on a large store, through the app object.

    .venv/bin/python ci/bench_console.py [--steps 100000] [--modules 256] [--dir DIR] [--reps 9]

Builds (or, with ``--dir``, reuses) a synthetic store of ``--steps`` x ``--modules`` x 40
metrics written by the real ``TelemetryWriter`` (the values of ``ci/bench_telemetry.py``), then
times what an operator waits for, each through ``ConsoleApp`` as a test drives it (no browser;
without an event loop the app does its background work synchronously, so each time below is
the whole wait):

* the app built on the run, until the first heatmap (the last 10,000 steps) and the first
  module's history are drawn: goal 2 s; the import of the app's modules is timed apart;
* the same in an event loop, as in a kernel: the longest the loop goes without a turn (the
  page answers no click meanwhile), the run being read in the app's worker thread;
* switching modules (median and worst of ``--reps`` modules): goal 300 ms; switching slot,
  heatmap metric;
* the whole-run heatmap: pooling every step once (cold), then again from memory (warm);
* the follower's poll with nothing new, and after 256 more committed steps (in a kernel this
  runs in the worker thread, not on the event loop);
* a window what-if of one module slot over the last 10,000 steps;
* the bytes a heatmap and a module view send to the browser (plotly's JSON of the figure).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_telemetry import build, step_row, synthetic

from fp8ops.telemetry import TelemetryWriter, open_run

GOALS_S = {"first": 2.0, "switch": 0.3}
MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def store_for(workdir: Path, steps: int, modules: int, console: Console) -> Path:
    """``workdir/run`` holding a store of at least ``steps`` steps (built if absent)."""
    run = workdir / "run"
    store = run / "telemetry.zarr"
    if store.exists() and (open_run(run).last_step() or 0) >= steps:
        console.print(f"reusing {store} ({open_run(run).last_step():,} steps)")
    else:
        names = [f"decoder.layers.{i // 4}.linear_{i % 4}" for i in range(modules)]
        console.print(f"building {steps:,} steps x {modules} modules in {store} ...")
        started = time.perf_counter()
        writer, _ = build(store, names, steps)
        writer.close()
        console.print(f"built in {time.perf_counter() - started:.0f} s")
    # A stand-in manifest (the recipe the what-if compares with) and a status; no layers.json,
    # so the overrides section says it has no module table.
    shutil.copyfile(MANIFEST, run / "manifest.yaml")
    (run / "status.json").write_text(json.dumps({"state": "running", "step": steps}))
    return run


def append_steps(run: Path, count: int) -> None:
    """``count`` more committed steps, as a live run would add them."""
    modules = len(open_run(run).modules)
    writer = TelemetryWriter.resume(run / "telemetry.zarr", rank=0)
    first = writer.next_step
    block = synthetic(first, count, modules)
    for i in range(count):
        writer.append(first + i, block[i], step_row(first + i))
    writer.close()


def loop_held_while_shown(run: Path) -> float:
    """The longest an event loop goes without a turn while an app built in it shows ``run``."""
    from fp8ops.console.app import ConsoleApp

    async def measure() -> float:
        turns = [time.monotonic()]

        async def turn() -> None:
            while True:
                await asyncio.sleep(0.005)
                turns.append(time.monotonic())

        ticker = asyncio.create_task(turn())
        app = ConsoleApp(run, follow=False)  # the loop's first turn comes after this returns
        while app.run is None:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        ticker.cancel()
        app.close()
        return max(b - a for a, b in itertools.pairwise(turns)) - 0.005

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--modules", type=int, default=256)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", type=Path, help="where to build (kept, and reused next time)")
    args = parser.parse_args()
    console = Console(width=150)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="bench_console_"))
    run = store_for(workdir, args.steps, args.modules, console)

    started = time.perf_counter()
    from fp8ops.console.app import ConsoleApp  # ipywidgets, plotly, the readers

    import_s = time.perf_counter() - started
    ConsoleApp(run, follow=False).close()  # plotly loads its validators on the first figure

    rows: list[tuple[str, float, float | None, str]] = []  # what, seconds, goal, notes

    def add(what: str, seconds: float, goal: float | None = None, notes: str = "") -> None:
        rows.append((what, seconds, goal, notes))

    apps = []
    firsts = [timed(lambda: apps.append(ConsoleApp(run, follow=False))) for _ in range(3)]
    app = apps[-1]
    store = app.run.telemetry
    assert app.message.value == "", app.message.value
    columns, modules = len(app.heatmap_fig.data[0].x), len(store.modules)
    add(
        "app built: header, first heatmap (last 10,000 steps), module view",
        statistics.median(firsts),
        GOALS_S["first"],
        f"median of 3, worst {max(firsts):.2f} s; {columns} columns x {modules} modules",
    )
    add("  of which the heatmap", timed(app.draw_heatmap))
    held = [loop_held_while_shown(run) for _ in range(3)]
    add(
        "the same in a kernel: the event loop held up",
        statistics.median(held),
        notes=f"median of 3, worst {max(held) * 1e3:.0f} ms; the reads in the worker thread",
    )

    rng = np.random.default_rng(0)
    switches = []
    for i in rng.choice(modules, args.reps, replace=False):
        switches.append(timed(lambda m=store.modules[i]: setattr(app.module, "value", m)))
        assert app.detail_fig.layout.title.text.startswith(store.modules[i])
    points = len(app.detail_fig.data[0].x)
    add(
        "switch module (its history, 7 lines, drawn)",
        statistics.median(switches),
        GOALS_S["switch"],
        f"median of {args.reps}, worst {max(switches) * 1e3:.0f} ms; "
        f"{points} points per line for {store.last_step():,} steps",
    )
    slots = [
        timed(lambda s=s: setattr(app.slot, "value", s)) for s in ("weight", "grad_output", "input")
    ]
    add("switch slot", statistics.median(slots), notes="median of 3")
    metrics = [
        timed(lambda m=m: setattr(app.metric, "value", m))
        for m in ("weight.saturation", "grad_output.underflow", "input.amax")
    ]
    add(
        "switch heatmap metric (last 10,000 steps)", statistics.median(metrics), notes="median of 3"
    )

    cold = timed(lambda: setattr(app.window, "value", 0))
    add(
        "whole-run heatmap, cold (pools every step once)",
        cold,
        notes=f"{len(app.heatmap_fig.data[0].x)} columns of 256 steps; in a kernel this runs "
        "in the worker thread",
    )
    app.metric.value = "weight.saturation"  # pooled cold too
    add(
        "whole-run heatmap, warm (its blocks in memory)",
        timed(lambda: setattr(app.metric, "value", "input.amax")),
        notes="a metric switch",
    )
    app.window.value = 10_000

    add(
        "follower poll, nothing new",
        statistics.median([timed(app.poll) for _ in range(5)]),
        notes="median of 5",
    )
    append_steps(run, 256)
    add(
        "follower poll after 256 more steps",
        timed(app.poll),
        notes=f"heatmap window and module re-read (worker thread in a kernel); "
        f"{store.last_step():,} steps now",
    )

    app.whatif_len.value = 64
    replayed = min(10_000 + 64, store.last_step())  # the last 10,000 steps and a warm-up
    add(
        "what-if: one module slot, last 10,000 steps",
        timed(app.whatif_button.click),
        notes=f"two windows: {2 * replayed:,} update_delayed_scaling calls",
    )
    assert "overflowed" in app.whatif_summary.value, app.message.value

    for view, what in ((app.heatmap_view, "heatmap"), (app.detail_view, "module view")):
        size = len(json.dumps(view.output.outputs))
        add(f"{what} sent to the page", timed(view.publish), notes=f"{size / 1e6:.2f} MB of JSON")
    for a in apps:
        a.close()

    table = Table(
        title=f"ops console, {store.last_step():,} steps x {modules} modules, "
        f"{os.cpu_count()} CPUs (import of the app: {import_s:.2f} s, once per "
        f"kernel)"
    )
    for column in ("what", "time", "goal", "notes"):
        table.add_column(column, justify="right" if column == "time" else "left")
    for what, seconds, goal, notes in rows:
        verdict = (
            ""
            if goal is None
            else (f"<= {goal * 1e3:.0f} ms " + ("ok" if seconds <= goal else "MISSED"))
        )
        table.add_row(what, _duration(seconds), verdict, notes)
    console.print(table)
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
