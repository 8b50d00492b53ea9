"""The small model the end-to-end tests train (2 layers, hidden 64: a step takes about a tenth
of a second on a CPU), built on the CPU default's manifests."""

from __future__ import annotations

from pathlib import Path

from fp8ops.manifest import derive, load_manifest, write_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
SMALL_MODEL = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.ffn_hidden_size": 256,
    "model.num_attention_heads": 4,
    "model.seq_length": 64,
}
SCHEDULE = {
    "schedule.warmup_steps": 1,
    "schedule.micro_batch_size": 4,
    "schedule.global_batch_size": 8,
    "schedule.log_interval": 1,
    "schedule.eval_iters": 4,
}


def write_derived(path: Path, parent_file: Path, changes: dict) -> Path:
    """``parent_file`` with ``changes``, as a new revision written to ``path``."""
    return write_manifest(derive(load_manifest(parent_file), changes, "test: small"), path)


def write_small_finetune(path: Path, base: Path, changes: dict | None = None) -> Path:
    """The CPU default's FP8 fine-tuning on the small model from the base run ``base`` (its
    ``final/`` weights), checkpointing at every step and keeping two, with ``changes`` on top;
    written to ``path``."""
    return write_derived(
        path,
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
