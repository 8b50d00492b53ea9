"""Benchmark (not a test): the cast of each scaling recipe on this CPU.

    .venv/bin/python ci/bench_recipes.py [--threads N] [--min-time SECONDS] [--shape M K]

One bf16 activation-shaped tensor (tokens x hidden; default 4096 x 4096) cast to E4M3 by each
recipe's quantizer, as the emulated FP8 linear runs it: delayed scaling (the scale given: amax +
cast), current scaling (amax, scale, cast), block scaling 1x128 row-wise, its 128x1 column-wise
copy and 128x128 weight tiles, MXFP8 1x32 row-wise and 32x1 column-wise. Median of repeated runs
(torch.utils.benchmark); millions of elements per second and the time relative to delayed.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.benchmark import Timer

from fp8ops.precision import E4M3
from fp8ops.precision.blocks import quantize_mxfp8, quantize_scaled
from fp8ops.precision.quantize import cast_and_amax, quantize_current

CASTS = {
    "delayed (amax + cast, scale given)": "cast_and_amax(x, scale, E4M3)",
    "current (per tensor)": "quantize_current(x, E4M3)",
    "block 1x128 (row-wise)": "quantize_scaled(x, (1, 128), E4M3, power_2_scale=True)",
    "block 128x1 (column-wise copy)": "quantize_scaled(x, (128, 1), E4M3, power_2_scale=True)",
    "block 128x128 (weights)": "quantize_scaled(x, (128, 128), E4M3, power_2_scale=True)",
    "MXFP8 1x32 (row-wise)": "quantize_mxfp8(x, E4M3)",
    "MXFP8 32x1 (column-wise)": "quantize_mxfp8(x, E4M3, columnwise=True)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    m, k = args.shape
    x = (torch.randn(m, k) * torch.logspace(-3, 3, m).unsqueeze(1)).to(torch.bfloat16)
    names = {
        "x": x,
        "scale": torch.tensor(3.0),
        "E4M3": E4M3,
        "cast_and_amax": cast_and_amax,
        "quantize_current": quantize_current,
        "quantize_scaled": quantize_scaled,
        "quantize_mxfp8": quantize_mxfp8,
    }
    table = Table(title=f"cast to E4M3 of a {m} x {k} bf16 tensor")
    for column in ("recipe", "ms", "Melem/s", "x delayed"):
        table.add_column(column, justify="right")
    base = None
    for label, stmt in CASTS.items():
        seconds = Timer(stmt=stmt, globals=names).blocked_autorange(min_run_time=args.min_time)
        seconds = seconds.median
        base = base or seconds
        table.add_row(
            label, f"{seconds * 1e3:.1f}", f"{m * k / seconds / 1e6:.0f}", f"{seconds / base:.2f}"
        )
    console = Console()
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    console.print(table)


if __name__ == "__main__":
    main()
