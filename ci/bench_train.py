"""Benchmark (not a test): training throughput and peak memory, BF16 vs FP8 at TP=1 and TP=2.

    .venv/bin/python ci/bench_train.py [--steps 40] [--warmup 5] [--repeats 1]
        [--configs bf16-tp1,fp8-tp1,bf16-tp2,fp8-tp2] [--threads N] [--json PATH]
        [--build-base] [--set KEY=VALUE ...]

Runs the real command (``python -m fp8ops train manifests/tiny-gpt-cpu.yaml``, the CPU default's
FP8 fine-tuning) once per configuration and repeat, each in its own process and temporary run
directory, with ``--set`` overrides for a short run: ``schedule.train_steps=STEPS``, no mid-run
evaluation (the one at the last step still runs, on a single micro-batch), and for BF16
``precision.enabled=false``. TP=2 starts two ranks with ``torch.distributed.run --standalone``
and ``--set topology.tensor_parallel=2``. From each run's ``metrics.jsonl`` (one line per
optimizer step, written by rank 0) it drops the first WARMUP steps and reports the median step
time (as steps/s and ms/step), the median tokens/s (the whole global batch: 16 sequences of 128
tokens), and the largest ``peak_memory_mib`` (rank 0's peak resident set size on a CPU; it
includes imports, the base checkpoint load and the data); plus the wall time of the whole
process (start-up, Megatron import, model build, checkpoint load, the steps, final evaluation
and save). With ``--repeats`` > 1 each cell shows min..max over the repeats, and the FP8/BF16
slowdown pairs FP8 and BF16 runs of the same repeat (they run back to back).

Read the numbers for what they are:

* On a CPU the FP8 GEMMs are emulated (quantize to FP8 with amax statistics, dequantize,
  matmul in float32, round to bf16, plus the scale updates of delayed scaling) where BF16 runs
  plain bf16 matmuls, so FP8 is slower than BF16 here by design. The slowdown column measures
  the emulation's overhead, not FP8 speed; on a GPU with Transformer Engine, FP8 GEMMs run on
  FP8 tensor cores and the comparison is different.
* The model is tiny (hidden size 128, 4 layers, 2,048 tokens a step): the ratios say nothing
  about a real model's.
* TP=2 runs two processes on the same machine. With the CPU default's 2 cores both ranks share
  them (each rank gets THREADS/2 threads, 1 here, where the TP=1 process gets all of them), so
  TP=2 measures the cost of splitting the model and its gloo collectives, not a speed-up.
* Other load on the machine shows up directly in the timings; the machine line gives the load
  average at start and at end. Use --repeats to see the spread.

The base checkpoint (``model.init_checkpoint`` of the manifest, ``runs/tiny-gpt-cpu-base/final``)
must exist: without it the script says how to make it and exits 2; ``--build-base`` trains it
first (``fp8ops train manifests/tiny-gpt-cpu-base.yaml``, about 1.5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from fp8ops.checkpoint.weights import read_weights_meta
from fp8ops.errors import Fp8opsError
from fp8ops.files import read_jsonl
from fp8ops.manifest import load_manifest
from fp8ops.train.cpu_gemm import CHOICE_VARIABLE, cpu_bf16_gemm

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "manifests/tiny-gpt-cpu.yaml"
BASE_MANIFEST = "manifests/tiny-gpt-cpu-base.yaml"


@dataclass(frozen=True)
class Config:
    precision: str  # "bf16" or "fp8"
    tp: int

    @property
    def name(self) -> str:
        return f"{self.precision}-tp{self.tp}"


CONFIGS = [Config("bf16", 1), Config("fp8", 1), Config("bf16", 2), Config("fp8", 2)]


@dataclass
class Measurement:
    """One run of one configuration."""

    seconds_per_step: float  # median over the measured steps
    tokens_per_s: float  # median over the measured steps
    peak_rss_mib: float  # max over every logged step (rank 0)
    wall_s: float  # the whole process (or torchrun and its ranks)
    measured_steps: int

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.seconds_per_step

    def as_dict(self) -> dict:
        return {
            "steps_per_s": self.steps_per_s,
            "ms_per_step": self.seconds_per_step * 1e3,
            "tokens_per_s": self.tokens_per_s,
            "peak_rss_mib": self.peak_rss_mib,
            "wall_s": self.wall_s,
            "measured_steps": self.measured_steps,
        }


@dataclass
class Result:
    config: Config
    runs: list[Measurement] = field(default_factory=list)


def python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def train_command(
    config: Config, run_dir: Path, steps: int, lr_warmup: int, extra: list[str] = ()
) -> list[str]:
    launcher = [python()]
    if config.tp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(config.tp)]
    overrides = [
        f"schedule.train_steps={steps}",
        f"schedule.warmup_steps={lr_warmup}",
        "schedule.eval_interval=1000000",  # no mid-run evaluation; the last step still evaluates
        "schedule.eval_iters=1",
    ]
    if config.precision == "bf16":
        overrides.append("precision.enabled=false")
    if config.tp > 1:
        overrides.append(f"topology.tensor_parallel={config.tp}")
    overrides += extra
    command = launcher + ["-m", "fp8ops", "train", MANIFEST, "--run-dir", str(run_dir)]
    command.append("--no-progress")
    for assignment in overrides:
        command += ["--set", assignment]
    return command


def run_once(
    config: Config,
    run_dir: Path,
    *,
    steps: int,
    warmup: int,
    lr_warmup: int,
    threads: int,
    console: Console,
    extra: list[str] = (),
) -> Measurement:
    command = train_command(config, run_dir, steps, lr_warmup, extra)
    env = dict(os.environ)
    # Explicit, so TP=1 and TP=2 use the same cores in total (torchrun would set 1 per rank).
    env["OMP_NUM_THREADS"] = str(max(1, threads // config.tp))
    log_path = run_dir.with_suffix(".log")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.run(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        )
    wall = time.perf_counter() - started
    if process.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        console.print(f"{config.name} failed (exit {process.returncode}): {' '.join(command)}")
        console.print(tail, markup=False, highlight=False)
        raise SystemExit(1)
    records = read_jsonl(run_dir / "metrics.jsonl")
    if len(records) != steps:
        raise SystemExit(f"{config.name}: metrics.jsonl has {len(records)} steps, expected {steps}")
    measured = records[warmup:]
    return Measurement(
        seconds_per_step=statistics.median(r["seconds"] for r in measured),
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in measured),
        peak_rss_mib=max(r["peak_memory_mib"] for r in records),
        wall_s=wall,
        measured_steps=len(measured),
    )


def ensure_base(build: bool, console: Console) -> None:
    """Exit 2 unless the manifest's base checkpoint is usable; ``build``: train it if missing."""
    path = load_manifest(REPO / MANIFEST).model.init_checkpoint
    if path is None:
        return
    field_name = f"{MANIFEST}: model.init_checkpoint"

    def problem() -> str | None:
        try:
            read_weights_meta(REPO / path, field=field_name)
        except Fp8opsError as exc:
            return str(exc)
        return None

    def refuse(*lines: str) -> None:
        for line in lines:
            console.print(line, markup=False, highlight=False)
        raise SystemExit(2)

    error = problem()
    if error is None:
        return
    hint = f"`.venv/bin/fp8ops train {BASE_MANIFEST}` from the repository root"
    if (REPO / path).exists():  # there, but not usable: never delete or overwrite it here
        refuse(error, f"Move its run directory aside and rebuild it with {hint} (or --build-base).")
    if not build:
        refuse(error, f"Build it with {hint} (about 1.5 min on 2 cores), or use --build-base.")
    console.print(f"building the base checkpoint {path} ({BASE_MANIFEST}) ...")
    command = [python(), "-m", "fp8ops", "train", BASE_MANIFEST, "--no-progress"]
    if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
        refuse(f"building the base failed: {' '.join(command)}")
    error = problem()
    if error is not None:
        refuse(error)


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def machine_line(threads: int, load_at_start: float) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = (line.split(":", 1)[1] for line in info if line.startswith("model name"))
            model = next(names).strip()
    except (OSError, StopIteration):
        pass
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    gemm = cpu_bf16_gemm(torch.device("cpu"))
    return (
        f"{model}, {cpus} CPUs ({usable} usable), load avg {load_at_start:.2f} at start, "
        f"{load_average():.2f} at end; bf16 GEMMs {gemm} ({CHOICE_VARIABLE}: "
        f"{os.environ.get(CHOICE_VARIABLE) or 'unset, the CPU decides'}); "
        f"torch {torch.__version__}, {threads} threads in all: TP=1 one process x {threads}, "
        f"TP=2 two processes x {max(1, threads // 2)}"
    )


