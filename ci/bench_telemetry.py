"""Benchmark (not a test): the telemetry store's write cost and read latency.

    .venv/bin/python ci/bench_telemetry.py [--steps 100000] [--modules 256] [--dir DIR]
    .venv/bin/python ci/bench_telemetry.py --layouts [--steps 100000]   # the layout comparison

Default mode, with the real ``TelemetryWriter`` and ``open_run`` (``fp8ops.telemetry``):
1. append cost in the caller, paced like a training loop (``--step-ms`` of sleep per step) so
   the background writer keeps up, and the background thread's write time per step; then the
   step time with and without telemetry when the step itself is pure Python and holds the GIL
   (the worst case for a writer thread in the same process);
2. a store of ``--steps`` x ``--modules`` x all metrics built by appending as fast as the
   writer accepts (build time, size, files), then read latencies, median of ``--reps``, each
   including ``open_run``: one module's full history, one step's snapshot, one metric over the
   last 1000 steps; then ``2047 - steps % 2048`` more steps so the module history reads the
   longest possible tail from the step-major array (its worst case).

``--layouts`` builds single arrays in candidate layouts directly with zarr (no writer) and
times the same three reads: how the store's layout was chosen (``docs/telemetry.md``).

Values are synthetic but shaped like the catalogue's: noisy amaxes, power-of-two scales,
mostly-zero saturation and NaN counts, constant GEMM counts, an error sampled every 100 steps.
The store is written under ``--dir`` (default: a temporary directory, deleted afterwards).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from rich.console import Console
from rich.table import Table
from zarr.codecs import TransposeCodec

from fp8ops.telemetry import (
    MODULE_METRIC_NAMES,
    STEP_METRIC_NAMES,
    TelemetryWriter,
    open_run,
)
from fp8ops.telemetry.catalogue import COLUMN, SLOTS
from fp8ops.telemetry.store import FLUSH_EVERY, STEPS_PER_SHARD

GOALS_MS = {"history": 100.0, "snapshot": 100.0, "window": 300.0}
GEN_BLOCK = 4096  # steps of synthetic data generated at once
RECIPE = "delayed"  # whose columns the synthetic rows fill (--recipe)
N_METRICS = len(MODULE_METRIC_NAMES)


def synthetic(first: int, steps: int, modules: int) -> np.ndarray:
    """[steps, modules, metrics] float32 telemetry-like values for steps first..first+steps-1,
    column by column by name, as a run of ``RECIPE`` fills them: delayed scaling's window
    metrics and scale changes, or a block recipe's block exponents (the other recipe's columns
    NaN, as the collector leaves them)."""
    rng = np.random.default_rng(first)
    t = np.arange(first, first + steps, dtype=np.float32)[:, None]
    m = np.arange(modules, dtype=np.float32)[None, :]
    noise = rng.standard_normal((steps, modules, 6), dtype=np.float32)
    out = np.full((steps, modules, N_METRICS), np.nan, np.float32)

    def put(name, values):
        out[..., COLUMN[name]] = values

    for s, slot in enumerate(SLOTS):
        amax = (1 + m % 17) * np.exp(0.3 * np.sin(t / 900 + m + s)) * (1 + 0.05 * noise[..., s])
        put(f"{slot}.amax", amax)
        if RECIPE == "delayed":
            scale = 448.0 / np.exp2(np.ceil(np.log2(amax * 1.02)))
            put(f"{slot}.scale", scale)
            put(f"{slot}.scale_inv", 1 / scale)
            for name, factor in (("window_max", 1.1), ("window_p50", 0.9), ("window_p90", 1.05)):
                put(f"{slot}.{name}", amax * factor)
            change = np.ones_like(scale)
            change[1:] = np.maximum(scale[1:] / scale[:-1], scale[:-1] / scale[1:])
            put(f"{slot}.scale_change", change)
        else:  # blocks: no single scale; exponents of the decode scales
            top = np.floor(np.log2(amax / 448.0))
            put(f"{slot}.block_exp_max", top)
            put(f"{slot}.block_exp_median", top - 3 - (noise[..., s] > 1))
            put(f"{slot}.block_exp_min", top - 9 - (noise[..., s] > 0))
            put(f"{slot}.blocks_at_floor", np.where(noise[..., 3 + s] > 3, 1 / 4096, 0))
        put(f"{slot}.saturation", np.where(noise[..., 3 + s] > 2.5, 1e-4, 0))  # rare
        put(f"{slot}.underflow", np.abs(noise[..., 3 + s]) * 1e-3)
        put(f"{slot}.nan", 0)
        put(f"{slot}.inf", 0)
    for k, name in enumerate(("input_norm", "weight_norm", "grad_norm")):
        put(name, np.abs(noise[..., k]) * 10)
    put("fp8_gemms", 12)
    put("fallback_gemms", 0)
    put("fp8_rel_error", np.where(t % 100 == 0, np.abs(noise[..., 5]) * 0.01, np.nan))  # sampled
    put("fp8_enabled", 1)
    return out


def step_row(step: int) -> np.ndarray:
    return np.array([2.0 / (1 + step / 1e4), 1.0, 1e-5, 0, 5e4, 0.4], np.float32)


def disk_usage(path: Path) -> tuple[int, int]:
    size = files = 0
    for folder, _, names in os.walk(path):
        for name in names:
            size += os.path.getsize(os.path.join(folder, name))
            files += 1
    return size, files


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


# ----------------------------------------------------------------------------------------
# The real writer and reader
# ----------------------------------------------------------------------------------------


def bench_append(workdir: Path, modules: list[str], steps: int, step_ms: float) -> Table:
    """The caller's cost of append() while the background writer keeps up."""
    block = synthetic(0, GEN_BLOCK, len(modules))
    calls = np.empty(steps)
    writer = TelemetryWriter(workdir / "append.zarr", rank=0, modules=modules)
    for i in range(steps):
        time.sleep(step_ms / 1e3)  # the training step (sleeping lets the writer run, like GPU work)
        started = time.perf_counter_ns()
        writer.append(i + 1, block[i % GEN_BLOCK], step_row(i + 1))
        calls[i] = time.perf_counter_ns() - started
    writer.close()
    stats = writer.stats
    table = Table(title=f"append: {steps:,} steps x {len(modules)} modules, {step_ms:g} ms/step")
    for column in (
        "caller median",
        "caller p99",
        "caller max",
        "blocked (total)",
        "background write / step",
        "flush blocks",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{np.median(calls) / 1e3:.1f} us",
        f"{np.percentile(calls, 99) / 1e3:.1f} us",
        f"{calls.max() / 1e6:.2f} ms",
        f"{stats.blocked_seconds * 1e3:.1f} ms",
        f"{stats.write_ms_per_step:.3f} ms",
        f"{stats.blocks:,}",
    )
    return table


