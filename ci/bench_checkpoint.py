"""Benchmark (not a test): training checkpoints of the CPU default, saved, loaded and refused.

    .venv/bin/python ci/bench_checkpoint.py [--steps 6] [--repeats 5] [--base PATH | --short-base]
        [--json PATH]

Runs the real commands, each in its own process, in a temporary directory:

1. ``fp8ops train manifests/tiny-gpt-cpu.yaml --stop-at STEPS`` with a checkpoint after every
   step (``--set schedule.checkpoint_interval=1``): **save** seconds from each
   ``checkpoint_saved`` event (the first save of a process on its own: it was where Megatron's
   writer started a multiprocessing Manager, an interpreter importing torch, until fp8ops kept the
   write results in the saving process), and the **size** of the last checkpoint.
2. ``fp8ops resume RUN_DIR --stop-at N+1``, REPEATS times (each continues from the checkpoint
   the previous one saved): **load** seconds from the ``resumed`` event (every file re-hashed,
   the pickles checked, the shards read, weights and FP8 state re-verified), and the wall time
   from starting the process to the first resumed step in ``metrics.jsonl``.
3. Refusals, REPEATS times each: ``fp8ops resume`` of a copy whose latest checkpoint claims
   another torch (``environment.torch`` rewritten in ``fp8ops_checkpoint.json``), and
   ``fp8ops train EDITED --resume`` with ``optimizer.lr`` changed. Both must exit 4, from the
   JSON alone, before torch.distributed or Megatron are started: goal 2 s or less. The start-up
   floor (``python -m fp8ops --help``) is measured alongside.

Read the numbers for what they are: a CPU, a tiny model (hidden size 128, 4 layers: a
checkpoint of about 12 MiB, bf16 weights plus float32 main weights and AdamW's two moments),
local disk. Save and load times are
dominated by fixed costs (processes, fsync, hashing), not by bytes; the refusal by Python's
start-up and imports (torch is imported to fingerprint the environment).

The fine-tuning needs its base (``model.init_checkpoint``, ``runs/tiny-gpt-cpu-base/final``).
Without it, or with ``--short-base``, the script pre-trains a base for 20 steps in the
temporary directory (about 20 s on 2 cores; its quality does not matter here); ``--base PATH``
names another one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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

from fp8ops.checkpoint import CheckpointDir
from fp8ops.checkpoint.directory import META_FILE
from fp8ops.checkpoint.weights import read_weights_meta
from fp8ops.errors import Fp8opsError
from fp8ops.files import read_jsonl
from fp8ops.manifest import derive, load_manifest, write_manifest

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "manifests/tiny-gpt-cpu.yaml"
BASE_MANIFEST = "manifests/tiny-gpt-cpu-base.yaml"
GOAL_S = 2.0  # a drifted resume is refused within this, before any model is built
SHORT_BASE_STEPS = 20


@dataclass
class Row:
    """One measurement: its values (seconds or MiB), and what to say next to them."""

    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    goal: float | None = None
    note: str = ""

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "unit": self.unit,
            "values": self.values,
            "median": statistics.median(self.values),
            "max": max(self.values),
            "goal": self.goal,
            "note": self.note,
        }


def python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def fp8ops(*args: object) -> list[str]:
    return [python(), "-m", "fp8ops", *map(str, args)]


def run(command: list[str], log: Path, *, expect: int = 0) -> float:
    """Run ``command`` from the repository root; its wall seconds. Exits if its code is not
    ``expect``, with the end of its output."""
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != expect:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"exit {done.returncode} (expected {expect}): {' '.join(command)}\n{tail}")
    return seconds


def resolve_base(args, tmp: Path, log: Console) -> Path:
    """The base weights to fine-tune from: --base, the manifest's own, or a short one made here."""
    if args.base is not None:
        read_weights_meta(args.base, field="--base")  # exits 2 with the reason if unusable
        return args.base.resolve()
    default = REPO / load_manifest(REPO / MANIFEST).model.init_checkpoint
    if not args.short_base:
        try:
            read_weights_meta(default, field=f"{MANIFEST}: model.init_checkpoint")
            return default
        except Fp8opsError as exc:
            print(exc, file=sys.stderr)
    log.print(f"pre-training a short base ({SHORT_BASE_STEPS} steps of {BASE_MANIFEST}) ...")
    run_dir = tmp / "base"
    run(
        fp8ops(
            "train",
            BASE_MANIFEST,
            "--run-dir",
            run_dir,
            "--no-progress",
            "--set",
            f"schedule.train_steps={SHORT_BASE_STEPS}",
            "--set",
            f"schedule.warmup_steps={SHORT_BASE_STEPS // 2}",
            "--set",
            f"schedule.eval_interval={SHORT_BASE_STEPS}",
        ),
        tmp / "base.log",
    )
    return run_dir / "final"


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == kind]


