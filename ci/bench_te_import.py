"""Benchmark (not a test): importing Transformer Engine debug statistics logs, and the console
on the imported run.

    .venv/bin/python ci/bench_te_import.py [--layers 32] [--steps 1000] [--ranks 2] [--reps 3]
                                           [--dir DIR]

Writes a synthetic run's logs as nvdlfw_inspect 0.2.2's default statistics logger does
(``FileLogger``: ``%(asctime)s - %(levelname)s - `` then ``{name} \\t\\t\\t\\t
iteration={:06d} \\t\\t\\t\\t value={:.4f}``; tests/test_te_import.py imports logs written by
nvdlfw_inspect itself): ``--layers`` transformer layers of 4 GEMMs (qkv, proj, fc1, fc2), each
logging 3 tensors (activation, weight, gradient) x 6 stats (LogTensorStats ``cur_amax`` and
``l2_norm``; LogFp8TensorStats ``underflows%``, ``overflows%``, ``scale_inv_max``, ``mse``, as
under delayed scaling) at every one of ``--steps`` iterations, on ``--ranks`` ranks: 2.3 M lines
per rank by default. Then times, each the median of ``--reps``:

* parsing the logs alone (``read_rank_log``, every rank);
* the whole import (parse, checks, the store through TelemetryWriter, the run records, the
  rename), and the same with the alert rules of manifests/tiny-gpt-cpu.yaml replayed;
* the console on the imported run: the app built until its header, first heatmap (the last
  10,000 steps) and the first module's history are drawn, as ci/bench_console.py times it, and
  the read behind it alone (``read_run``).

Prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from fp8ops.te_import import import_te_debug
from fp8ops.te_import.logs import NameTable, find_rank_files, read_rank_log
from fp8ops.telemetry import open_run

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"
GEMMS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1")
GEMMS += ("mlp.linear_fc2",)
TENSORS = ("activation", "weight", "gradient")
STATS = ("cur_amax", "l2_norm", "underflows%", "overflows%", "scale_inv_max", "mse")
TEMPLATE = "{} - INFO - {} \t\t\t\t iteration={:06d} \t\t\t\t value={:.4f}\n"  # FileLogger's


def write_logs(log_dir: Path, layers: int, steps: int, ranks: int) -> tuple[int, int]:
    """The logs of every rank (identical values: TE reduces them); (lines, bytes) in all."""
    names = [
        f"model.decoder.layers.{n + 1}.{gemm}_{tensor}_{stat}"
        for n in range(layers)
        for gemm in GEMMS
        for tensor in TENSORS
        for stat in STATS
    ]
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.5, 8, len(names))
    folder = log_dir / "nvdlfw_inspect_statistics_logs"
    folder.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(open(folder / f"nvdlfw_inspect_globalrank-{r}.log", "w"))
            for r in range(ranks)
        ]
        for step in range(steps):
            stamp = f"2026-12-07 10:{step // 60 % 60:02d}:{step % 60:02d},000"
            values = scale * (1 + 0.01 * rng.standard_normal(len(names)))
            text = "".join(
                TEMPLATE.format(stamp, name, step, value)
                for name, value in zip(names, values, strict=True)
            )
            for file in files:
                file.write(text)
    size = sum(p.stat().st_size for p in folder.iterdir())
    return ranks * steps * len(names), size


def timed(fn, reps: int) -> tuple[float, float, object]:
    """Median and worst seconds of ``reps`` calls, and the last call's result."""
    times, result = [], None
    for _ in range(reps):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), max(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (kept afterwards)")
    args = parser.parse_args()
    if min(args.layers, args.steps, args.ranks, args.reps) < 1:
        parser.error("--layers, --steps, --ranks and --reps must be at least 1")
    console = Console(width=150)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="bench_te_import_"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    started = time.perf_counter()
    lines, size = write_logs(logs, args.layers, args.steps, args.ranks)
    console.print(
        f"wrote {lines:,} lines ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s"
    )
    rows: list[tuple[str, float, float, str]] = []

    def parse_all() -> int:
        table = NameTable()
        return sum(
            len(read_rank_log(path, rank, table, print, lambda name, where: True).names)
            for rank, path in find_rank_files(logs).items()
        )

    median, worst, parsed = timed(parse_all, args.reps)
    assert parsed == lines, (parsed, lines)
    rows.append(("parse the logs", median, worst, f"{lines / median:,.0f} lines/s"))

    run = workdir / "run"

    def import_once(manifest=None):
        shutil.rmtree(run, ignore_errors=True)
        return import_te_debug(logs, run, manifest=manifest, command=["bench"])

    median, worst, result = timed(import_once, args.reps)
    assert result.lines == lines and not result.warnings, result.warnings
    store = sum(f.stat().st_size for f in (run / "telemetry.zarr").rglob("*") if f.is_file())
    rows.append(
        (
            "import: parse, checks, store, records",
            median,
            worst,
            f"{lines / median:,.0f} lines/s; {len(result.modules)} modules x "
            f"{len(open_run(run).metrics)} metrics x {args.steps} steps x {args.ranks} ranks; "
            f"store {store / 1e6:.1f} MB",
        )
    )
    median, worst, result = timed(lambda: import_once(MANIFEST), args.reps)
    rows.append(
        (
            "import with the alert rules replayed",
            median,
            worst,
            f"{lines / median:,.0f} lines/s; {len(result.replay.alerts)} alerts",
        )
    )

    from fp8ops.console.app import ConsoleApp, read_run  # ipywidgets, plotly

    ConsoleApp(run, follow=False).close()  # plotly loads its validators on the first figure
    apps = []
    median, worst, _ = timed(lambda: apps.append(ConsoleApp(run, follow=False)), args.reps)
    app = apps[-1]
    assert app.message.value == "" and "imported" in app.header.value, app.message.value
    columns = len(app.heatmap_fig.data[0].x)
    rows.append(
        (
            "console: app built, header, first heatmap, module view",
            median,
            worst,
            f"{columns} columns x {len(app.module.options)} modules",
        )
    )
    median, worst, _ = timed(lambda: read_run(run, "input.amax", 10_000, "input"), args.reps)
    rows.append(("  of which the read (read_run)", median, worst, "header, heatmap, history"))
    for a in apps:
        a.close()

    table = Table(
        title=f"TE debug log import: {args.layers} layers x 4 GEMMs x 3 tensors x "
        f"{len(STATS)} stats x {args.steps} steps x {args.ranks} ranks, {os.cpu_count()} CPUs "
        f"(median of {args.reps})"
    )
    for column in ("what", "time", "worst", "notes"):
        table.add_column(column, justify="right" if column in ("time", "worst") else "left")
    for what, median, worst, notes in rows:
        table.add_row(what, f"{median:.2f} s", f"{worst:.2f} s", notes)
    console.print(table)
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
