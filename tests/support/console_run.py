"""The run the ops console is shown in its tests (test_console.py, test_console_browser.py): the
small model fine-tuned in FP8 for 12 steps from the shared small base, with telemetry every step
and a checkpoint every 4 (as in test_resume.py)."""

from __future__ import annotations

from pathlib import Path

from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

STEPS = 12


def make_trained_run(tmp: Path, base: Path) -> tuple[Path, Path]:
    """A fine-tuning manifest from the base run ``base`` and its finished run in
    ``tmp/runs/finetune``."""
    from fp8ops.train import run_training

    finetune = write_derived(
        tmp / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "schedule.eval_iters": 2,
            "model.init_checkpoint": str(base / "final"),
            "data.num_examples": 400,
            "schedule.train_steps": STEPS,
            "schedule.eval_interval": 100,
            "schedule.checkpoint_interval": 4,
            "optimizer.lr": 2e-3,
            "telemetry.every_steps": 1,
            "telemetry.error_sample_every": 2,
            # Observe alerts only: a Degrade would propose an override, and these tests write the
            # ledger themselves. lr 2e-3 saturates a few inputs by up to 2% within 12 steps.
            "alerts.saturation.degrade": 0.05,
            "alerts.saturation.stop": 0.5,
        },
    )
    run = tmp / "runs" / "finetune"
    run_training(finetune, run, progress=False)
    return finetune, run