def measure_saves(run_dir: Path, base: Path, steps: int, tmp: Path) -> tuple[Row, Row, Row]:
    run(
        fp8ops(
            "train",
            MANIFEST,
            "--run-dir",
            run_dir,
            "--no-progress",
            "--stop-at",
            steps,
            "--set",
            f"model.init_checkpoint={base}",
            "--set",
            "schedule.checkpoint_interval=1",
            "--set",
            "schedule.keep_checkpoints=2",
        ),
        tmp / "train.log",
    )
    seconds = [e["seconds"] for e in events(run_dir, "checkpoint_saved")]
    latest = CheckpointDir(run_dir).latest()
    files = [f for f in latest.rglob("*") if f.is_file()]
    shards = [f for f in files if f.suffix == ".distcp"]
    mib = sum(f.stat().st_size for f in files) / 2**20
    note = (
        f"{len(files)} files: {len(shards)} shards "
        f"{sum(f.stat().st_size for f in shards) / 2**20:.2f} MiB, .metadata "
        f"{(latest / '.metadata').stat().st_size / 2**10:.0f} KiB, {META_FILE} "
        f"{(latest / META_FILE).stat().st_size / 2**10:.1f} KiB"
    )
    return (
        Row(
            "save, first of a process",
            "s",
            seconds[:1],
            note="the first in its process (no Manager interpreter: fp8ops.checkpoint.sharded_io)",
        ),
        Row(
            "save, later ones",
            "s",
            seconds[1:],
            note="shards, sha256 of every file, fsync, rename, `latest`, oldest deleted",
        ),
        Row("checkpoint size", "MiB", [mib], note=note),
    )


def measure_resumes(run_dir: Path, steps: int, repeats: int, tmp: Path) -> tuple[Row, Row]:
    """``fp8ops resume --stop-at N+1``, each from the checkpoint the one before saved."""
    load = Row(
        "load (in the resumed process)",
        "s",
        note="verify files and pickles, read shards, re-verify weights and FP8 state",
    )
    first_step = Row(
        "resume: start to first step", "s", note="interpreter, imports, model build, load, one step"
    )
    metrics = run_dir / "metrics.jsonl"
    for repeat in range(repeats):
        logged = len(read_jsonl(metrics))
        log_path = tmp / f"resume{repeat}.log"
        command = fp8ops("resume", run_dir, "--stop-at", steps + repeat + 1, "--no-progress")
        started = time.perf_counter()
        with open(log_path, "w") as out:
            process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            # A step's line is written when the step is done: here, after the load and one step.
            while len(read_jsonl(metrics)) == logged and process.poll() is None:
                time.sleep(0.01)
            first_step.values.append(time.perf_counter() - started)
            if process.wait() != 0:
                raise SystemExit(f"resume failed:\n{log_path.read_text()[-3000:]}")
        load.values.append(events(run_dir, "resumed")[-1]["load_seconds"])
    return load, first_step