def python_work(n: int) -> int:
    """A step that holds the GIL all along: the worst case for a background writer thread."""
    total = 0
    for i in range(n):
        total += i
    return total


def bench_gil(workdir: Path, modules: list[str], steps: int, step_ms: float) -> Table:
    """Step time with and without telemetry when the step is pure Python (an upper bound:
    torch kernels release the GIL, so a real step shares less with the writer thread).
    Off and on alternate, three rounds: the spread of the ratios shows the machine's noise."""
    n = 100_000
    started = time.perf_counter()
    python_work(n)
    n = int(n * step_ms / 1e3 / (time.perf_counter() - started))
    block = synthetic(0, GEN_BLOCK, len(modules))

    def loop(writer: TelemetryWriter | None) -> float:
        started = time.perf_counter()
        for i in range(steps):
            python_work(n)
            if writer is not None:
                writer.append(i + 1, block[i % GEN_BLOCK], step_row(i + 1))
        return (time.perf_counter() - started) / steps

    off, on = [], []
    for round_ in range(3):
        off.append(loop(None))
        writer = TelemetryWriter(workdir / f"gil{round_}.zarr", rank=0, modules=modules)
        on.append(loop(writer))
        writer.close()
    ratios = sorted(b / a - 1 for a, b in zip(off, on, strict=True))
    table = Table(
        title=f"GIL-bound step: pure Python work, {len(modules)} modules, "
        f"3 rounds of {steps:,} steps off then on"
    )
    for column in (
        "step, telemetry off",
        "step, telemetry on",
        "overhead (median)",
        "overhead, min..max of rounds",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{statistics.median(off) * 1e3:.2f} ms",
        f"{statistics.median(on) * 1e3:.2f} ms",
        f"{ratios[1] * 100:+.1f} %",
        f"{ratios[0] * 100:+.1f} .. {ratios[-1] * 100:+.1f} %",
    )
    return table


def build(path: Path, modules: list[str], steps: int) -> tuple[TelemetryWriter, dict]:
    """Append ``steps`` as fast as the writer takes them; the writer stays open (resumed later)."""
    writer = TelemetryWriter(path, rank=0, modules=modules, attrs={"bench": "bench_telemetry"})
    started = time.perf_counter()
    generating = 0.0
    for first in range(0, steps, GEN_BLOCK):
        t = time.perf_counter()
        block = synthetic(first, min(GEN_BLOCK, steps - first), len(modules))
        generating += time.perf_counter() - t
        for i, row in enumerate(block):
            writer.append(first + i + 1, row, step_row(first + i + 1))
    writer.flush()
    wall = time.perf_counter() - started
    size, files = disk_usage(path)
    return writer, {
        "wall_s": wall,
        "generate_s": generating,
        "write_ms_per_step": writer.stats.write_ms_per_step,
        "size_bytes": size,
        "files": files,
    }


