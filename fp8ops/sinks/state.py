"""``sinks.json``: what a resume needs to continue the same TensorBoard directory, W&B run and
MLflow run: each sink's run id, where it lives, and the last step it was sent.

``{"wandb": {"run_id": "...", "where": "...", "last_step": 120}, "mlflow": {...}}``. Written
atomically by the sinks' thread when the sinks open, at each checkpoint and when the run
segment ends; no secret is in it (ids, project names, tracking URIs without credentials).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fp8ops.files import atomic_write_text


def read_state(path: Path) -> dict[str, dict[str, Any]]:
    """The saved state by sink name; empty when there is none, or it cannot be read (a new
    W&B or MLflow run is then started, which the sink's event says)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    return {name: entry for name, entry in state.items() if isinstance(entry, dict)}


def write_state(path: Path, state: dict[str, dict[str, Any]]) -> None:
    atomic_write_text(path, json.dumps(state, indent=2, sort_keys=True) + "\n")
