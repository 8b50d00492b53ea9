"""Benchmark (not a test): what each granularity of high precision costs in one linear's step.

    .venv/bin/python ci/bench_gemms.py [--shape TOKENS K N] [--recipe delayed|current|block|mxfp8]
                                       [--backend emulated|scaled_mm] [--threads N]
                                       [--rounds R] [--steps S]

One bf16 ``Fp8Linear`` (default 2048 tokens, 1024 -> 1024), a training step each (forward,
backward of a fixed gradient: fprop, dgrad and wgrad), with its GEMMs split between FP8 and
bf16 (``fp8_gemms``, the split a per-GEMM override or ``module_recipes`` entry makes): all three
in FP8; only wgrad in bf16 (Megatron's ``--no-fp8-wgrad``, torchao's ``rowwise_with_gw_hp``);
dgrad and wgrad in bf16 (saturating gradients); only fprop in bf16; all three in bf16 inside the
scope; and the module's bf16 fallback (outside the scope: ``F.linear``). The configurations are
interleaved, ``--rounds`` times ``--steps`` steps each after a warm-up step, so a burst of load
from another process lands on all of them alike: per configuration the median and the fastest
round's ms per step, and the median's ratio to all three in FP8 and to the fallback.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from fp8ops.precision import DelayedScalingRecipe, Fp8Linear, Fp8Scope, ScaledMmGemm
from fp8ops.precision.stateless import StatelessRecipe

SPLITS = {
    "all three FP8": {"fprop", "dgrad", "wgrad"},
    "wgrad bf16": {"fprop", "dgrad"},
    "dgrad + wgrad bf16": {"fprop"},
    "fprop bf16": {"dgrad", "wgrad"},
    "all three bf16 (in the scope)": set(),
}
FALLBACK = "module bf16 fallback (no scope)"
RECIPES = {
    "delayed": lambda: DelayedScalingRecipe(amax_history_len=16),
    "current": StatelessRecipe.current,
    "block": StatelessRecipe.block,
    "mxfp8": StatelessRecipe.mxfp8,
}


def step(layer, scope, x, grad) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    if scope is None:
        out = layer(x)
    else:
        with scope():
            out = layer(x)
    out.backward(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(2048, 1024, 1024))
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    parser.add_argument("--backend", choices=("emulated", "scaled_mm"), default="emulated")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens, k, n = args.shape
    recipe = RECIPES[args.recipe]()
    torch.manual_seed(0)
    gemm = ScaledMmGemm() if args.backend == "scaled_mm" else None
    layer = Fp8Linear(k, n, recipe, gemm=gemm, dtype=torch.bfloat16)
    scope = Fp8Scope(recipe)
    x = torch.randn(tokens, k, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, dtype=torch.bfloat16) * 1e-2
    configs = [*SPLITS.items(), (FALLBACK, None)]

    def run(fp8, steps: int) -> float:
        layer.fp8_gemms = frozenset(fp8 or ())
        start = time.perf_counter()
        for _ in range(steps):
            step(layer, None if fp8 is None else scope, x, grad)
        return (time.perf_counter() - start) / steps

    for _, fp8 in configs:  # warm-up (and scales past 1) before anything is timed
        run(fp8, 1)
    rounds: dict[str, list[float]] = {label: [] for label, _ in configs}
    for _ in range(args.rounds):
        for label, fp8 in configs:
            rounds[label].append(run(fp8, args.steps))
    seconds = {label: statistics.median(values) for label, values in rounds.items()}

    title = (
        f"one training step of a bf16 linear, {tokens} tokens x {k} -> {n}, "
        f"{args.recipe} scaling, {args.backend} FP8 GEMM"
    )
    table = Table(title=title)
    for column in ("GEMMs", "FP8 GEMMs", "ms (median)", "ms (fastest)", "x all FP8", "x fallback"):
        table.add_column(column, justify="right")
    for label, value in seconds.items():
        fp8 = SPLITS.get(label)
        table.add_row(
            label,
            "-" if fp8 is None else str(len(fp8)),
            f"{value * 1e3:.1f}",
            f"{min(rounds[label]) * 1e3:.1f}",
            f"{value / seconds['all three FP8']:.2f}",
            f"{value / seconds[FALLBACK]:.2f}",
        )
    console = Console()
    console.print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    console.print(table)


if __name__ == "__main__":
    main()