def measure_refusals(run_dir: Path, repeats: int, tmp: Path) -> tuple[Row, Row, Row]:
    """Drifted resumes, each refused with exit 4; and the start-up floor."""
    drifted = tmp / "drifted"
    shutil.copytree(run_dir, drifted)
    record = CheckpointDir(drifted).latest() / META_FILE
    meta = json.loads(record.read_text())
    meta["environment"]["torch"] = "0.0.0+bench"  # not in its own hash list
    record.write_text(json.dumps(meta, indent=2) + "\n")
    manifest = load_manifest(run_dir / "manifest.yaml")
    lr = manifest.optimizer.lr
    edited = write_manifest(
        derive(manifest, {"optimizer.lr": lr / 2}, "bench: drift"), tmp / "edited.yaml"
    )
    refusals = [
        (
            Row(
                "refusal: environment drift",
                "s",
                goal=GOAL_S,
                note="fp8ops resume, torch version rewritten in the JSON",
            ),
            fp8ops("resume", drifted, "--no-progress"),
            "environment torch: '0.0.0+bench'",
        ),
        (
            Row(
                "refusal: manifest drift",
                "s",
                goal=GOAL_S,
                note="fp8ops train EDITED --resume, optimizer.lr changed",
            ),
            fp8ops("train", edited, "--resume", "--run-dir", run_dir, "--no-progress"),
            f"optimizer.lr: {lr!r} -> {lr / 2!r}",
        ),
    ]
    floor = Row("start-up floor", "s", note="python -m fp8ops --help")
    log = tmp / "refusal.log"
    for _ in range(repeats):  # interleaved, so a slow patch of the machine hits every row
        for row, command, expected in refusals:
            row.values.append(run(command, log, expect=4))
            if expected not in log.read_text():
                raise SystemExit(f"refused, but not for the drift injected:\n{log.read_text()}")
        floor.values.append(run(fp8ops("--help"), log))
    return refusals[0][0], refusals[1][0], floor


def results_table(rows: list[Row], args) -> Table:
    table = Table(
        title=f"checkpoints of {MANIFEST}: saves of {args.steps} steps, {args.repeats} resumes, "
        f"{args.repeats} refusals of each kind"
    )
    for column in ("measurement", "median", "max", "n", "goal", "what it includes"):
        table.add_column(column, justify="right" if column in ("median", "max", "n") else "left")
    for row in rows:
        unit = f" {row.unit}"
        if row.goal is None:
            goal = ""
        else:
            verdict = "met" if max(row.values) <= row.goal else "MISSED"
            goal = f"<= {row.goal:g} s: {verdict}"
        table.add_row(
            row.name,
            f"{statistics.median(row.values):.3f}{unit}",
            f"{max(row.values):.3f}{unit}",
            str(len(row.values)),
            goal,
            row.note,
        )
    return table


def machine_line(load_at_start: float) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = (line.split(":", 1)[1] for line in info if line.startswith("model name"))
            model = next(names).strip()
    except (OSError, StopIteration):
        pass
    load_now = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{model}, {os.cpu_count()} CPUs, load avg {load_at_start:.2f} at start, "
        f"{load_now:.2f} at end; torch {torch.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps trained (and saved) first")
    parser.add_argument("--repeats", type=int, default=5, help="resumes and refusals of each kind")
    parser.add_argument("--base", type=Path, metavar="PATH", help="base weights to fine-tune from")
    parser.add_argument(
        "--short-base",
        action="store_true",
        help=f"pre-train a {SHORT_BASE_STEPS}-step base here even if the manifest's exists",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    if args.steps < 2 or args.repeats < 1:
        parser.error("need --steps >= 2 (one first save, one later) and --repeats >= 1")
    if args.base is not None and args.short_base:
        parser.error("give --base or --short-base, not both")

    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: room for the table
    log = Console(stderr=True, highlight=False)
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(prefix="fp8ops-bench-checkpoint-") as name:
        tmp = Path(name)
        try:
            base = resolve_base(args, tmp, log)
        except Fp8opsError as exc:
            print(exc, file=sys.stderr)
            raise SystemExit(2) from None
        run_dir = tmp / "run"
        log.print(f"training {args.steps} steps, a checkpoint after each (base {base}) ...")
        rows = list(measure_saves(run_dir, base, args.steps, tmp))
        log.print(f"resuming {args.repeats} times ...")
        rows += measure_resumes(run_dir, args.steps, args.repeats, tmp)
        log.print(f"refusing {args.repeats} drifted resumes of each kind ...")
        rows += measure_refusals(run_dir, args.repeats, tmp)

    machine = machine_line(load_at_start)
    if args.json:
        document = {
            "machine": machine,
            "torch": torch.__version__,
            "manifest": MANIFEST,
            "base": str(base),
            "steps": args.steps,
            "repeats": args.repeats,
            "goal_s": GOAL_S,
            "results": [row.as_dict() for row in rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        log.print(f"wrote {args.json}")
    console.print(machine, markup=False, highlight=False)
    console.print(results_table(rows, args))


if __name__ == "__main__":
    main()
