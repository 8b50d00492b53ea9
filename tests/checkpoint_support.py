"""Shared by the checkpoint tests: the small model's runs, and surgery on a saved checkpoint.

The model and schedule are tests/small_model.py's; the fine-tuning manifest checkpoints at every
step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import small_model
from small_model import MANIFESTS, SCHEDULE, SMALL_MODEL

from fp8ops.checkpoint.directory import META_FILE


def write_derived(tmp: Path, name: str, parent_file: Path, changes: dict) -> Path:
    """``parent_file`` with ``changes``, as a new revision in ``tmp/NAME.yaml``."""
    return small_model.write_derived(tmp / f"{name}.yaml", parent_file, changes)


def train_small_base(tmp: Path) -> Path:
    """The small model pre-trained for 4 steps in bf16; returns its run directory (the weights
    are in ``final/``)."""
    from fp8ops.train import run_training

    manifest = write_derived(
        tmp,
        "base",
        MANIFESTS / "tiny-gpt-cpu-base.yaml",
        {**SMALL_MODEL, **SCHEDULE, "schedule.train_steps": 4, "schedule.eval_interval": 4},
    )
    run_training(manifest, tmp / "base-run", progress=False)
    return tmp / "base-run"


def write_small_finetune(tmp: Path, base: Path, changes: dict | None = None) -> Path:
    """The CPU default's FP8 fine-tuning on the small model from ``base``, checkpointing at every
    step and keeping two, with ``changes`` on top."""
    return write_derived(
        tmp,
        "finetune",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": str(base / "final"),
            "data.num_examples": 800,
            "optimizer.lr": 2e-3,
            "schedule.checkpoint_interval": 1,
            "schedule.keep_checkpoints": 2,
            **(changes or {}),
        },
    )


# -- surgery on a checkpoint ------------------------------------------------------------------


def edit_meta(checkpoint: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite ``fp8ops_checkpoint.json`` with ``edit`` applied to its JSON (the file is not in
    its own hash list, so nothing else notices)."""
    path = checkpoint / META_FILE
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=2) + "\n")


def rehash(checkpoint: Path, name: str) -> None:
    """Record ``name``'s current size and sha256 in the checkpoint's hash list, as if it had
    been saved that way: only checks beyond the hashes can then catch a change to it."""
    data = (checkpoint / name).read_bytes()

    def update(meta: dict) -> None:
        meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    edit_meta(checkpoint, update)