def read_latencies(run_dir: Path, module: str, reps: int) -> dict[str, float]:
    """Each query opens the run afresh, as a notebook polling a live run would."""
    out = {"open": median_ms(lambda: open_run(run_dir), reps)}
    run = open_run(run_dir)
    last = run.last_step()
    out["history"] = median_ms(lambda: open_run(run_dir).module_history(module), reps)
    out["snapshot"] = median_ms(lambda: open_run(run_dir).step_snapshot(), reps)
    out["window"] = median_ms(
        lambda: open_run(run_dir).metric_window("input.amax", start=last - 999), reps
    )
    out["refresh"] = median_ms(run.refresh, reps)
    history = run.module_history(module)
    assert len(history) == last and not history.isna().all(axis=None), "history incomplete"
    return out


def bench_store(workdir: Path, modules: list[str], steps: int, reps: int, console: Console):
    run_dir = workdir / "run"
    store = run_dir / "telemetry.zarr"
    console.print(f"building {steps:,} steps x {len(modules)} modules x {N_METRICS} metrics ...")
    writer, built = build(store, modules, steps)
    module = modules[137 % len(modules)]
    reads = read_latencies(run_dir, module, reps)

    # The history query's worst case: the longest tail not yet in a module_history shard.
    extra = (STEPS_PER_SHARD - 1) - steps % STEPS_PER_SHARD
    block = synthetic(steps, max(extra, 1), len(modules))
    for i in range(extra):
        writer.append(steps + i + 1, block[i], step_row(steps + i + 1))
    writer.close()
    worst = median_ms(lambda: open_run(run_dir).module_history(module), reps)

    size_table = Table(title=f"store: {steps:,} steps x {len(modules)} modules, rank 0")
    for column in (
        "build wall",
        "of which data generation",
        "background write / step",
        "size on disk",
        "raw float32",
        "files",
    ):
        size_table.add_column(column, justify="right")
    raw = steps * len(modules) * N_METRICS * 4
    size_table.add_row(
        f"{built['wall_s']:.0f} s",
        f"{built['generate_s']:.0f} s",
        f"{built['write_ms_per_step']:.3f} ms",
        f"{built['size_bytes'] / 1e9:.2f} GB",
        f"{raw / 1e9:.2f} GB",
        f"{built['files']:,}",
    )
    read_table = Table(title=f"reads (median of {reps}, each including open_run)")
    for column in ("query", "measured", "goal"):
        read_table.add_column(column, justify="left" if column == "query" else "right")
    tail = steps % STEPS_PER_SHARD
    rows = [
        (
            f"one module, full history, all metrics ({tail} tail steps)",
            reads["history"],
            GOALS_MS["history"],
        ),
        (
            f"  same, longest tail ({STEPS_PER_SHARD - 1} steps, {steps + extra:,} steps)",
            worst,
            GOALS_MS["history"],
        ),
        ("one step, all modules (latest)", reads["snapshot"], GOALS_MS["snapshot"]),
        ("one metric, all modules, last 1000 steps", reads["window"], GOALS_MS["window"]),
        ("open_run alone", reads["open"], None),
        ("refresh() alone", reads["refresh"], None),
    ]
    for query, ms, goal in rows:
        verdict = "" if goal is None else f"<= {goal:.0f} ms " + ("ok" if ms <= goal else "MISSED")
        read_table.add_row(query, f"{ms:.1f} ms", verdict)
    return size_table, read_table


# ----------------------------------------------------------------------------------------
# --layouts: the candidates, as single arrays written directly with zarr
# ----------------------------------------------------------------------------------------

METRIC_MAJOR = [TransposeCodec(order=(2, 1, 0))]
LAYOUTS = {  # name: (chunks, shards, filters, steps per write), for L modules and M metrics
    "A  chunks 256xLxM": (lambda L: (256, L, N_METRICS), None, None, 256),
    "A' chunks 256xLxM, T": (lambda L: (256, L, N_METRICS), None, METRIC_MAJOR, 256),
    'A" chunks 256x64xM, T (module_metrics)': (
        lambda L: (256, min(64, L), N_METRICS),
        None,
        METRIC_MAJOR,
        256,
    ),
    "B  shards 2048xLxM of 2048x1xM": (
        lambda L: (2048, 1, N_METRICS),
        lambda L: (2048, L, N_METRICS),
        None,
        2048,
    ),
    "B' shards 2048xLxM of 2048x1xM, T (module_history)": (
        lambda L: (2048, 1, N_METRICS),
        lambda L: (2048, L, N_METRICS),
        METRIC_MAJOR,
        2048,
    ),
    "C  shards 4096xLxM of 4096x1xM": (
        lambda L: (4096, 1, N_METRICS),
        lambda L: (4096, L, N_METRICS),
        None,
        4096,
    ),
    "D  shards 4096xLxM of 256x1xM": (
        lambda L: (256, 1, N_METRICS),
        lambda L: (4096, L, N_METRICS),
        None,
        256,
    ),
}


