"""What the metric sinks wrote, read back with each library's own reader: TensorBoard's event
accumulator, W&B's transaction-log inspector (``wandb leet inspect --json``, the CLI that ships
with the wandb package: its Python reader moved into the Go core) and MLflow's client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def tensorboard(directory: Path):
    """TensorBoard's reader over every event file of ``directory`` (a resume's purge applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    return reader


def tensorboard_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in tensorboard(directory).Scalars(tag)]


def tensorboard_text(directory: Path, tag: str) -> list[tuple[int, str]]:
    events = tensorboard(directory).Tensors(f"{tag}/text_summary")
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events]


def wandb_records(run_file: Path) -> list[dict]:
    """Every record of one ``.wandb`` transaction log."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wandb_runs(wandb_dir: Path) -> list[tuple[str, list[dict]]]:
    """``(run id, history rows)`` of each offline run directory, oldest first; a row is its
    logged values with ``_step``."""
    runs = []
    for run_file in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        records = wandb_records(run_file)
        run_id = next(r["run"]["run_id"] for r in records if r["type"] == "run")
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        runs.append((run_id, history))
    return runs


def mlflow_client(uri: str):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store opt-in
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    history = mlflow_client(uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)
