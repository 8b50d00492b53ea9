"""``fp8ops train`` and ``fp8ops resume``: the main job."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from fp8ops.manifest import load_manifest, parse_assignments
from fp8ops.manifest.cli import ManifestFile

PROGRESS_HELP = (
    "Per-step progress: a bar on a terminal, log lines otherwise; --no-progress prints only the "
    "summary at the end."
)
AcceptDrift = Annotated[
    str | None,
    typer.Option(
        help="Resume despite drift from the checkpoint; the reason is recorded with the changes "
        "as a new manifest revision.",
        show_default=False,
    ),
]
AfterStop = Annotated[
    str | None,
    typer.Option(
        help="Resume a run a Stop alert halted as it is (no override approved, no manifest "
        "change since); the reason is recorded in the run's events.",
        show_default=False,
    ),
]
StopAt = Annotated[
    int | None,
    typer.Option(help="Checkpoint after this step and stop (resumable).", show_default=False),
]


def train_command(
    file: ManifestFile,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where the run writes its files (default: runs/NAME).", show_default=False
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help=(
                "PATH=VALUE: run a derived revision of MANIFEST with this change (repeatable), "
                "e.g. --set topology.tensor_parallel=2 under torchrun; recorded in the run."
            ),
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help=PROGRESS_HELP)] = True,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue RUN_DIR from its latest checkpoint if it has one (refused if MANIFEST "
            "or the environment drifted from the checkpoint's); start it otherwise."
        ),
    ] = False,
    accept_drift: AcceptDrift = None,
    after_stop: AfterStop = None,
    stop_at: StopAt = None,
    verify: Annotated[
        bool | None,
        typer.Option(
            "--verify/--no-verify",
            help="A Hugging Face model.init_checkpoint must give transformers' logits on a fixed "
            "prompt, else the run is refused (without either flag the comparison runs and is "
            "recorded in run.json whenever transformers is installed; --no-verify skips it).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train MANIFEST's model (fine-tune from model.init_checkpoint, or pre-train from scratch).

    One process trains at the manifest's topology of one rank; for more, start it with
    `torchrun --nproc-per-node N -m fp8ops train ...`.
    """
    from fp8ops.train import run_training  # imports torch and Megatron: only when asked

    run_dir = run_dir or Path("runs") / load_manifest(file).name
    result = run_training(
        file,
        run_dir,
        assignments=parse_assignments(set_ or []),
        progress=progress,
        resume=resume,
        accept_drift=accept_drift,
        after_stop=after_stop,
        stop_at=stop_at,
        verify=verify,
    )
    _report_training(result)


def resume_command(
    run_dir: Annotated[Path, typer.Argument(help="The run directory to continue.")],
    checkpoint: Annotated[
        str | None,
        typer.Option(help="Checkpoint name or step (default: latest).", show_default=False),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="PATH=VALUE changes to the manifest (needs --accept-drift)."),
    ] = None,
    accept_drift: AcceptDrift = None,
    after_stop: AfterStop = None,
    stop_at: StopAt = None,
    progress: Annotated[bool, typer.Option(help=PROGRESS_HELP)] = True,
) -> None:
    """Continue RUN_DIR from a checkpoint, locked to the checkpoint's manifest.

    Drift (another manifest, torch, megatron-core, TE, CUDA or GPU) is refused with exit code 4
    before any model is built, unless accepted with a reason. Approved overrides from the
    run's ledger are applied as a new manifest revision. A run a Stop alert halted resumes only
    under another manifest than it stopped under (an override applied or lifted, an accepted
    manifest change) or with --after-stop (exit 3 otherwise).
    """
    from fp8ops.train import resume_training

    result = resume_training(
        run_dir,
        checkpoint=checkpoint,
        assignments=parse_assignments(set_ or []),
        accept_drift=accept_drift,
        after_stop=after_stop,
        progress=progress,
        stop_at=stop_at,
    )
    _report_training(result)


def _report_training(result) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    from fp8ops.start import Complete

    if isinstance(result, Complete):  # a rerun of a finished run: nothing to do, exit 0
        print(result.message, file=sys.stderr)
        return
    # Plain prints, not rich's: a job log is a file, where rich would wrap long paths.
    for line in result.resume_summary or []:
        print(line)
    eval_text = "" if result.last_eval_loss is None else f", eval loss {result.last_eval_loss:.4f}"
    if result.capability_accuracy is not None:
        eval_text += f", capability accuracy {result.capability_accuracy:.1%}"
    if result.first_step > result.steps:  # Trainer.finish: nothing left to train
        print(
            f"finished the run: final weights written from its step {result.steps} "
            f"checkpoint in {result.seconds:.0f} s{eval_text}"
        )
    else:
        print(
            f"trained steps {result.first_step}-{result.steps} in {result.seconds:.0f} s: loss "
            f"{result.first_loss:.4f} -> {result.last_loss:.4f}{eval_text}"
        )
    if result.paused:
        print(f"paused at step {result.steps}; continue with: fp8ops resume {result.run_dir}")
        return
    answers = "" if result.capability_accuracy is None else ", capability.jsonl + capability/"
    print(
        f"results in {result.run_dir}/: metrics.jsonl (per step), eval.jsonl{answers}, "
        "events.jsonl, layers.json, run.json, manifest.yaml, checkpoints/, final/ (weights)"
    )
    print(f"per-layer precision: fp8ops inspect {result.run_dir} --layers")