def bench_layouts(workdir: Path, n_modules: int, steps: int, reps: int, console: Console):
    group = zarr.open_group(workdir / "layouts.zarr", mode="w", zarr_format=3)
    arrays, write_s = {}, {}
    for i, (name, (chunks, shards, filters, _)) in enumerate(LAYOUTS.items()):
        arrays[name] = group.create_array(
            f"a{i}",
            shape=(0, n_modules, N_METRICS),
            dtype="float32",
            fill_value=np.nan,
            chunks=chunks(n_modules),
            shards=shards(n_modules) if shards else None,
            **({"filters": filters} if filters else {}),
        )
        write_s[name] = 0.0
    console.print(f"writing {len(LAYOUTS)} layouts x {steps:,} steps ...")
    for first in range(0, steps, GEN_BLOCK):
        block = synthetic(first, min(GEN_BLOCK, steps - first), n_modules)
        for name, (*_, per_write) in LAYOUTS.items():
            array = arrays[name]
            for lo in range(0, len(block), per_write):
                rows = block[lo : lo + per_write]
                start = first + lo
                t = time.perf_counter()
                array.resize((start + len(rows), n_modules, N_METRICS))
                array[start : start + len(rows)] = rows
                write_s[name] += time.perf_counter() - t
    table = Table(
        title=f"layouts: {steps:,} steps x {n_modules} modules x {N_METRICS} metrics, "
        f"one array each, reads median of {reps} incl. open; T = metric-major "
        f"inside chunks"
    )
    table.add_column("layout", no_wrap=True)
    for column in (
        "write/step",
        "size",
        "files",
        "module history",
        "last 2047 steps",
        "step snapshot",
        "metric x 1000",
    ):
        table.add_column(column, justify="right")
    module = 137 % n_modules
    for i, name in enumerate(LAYOUTS):
        path = workdir / "layouts.zarr" / f"a{i}"

        def opened(path=path):
            return zarr.open_array(path, mode="r")

        size, files = disk_usage(path)
        cells = [
            median_ms(lambda: opened()[:, module, :], reps),
            median_ms(lambda: opened()[steps - 2047 :, module, :], reps),
            median_ms(lambda: opened()[steps - 1], reps),
            median_ms(lambda: opened()[steps - 1000 :, :, 0], reps),
        ]
        table.add_row(
            name,
            f"{1e3 * write_s[name] / steps:.3f} ms",
            f"{size / 1e9:.2f} GB",
            f"{files:,}",
            *(f"{ms:.0f} ms" for ms in cells),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--modules", type=int, default=256)
    parser.add_argument(
        "--append-steps", type=int, default=4 * 2048, help="steps of the paced append measurement"
    )
    parser.add_argument("--step-ms", type=float, default=2.0, help="simulated step time")
    parser.add_argument("--gil-steps", type=int, default=1024, help="steps of a GIL round")
    parser.add_argument("--gil-step-ms", type=float, default=10.0, help="its step time")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--recipe",
        choices=("delayed", "block"),
        default="delayed",
        help="whose metrics the rows fill: delayed scaling's, or a block recipe's",
    )
    parser.add_argument("--dir", type=Path, help="where to build (kept); default: a temp dir")
    parser.add_argument("--layouts", action="store_true", help="compare candidate layouts")
    args = parser.parse_args()
    global RECIPE
    RECIPE = args.recipe

    console = Console(width=160)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="bench_telemetry_"))
    workdir.mkdir(parents=True, exist_ok=True)
    modules = [f"decoder.layers.{i // 4}.linear_{i % 4}" for i in range(args.modules)]
    console.print(
        f"zarr {zarr.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs; flush_every "
        f"{FLUSH_EVERY}, steps_per_shard {STEPS_PER_SHARD}, {len(STEP_METRIC_NAMES)} step "
        f"metrics; in {workdir}"
    )
    try:
        if args.layouts:
            console.print(bench_layouts(workdir, args.modules, args.steps, args.reps, console))
            return
        console.print(bench_append(workdir, modules, args.append_steps, args.step_ms))
        console.print(bench_gil(workdir, modules, args.gil_steps, args.gil_step_ms))
        for table in bench_store(workdir, modules, args.steps, args.reps, console):
            console.print(table)
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