def span(values: list[float], fmt: str) -> str:
    if len(values) == 1 or min(values) == max(values):
        return format(values[0], fmt)
    return f"{format(min(values), fmt)}..{format(max(values), fmt)}"


def slowdowns(results: dict[str, Result], config: Config) -> list[float] | None:
    """FP8 ms/step over BF16 ms/step at the same TP, one per repeat (runs of a repeat pair up)."""
    reference = results.get(Config("bf16", config.tp).name)
    if config.precision != "fp8" or reference is None:
        return None
    return [
        fp8.seconds_per_step / bf16.seconds_per_step
        for fp8, bf16 in zip(results[config.name].runs, reference.runs)
    ]


def results_table(results: dict[str, Result], args) -> Table:
    repeats = "" if args.repeats == 1 else f", min..max over {args.repeats} repeats"
    table = Table(
        title=f"fp8ops train {MANIFEST}{''.join(f' --set {a}' for a in args.extra)}: "
        f"{args.steps} steps, first {args.warmup} dropped, "
        f"medians per run{repeats}"
    )
    for column in (
        "config",
        "precision",
        "TP",
        "steps/s",
        "tokens/s",
        "ms/step",
        "peak RSS MiB (rank 0)",
        "wall s",
        "FP8/BF16 slowdown",
    ):
        table.add_column(column, justify="left" if column in ("config", "precision") else "right")
    for result in results.values():
        runs, config = result.runs, result.config
        slowdown = slowdowns(results, config)
        if slowdown is not None:
            slowdown_text = span(slowdown, ".2f") + "x"
        else:
            slowdown_text = "ref" if config.precision == "bf16" else "-"
        table.add_row(
            config.name,
            "BF16" if config.precision == "bf16" else "FP8 (emulated)",
            str(config.tp),
            span([m.steps_per_s for m in runs], ".2f"),
            span([m.tokens_per_s for m in runs], ",.0f"),
            span([m.seconds_per_step * 1e3 for m in runs], ".1f"),
            span([m.peak_rss_mib for m in runs], ",.0f"),
            span([m.wall_s for m in runs], ".1f"),
            slowdown_text,
        )
    return table


