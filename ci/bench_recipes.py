"""Benchmark (not a test): the cast of each scaling recipe on this CPU, and its GEMM.

    .venv/bin/python ci/bench_recipes.py [--threads N] [--min-time SECONDS] [--shape M K]
                                         [--gemm-shape M K N]

One bf16 activation-shaped tensor (tokens x hidden; default 4096 x 4096) cast to E4M3 by each
recipe's quantizer, as the emulated FP8 linear runs it: delayed scaling (the scale given: amax +
cast), current scaling (amax, scale, cast), block scaling 1x128 row-wise, its 128x1 column-wise
copy and 128x128 weight tiles, MXFP8 1x32 row-wise and 32x1 column-wise; then to NVFP4 (cast
arithmetic only, not yet a training recipe): 1x16 row-wise, the column-wise copy through the
random Hadamard transform, 16x16 weight tiles, stochastic rounding, 4over6. Median of repeated
runs (torch.utils.benchmark); millions of elements per second and the time relative to delayed.

Then one forward GEMM ``x @ W^T`` (default 1024 x 1024 x 1024, bf16 output) of each recipe's
casts on both CPU backends (current and block scaling: ``scaled_mm`` takes no MXFP8):
``emulated`` (float32 matmul of the FP8 values, or of the dequantized blocks) and ``scaled_mm``
(oneDNN's FP8 ``torch._scaled_mm``; block-scaled casts one row-wise GEMM per K block), with how
many ``_scaled_mm`` calls that takes.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.benchmark import Timer

from fp8ops.precision import E4M3, EmulatedGemm, ScaledMmGemm, block_scaled_mm_unsupported
from fp8ops.precision.blocks import BlockQuantized, quantize_mxfp8, quantize_scaled
from fp8ops.precision.nvfp4 import NVFP4Config
from fp8ops.precision.nvfp4 import quantize as nvfp4
from fp8ops.precision.quantize import cast_and_amax, quantize_current

CASTS = {
    "delayed (amax + cast, scale given)": "cast_and_amax(x, scale, E4M3)",
    "current (per tensor)": "quantize_current(x, E4M3)",
    "block 1x128 (row-wise)": "quantize_scaled(x, (1, 128), E4M3, power_2_scale=True)",
    "block 128x1 (column-wise copy)": "quantize_scaled(x, (128, 1), E4M3, power_2_scale=True)",
    "block 128x128 (weights)": "quantize_scaled(x, (128, 128), E4M3, power_2_scale=True)",
    "MXFP8 1x32 (row-wise)": "quantize_mxfp8(x, E4M3)",
    "MXFP8 32x1 (column-wise)": "quantize_mxfp8(x, E4M3, columnwise=True)",
    "NVFP4 1x16 (row-wise)": "nvfp4(x, NVFP4Config(), columnwise=False)",
    "NVFP4 1x16 + RHT (column-wise copy)": "nvfp4(x, NVFP4Config(with_rht=True), rowwise=False)",
    "NVFP4 16x16 (weights, row-wise)": "nvfp4(x, TILES, columnwise=False)",
    "NVFP4 1x16 stochastic (row-wise)": "nvfp4(x, SR, columnwise=False, generator=g)",
    "NVFP4 1x16 4over6 MAE (row-wise)": "nvfp4(x, FOUR_OVER_SIX, columnwise=False)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--shape", type=int, nargs=2, default=(4096, 4096))
    parser.add_argument("--gemm-shape", type=int, nargs=3, default=(1024, 1024, 1024))
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
        "nvfp4": nvfp4,
        "NVFP4Config": NVFP4Config,
        "TILES": NVFP4Config(with_2d_quantization=True),
        "SR": NVFP4Config(stochastic_rounding=True),
        "FOUR_OVER_SIX": NVFP4Config(nvfp4_use_4over6=True, nvfp4_e4m3_max=256),
        "g": torch.Generator().manual_seed(0),
    }
    table = Table(title=f"cast to E4M3 (NVFP4: E2M1) of a {m} x {k} bf16 tensor")
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
    console.print(gemm_table(*args.gemm_shape, min_time=args.min_time))


def gemm_table(m: int, k: int, n: int, *, min_time: float) -> Table:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    operands = {
        "current (per tensor)": (quantize_current(x, E4M3), quantize_current(w, E4M3)),
        "block 1x128 x 128x128": (
            quantize_scaled(x, (1, 128), E4M3, power_2_scale=True),
            quantize_scaled(w, (128, 128), E4M3, power_2_scale=True),
        ),
    }
    table = Table(title=f"forward GEMM {m} x {k} x {n} of the casts, bf16 output")
    for column in ("recipe", "emulated ms", "scaled_mm ms", "_scaled_mm calls"):
        table.add_column(column, justify="right")
    for label, (a, b) in operands.items():
        blocked = isinstance(a, BlockQuantized)
        times = {}
        for name, gemm in (("emulated", EmulatedGemm()), ("scaled_mm", ScaledMmGemm())):
            if name == "scaled_mm" and blocked and block_scaled_mm_unsupported():
                times[name] = "n/a"
                continue
            timer = Timer(
                stmt="gemm(a, b, torch.bfloat16)",
                globals={"gemm": gemm, "a": a, "b": b, "torch": torch},
            )
            times[name] = f"{timer.blocked_autorange(min_run_time=min_time).median * 1e3:.1f}"
        calls = -(-k // a.block[1]) if blocked else 1
        table.add_row(label, times["emulated"], times["scaled_mm"], str(calls))
    return table


if __name__ == "__main__":
    main()
