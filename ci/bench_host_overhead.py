"""Benchmark (not a test): the host's time per linear layer, the cost that bounds a GPU step.

    .venv/bin/python ci/bench_host_overhead.py [--linears N] [--steps N]

On a GPU, four 8B layers of fp8ops' FP8 linears spend 35 ms of kernels per step, but the step
takes 46 to 50 ms, because the host is slower to issue the work (docs/gpu.md, ``--profile``).
That host time does not depend on the tensors' size, so it can be measured on a CPU with tiny
tensors, where the arithmetic costs next to nothing: a chain of N linears, forward and backward,
timed per linear. Rows:

* BF16: ``torch.nn.functional.linear``, what Megatron's BF16 layers run;
* the FP8 rows multiply with ``torch._scaled_mm`` (oneDNN on a CPU; the emulation where this torch
  has none), as the GPU runs did;
* FP8, eager casts: ``fp8_linear`` with the casts as eager torch operations;
* FP8, compiled casts: the same with the casts compiled (``FP8OPS_COMPILED_CASTS=all``), as
  on a GPU. On a CPU the compiled kernels are C++, not Triton, but the per-call cost of the
  compiled function is the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from fp8ops.precision import (
    DelayedScalingRecipe,
    EmulatedGemm,
    Fp8Meta,
    Fp8Scope,
    ScaledMmGemm,
    fp8_linear,
    scaled_mm_unsupported,
)
from fp8ops.precision.compiled import set_compiled_casts

WIDTH, TOKENS = 64, 32  # tiny: the arithmetic is negligible next to the host's work


def chain(kind: str, linears: int):
    """A function running one forward + backward through ``linears`` linears of ``kind``."""
    torch.manual_seed(0)
    recipe = DelayedScalingRecipe(amax_history_len=16)
    weights = [
        torch.randn(WIDTH, WIDTH, dtype=torch.bfloat16, requires_grad=True) for _ in range(linears)
    ]
    metas = [Fp8Meta.fresh(recipe) for _ in range(linears)]
    # The GPU's GEMM where torch runs it here (oneDNN on a CPU): the same calls a GPU step makes.
    gemm = ScaledMmGemm() if scaled_mm_unsupported("cpu") is None else EmulatedGemm()
    scope = Fp8Scope(recipe)

    def step() -> None:
        h = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        if kind == "bf16":
            for w in weights:
                h = torch.nn.functional.linear(h, w)
        else:
            with scope():
                for w, meta in zip(weights, metas, strict=True):
                    h, _ = fp8_linear(h, w, None, meta, scope, gemm=gemm)
        h.float().sum().backward()
        for w in weights:
            w.grad = None

    return step


def per_linear_us(kind: str, linears: int, steps: int) -> list[float]:
    """Every timed step's µs per linear (a median of them resists this machine's noise)."""
    step = chain(kind, linears)
    for _ in range(5):  # warm-up; the compiled casts compile and verify here
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) / linears * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--linears", type=int, default=16, help="linears in the chain (16)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (200; at least 2)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the quartiles need two)")
    torch.set_num_threads(1)  # the host's own work, not intra-op parallelism

    rows = []
    for label, kind, mode in (
        ("BF16 (torch linear)", "bf16", "off"),
        ("FP8, eager casts", "fp8", "off"),
        ("FP8, compiled casts", "fp8", "all"),
    ):
        old = set_compiled_casts(mode)
        try:
            rows.append((label, per_linear_us(kind, args.linears, args.steps)))
        finally:
            set_compiled_casts(old)

    table = Table(
        title=f"Host time per linear, forward + backward ({args.linears} chained, "
        f"[{TOKENS}, {WIDTH}] bf16, {args.steps} steps, 1 thread)"
    )
    table.add_column("linear")
    table.add_column("µs per linear (median)", justify="right")
    table.add_column("quartiles", justify="right")
    table.add_column("vs BF16", justify="right")
    bf16 = statistics.median(rows[0][1])
    for label, times in rows:
        low, _, high = statistics.quantiles(times, n=4)
        median = statistics.median(times)
        table.add_row(label, f"{median:.0f}", f"{low:.0f} to {high:.0f}", f"{median / bf16:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