def parse_configs(values: list[str]) -> list[Config]:
    known = {c.name: c for c in CONFIGS}
    wanted = {name.strip() for value in values for name in value.split(",") if name.strip()}
    unknown = sorted(wanted - known.keys())
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return [c for c in CONFIGS if c.name in wanted]  # always in the canonical order


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="On a CPU FP8 is emulated, so it is slower than BF16 by design: see the docstring.",
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of a run not measured")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=[",".join(c.name for c in CONFIGS)],
        metavar="NAME",
        help=f"subset to run, comma- or space-separated: {', '.join(c.name for c in CONFIGS)}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads in all, split over the ranks (default: torch's, %(default)s here)",
    )
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a manifest override for every run, after the benchmark's own (e.g. "
        "data.pad_to=longest); repeatable",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--build-base", action="store_true", help="train the base checkpoint first if missing"
    )
    args = parser.parse_args()
    try:
        configs = parse_configs(args.configs)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.warmup < 0 or args.warmup >= args.steps:
        parser.error("need --steps >= 1 and 0 <= --warmup < --steps")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")

    console = Console(width=None if sys.stdout.isatty() else 140)  # piped: room for the table
    log = Console(stderr=True, highlight=False)
    ensure_base(args.build_base, log)
    manifest_warmup = load_manifest(REPO / MANIFEST).schedule.warmup_steps
    lr_warmup = min(manifest_warmup, args.steps)  # the schema wants warmup_steps <= train_steps
    load_at_start = load_average()

    results = {c.name: Result(c) for c in configs}
    with tempfile.TemporaryDirectory(prefix="fp8ops-bench-train-") as tmp:
        for repeat in range(args.repeats):
            for config in configs:  # interleaved, so slow patches of the machine hit every config
                label = config.name
                if args.repeats > 1:
                    label += f" (repeat {repeat + 1}/{args.repeats})"
                log.print(f"running {label} ...", end=" ")
                measurement = run_once(
                    config,
                    Path(tmp) / f"{config.name}-r{repeat}",
                    steps=args.steps,
                    warmup=args.warmup,
                    lr_warmup=lr_warmup,
                    threads=args.threads,
                    console=log,
                    extra=args.extra,
                )
                results[config.name].runs.append(measurement)
                log.print(
                    f"{measurement.seconds_per_step * 1e3:.1f} ms/step, "
                    f"{measurement.wall_s:.1f} s wall"
                )

    machine = machine_line(args.threads, load_at_start)
    if args.json:
        document = {
            "machine": machine,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "manifest": MANIFEST,
            "set": args.extra,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "note": "CPU: FP8 GEMMs are emulated (quantize, dequantize, matmul); the slowdown "
            "is the emulation's overhead, not FP8 speed",
            "results": [
                {
                    "config": r.config.name,
                    "precision": r.config.precision,
                    "tensor_parallel": r.config.tp,
                    "runs": [m.as_dict() for m in r.runs],
                    "fp8_over_bf16": slowdowns(results, r.config),
                }
                for r in results.values()
            ],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        log.print(f"wrote {args.json}")

    console.print(machine, markup=False, highlight=False)
    console.print(results_table(results, args))


if __name__ == "__main__":
    main()
