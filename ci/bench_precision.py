"""Benchmark (not a test): FP8 quantize throughput and the emulated FP8 linear's overhead.

    .venv/bin/python ci/bench_precision.py [--threads N] [--min-time SECONDS]

Prints two tables measured on this CPU with torch.utils.benchmark (median of repeated runs):
1. quantize() with statistics and the hot-path cast (amax + saturating cast only), in
   millions of elements per second;
2. one training step of a linear layer (forward + backward) in float32 vs the emulated FP8
   linear inside an Fp8Scope (casts, amax bookkeeping, dequantize-matmul, scale updates).
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.benchmark import Timer

from fp8ops.precision import E4M3, DelayedScalingRecipe, Fp8Linear, Fp8Scope, amax_of, quantize
from fp8ops.precision.formats import saturating_cast

QUANTIZE_SIZES = [2**16, 2**20, 2**22]
LINEAR_SHAPES = [  # (tokens, in_features, out_features)
    (256, 256, 1024),
    (1024, 1024, 1024),
    (2048, 1024, 4096),
]


def median_seconds(stmt: str, min_time: float, **names) -> float:
    return Timer(stmt=stmt, globals=names).blocked_autorange(min_run_time=min_time).median


def bench_quantize(min_time: float) -> Table:
    table = Table(title="quantize (E4M3), Melem/s")
    for column in ("elements", "with stats", "amax + cast only", "torch .to(fp8) only"):
        table.add_column(column, justify="right")
    scale = torch.tensor(3.0)
    for n in QUANTIZE_SIZES:
        x = torch.randn(n)
        rates = [
            n / median_seconds(stmt, min_time, x=x, scale=scale, **helpers) / 1e6
            for stmt, helpers in (
                ("quantize(x, scale, E4M3)", {"quantize": quantize, "E4M3": E4M3}),
                (
                    "amax_of(x); saturating_cast(x, scale, E4M3)",
                    {"amax_of": amax_of, "saturating_cast": saturating_cast, "E4M3": E4M3},
                ),
                ("(x * scale).to(torch.float8_e4m3fn)", {"torch": torch}),
            )
        ]
        table.add_row(f"{n:,}", *(f"{r:,.0f}" for r in rates))
    return table


def train_step(layer, scope, x):
    layer.zero_grad(set_to_none=True)
    if scope is None:
        out = layer(x)
    else:
        with scope():
            out = layer(x)
    out.sum().backward()


def bench_linear(min_time: float) -> Table:
    table = Table(title="linear forward + backward, ms per step")
    for column in ("tokens x in x out", "fp32 nn.Linear", "emulated FP8", "overhead"):
        table.add_column(column, justify="right")
    recipe = DelayedScalingRecipe(amax_history_len=16)
    for tokens, fan_in, fan_out in LINEAR_SHAPES:
        x = torch.randn(tokens, fan_in)
        plain = torch.nn.Linear(fan_in, fan_out)
        fp8 = Fp8Linear(fan_in, fan_out, recipe)
        scope = Fp8Scope(recipe)
        base = median_seconds("step(layer, None, x)", min_time, step=train_step, layer=plain, x=x)
        emulated = median_seconds(
            "step(layer, scope, x)", min_time, step=train_step, layer=fp8, scope=scope, x=x
        )
        table.add_row(
            f"{tokens} x {fan_in} x {fan_out}",
            f"{base * 1e3:.2f}",
            f"{emulated * 1e3:.2f}",
            f"{emulated / base:.2f}x",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    console.print(bench_quantize(args.min_time))
    console.print(bench_linear(args.min_time))


if __name__ == "__main__":
    main()
