"""Benchmark (not a test): the host's time per telemetry row, the part of telemetry's cost that a
GPU step bound by the host pays in full.

    .venv/bin/python ci/bench_telemetry_host.py [--layers N] [--steps N]

A GPU step of four 8B layers of fp8ops' FP8 linears is bound by the host (docs/gpu.md): the GPU
waits while the host queues kernels, so every microsecond the host spends on telemetry lengthens
the step. That time does not depend on the tensors' size, so it is measured here on a CPU, on a
small Megatron GPT with as many FP8 linears as the GPU check's stack (4 layers: 16), at the 8B
manifest's cadence (``manifests/llama3-8b-h100-r1.yaml``: statistics every 10 steps, the error
every 50). Timed, of each training step: ``begin_step``, ``end_step`` and finishing the row
(``result()``); the probes' work during the step is not counted (it is in the step). Rows:

* ordinary step: the FP8 state only, what 9 steps in 10 cost;
* statistics step: also the cast statistics and norms the step measured;
* mean per step at that cadence, and its share of the H200's FP8 step (docs/gpu.md, run 3:
  46.4 ms): an estimate that assumes the host there is as fast as this one.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from fp8ops.manifest import derive, load_manifest
from fp8ops.megatron import build_gpt, fp8_modules, mark_first_microbatch
from fp8ops.megatron.compat import parallel_state
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope
from fp8ops.telemetry.collector import TelemetryCollector
from fp8ops.train.distributed import _free_port

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
H200_FP8_STEP_MS = 46.4  # docs/gpu.md, run 3: four 8B layers, FP8 with compiled casts


CADENCE = load_manifest(MANIFESTS / "llama3-8b-h100-r1.yaml").telemetry


def build(layers: int):
    """A small GPT at the 8B revision's telemetry cadence, its collector and its FP8 scope."""
    manifest = derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"),
        {
            "model.num_layers": layers,
            "model.hidden_size": 64,
            "model.ffn_hidden_size": 256,
            "model.seq_length": 32,
            "model.init_checkpoint": None,
            "telemetry.every_steps": CADENCE.every_steps,
            "telemetry.error_sample_every": CADENCE.error_sample_every,
        },
        "bench_telemetry_host",
    )
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    model = build_gpt(manifest, recipe)
    return model, TelemetryCollector(fp8_modules(model), manifest.telemetry), Fp8Scope(recipe)


def telemetry_us(model, collector, scope, steps: int) -> dict[bool, list[float]]:
    """``steps`` training steps (no optimizer: its cost is not telemetry's); of each, the host's
    time in ``begin_step`` and in ``end_step().result()``, keyed by whether the step measured."""
    positions = torch.arange(32).expand(2, 32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(step))
        mark_first_microbatch(model)
        begin = time.perf_counter()
        collector.begin_step(step)
        begun = time.perf_counter()
        with scope():
            loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        end = time.perf_counter()
        collector.end_step().result()
        ended = time.perf_counter()
        model.zero_grad()
        times[step % collector.cfg.every_steps == 0].append((begun - begin + ended - end) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="GPT layers, 4 FP8 linears each (4)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps (300)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    if args.steps < CADENCE.every_steps:
        parser.error(f"--steps must be at least {CADENCE.every_steps}, so one step measures")
    torch.set_num_threads(1)  # the host's own work, not intra-op parallelism
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # Megatron's, at build

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model, collector, scope = build(args.layers)
        every = collector.cfg.every_steps
        telemetry_us(model, collector, scope, steps=every)  # warm-up
        times = telemetry_us(model, collector, scope, steps=args.steps)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    ordinary, measuring = (statistics.median(times[kind]) for kind in (False, True))
    mean = (ordinary * (every - 1) + measuring) / every
    table = Table(
        title=f"Telemetry host time per step: {len(collector.names)} FP8 linears, "
        f"statistics every {every} steps, {args.steps} steps, 1 thread"
    )
    table.add_column("step")
    table.add_column("steps", justify="right")
    table.add_column("µs (median)", justify="right")
    table.add_column(f"of a {H200_FP8_STEP_MS} ms H200 step", justify="right")
    for label, count, us in (
        ("ordinary (FP8 state only)", len(times[False]), ordinary),
        ("statistics step", len(times[True]), measuring),
        (f"mean at every_steps {every}", args.steps, mean),
    ):
        table.add_row(label, str(count), f"{us:.0f}", f"{us / (H200_FP8_STEP_MS * 1e3):.2%}")
    Console().print(table)


if __name__ == "__main__":
    main()
