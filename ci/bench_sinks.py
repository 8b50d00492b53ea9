"""What the metric sinks and an alert webhook cost a training step: the CPU default with none,
each sink, all three, and a webhook told of an alert at every step.

    .venv/bin/python ci/bench_sinks.py [--steps 30] [--rounds 4] [--warmup 10]

Each configuration trains the CPU default (``manifests/tiny-gpt-cpu.yaml``, from random weights:
a step costs the same whatever its weights) for ``--warmup`` + ``--steps`` steps in a fresh run
directory, ``--rounds`` times, the configurations taking turns so that drift in the machine's
speed reaches all of them. Per step it times

* the hook calls on the training step's path: the run directory's listener (a record queued for
  the sinks: the metrics row, events), ``Reporting.layers`` (the telemetry row copied and
  queued) and ``Reporting.alerts`` (the step's alerts queued for the sinks and the webhook);
* the whole step: ``train_step``, the metrics row written, ``observe`` (telemetry, alerts) and,
  for the webhook, one synthetic alert handed over.

The sinks' and the webhook's threads (and W&B's own service process) run beside training: on a
machine with few cores what they take shows in the step time, not in the hook's. So the table
also gives the CPU time the process and its children (W&B's service) spent per measured step,
from the first measured step to the end of ``close`` (the bounded wait for what is queued):
unlike the step time, it hardly moves with other processes' load. W&B runs offline and MLflow on
a file store in the run directory; the webhook is a local HTTP server in a process of its own
(not counted) answering 200.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

from fp8ops.manifest import derive, load_manifest
from fp8ops.start import New
from fp8ops.train import open_trainer
from fp8ops.train.distributed import init_distributed, shutdown_distributed

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"
HOOK_ENV = "FP8OPS_BENCH_WEBHOOK"
CONFIGURATIONS = {
    "none": {},
    "tensorboard": {"logging.tensorboard": {}},
    "wandb (offline)": {"logging.wandb": {"mode": "offline"}},
    "mlflow (file store)": {"logging.mlflow": {}},
    "all three sinks": {
        "logging.tensorboard": {},
        "logging.wandb": {"mode": "offline"},
        "logging.mlflow": {},
    },
    "webhook, an alert every step": {
        "notifications.webhooks": [{"url_env": HOOK_ENV, "level": "observe"}]
    },
}
# A webhook that answers 200, in a process of its own (not competing for this one's GIL).
SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="runs per configuration")
    parser.add_argument(
        "--warmup", type=int, default=10, help="first steps of each run left out (sinks open)"
    )
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    base = derive(
        load_manifest(MANIFEST),
        {
            "model.init_checkpoint": None,
            "schedule.train_steps": args.warmup + args.steps + 1,
            # No evaluation or checkpoint inside the measured steps: they are not the step's.
            "schedule.eval_interval": 10_000,
            "schedule.checkpoint_interval": 10_000,
            "capability.enabled": False,
        },
        "sinks benchmark",
    )
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    os.environ[HOOK_ENV] = f"http://127.0.0.1:{server.stdout.readline().strip()}/hook"
    results: dict[str, dict[str, list[float]]] = {
        name: {"step": [], "hook": [], "close": [], "round_medians": [], "cpu": []}
        for name in CONFIGURATIONS
    }
    try:
        for _ in range(args.rounds):
            for name, changes in CONFIGURATIONS.items():
                manifest = derive(base, changes, name) if changes else base
                step, hook, close, cpu = run(
                    manifest, args.warmup, args.steps, "webhook" in name, skip=server.pid
                )
                results[name]["step"] += step
                results[name]["hook"] += hook
                results[name]["close"].append(close)
                results[name]["round_medians"].append(statistics.median(step))
                results[name]["cpu"].append(cpu / args.steps)
    finally:
        server.terminate()
    report(results, args)


def run(manifest, warmup: int, steps: int, alert_every_step: bool, skip: int):
    """One run: (seconds per measured step, hook seconds per measured step, close seconds, CPU
    seconds of the measured steps and the close; the process ``skip`` not counted)."""
    ranks = init_distributed(manifest.topology, source=str(MANIFEST))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = open_trainer(
                New(manifest, [manifest], Path(tmp) / "run", "bench"), ranks, progress=False
            )
            hook = [0.0]
            _time_hooks(trainer, hook)
            step_seconds, hook_seconds = [], []
            for step in range(warmup + steps):
                if step == warmup:
                    cpu = _cpu_seconds(skip)
                hook[0] = 0.0
                started = time.perf_counter()
                row = trainer.train_step(step)
                trainer.run.log_metrics(row, with_status=False)
                trainer.observe(row)
                if alert_every_step:
                    trainer.reporting.alerts([_alert(row.step)])
                elapsed = time.perf_counter() - started
                if step >= warmup:
                    step_seconds.append(elapsed)
                    hook_seconds.append(hook[0])
            started = time.perf_counter()
            trainer.reporting.close()
            close = time.perf_counter() - started
            cpu = _cpu_seconds(skip) - cpu
            if trainer.telemetry is not None:
                trainer.telemetry.close()
            trainer.run.release()
    finally:
        shutdown_distributed()
    return step_seconds, hook_seconds, close, cpu


def _cpu_seconds(skip: int) -> float:
    """CPU time of this process and its live children (W&B's service), ``skip`` left out."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        if child.pid != skip:
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.NoSuchProcess:
                continue
    return total


def _time_hooks(trainer, total: list[float]) -> None:
    """Add the time of every call the step makes into the sinks and webhook to ``total[0]``."""

    def timed(call):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - started

        return wrapper

    trainer.run._listeners[:] = [timed(listener) for listener in trainer.run._listeners]
    trainer.reporting.layers = timed(trainer.reporting.layers)
    trainer.reporting.alerts = timed(trainer.reporting.alerts)


def _alert(step: int) -> dict:
    return {
        "step": step,
        "level": "observe",
        "rule": "saturation",
        "module": "decoder.layers.0.mlp.linear_fc1",
        "metric": "input.saturation",
        "value": 2e-4,
        "threshold": 1e-4,
        "message": f"step {step}: a synthetic alert of the benchmark",
        "rank": 0,
    }


def report(results, args) -> None:
    none = statistics.mean(results["none"]["step"])
    none_rounds = results["none"]["round_medians"]
    none_cpu = statistics.median(results["none"]["cpu"])
    table = Table(
        title=f"sinks and webhook on the step, {MANIFEST.name}, {args.rounds} x {args.steps} steps"
    )
    columns = ("configuration", "mean ms/step", "median ms/step", "vs none", "vs none, paired")
    more = ("CPU ms/step", "extra CPU ms/step", "hook µs mean", "hook µs median")
    for column in (*columns, *more, "hook µs max", "close s"):
        table.add_column(column, justify="right")
    for name, measured in results.items():
        step, hook = measured["step"], measured["hook"]
        table.add_row(
            name,
            f"{1e3 * statistics.mean(step):.1f}",
            f"{1e3 * statistics.median(step):.1f}",
            f"{statistics.mean(step) / none:.3f}x",
            f"{_paired(measured['round_medians'], none_rounds):.3f}x",
            f"{1e3 * statistics.median(measured['cpu']):.1f}",
            f"{1e3 * (statistics.median(measured['cpu']) - none_cpu):+.1f}",
            f"{1e6 * statistics.mean(hook):.0f}",
            f"{1e6 * statistics.median(hook):.0f}",
            f"{1e6 * max(hook):.0f}",
            f"{max(measured['close']):.2f}",
        )
    console = Console()
    console.print(
        "vs none, paired: the median over rounds of (this configuration's median step / the "
        "median step of the run without sinks in the same round): load that drifts between "
        "rounds reaches both sides of each ratio"
    )
    console.print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f} at the end"
    )
    console.print(table)


def _paired(medians: list[float], none: list[float]) -> float:
    return statistics.median(m / n for m, n in zip(medians, none))


if __name__ == "__main__":
    main()
