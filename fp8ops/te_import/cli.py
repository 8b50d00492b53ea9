"""``fp8ops import-te-debug LOG_DIR --out RUN_DIR``: TE debug statistics logs as an fp8ops run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fp8ops.terminal import output


def import_te_debug_command(
    log_dir: Annotated[
        Path,
        typer.Argument(
            help="The log_dir given to TE's debug_api.initialize (it holds "
            "nvdlfw_inspect_statistics_logs/), or that statistics folder.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option(help="The run directory to create (must not exist, or be empty).")
    ],
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="Replay this manifest's alert rules into the run's alerts.jsonl; its "
            "precision.scaling is the training recipe unless --recipe says otherwise.",
            show_default=False,
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="The recipe the layers trained with: delayed, current, block, mxfp8 or nvfp4 "
            "(TE's recipe-named stats of another recipe are a 'what if', kept under TE's names). "
            "Default: the manifest's, else what delayed-scaling stats imply.",
            show_default=False,
        ),
    ] = None,
    naming: Annotated[
        str,
        typer.Option(
            help="Module names: te (TE's layer names as logged) or inferred (names from "
            "infer_and_assign_layer_names made fp8ops' module paths: decoder.layers.0...)."
        ),
    ] = "te",
    ranks_may_differ: Annotated[
        bool,
        typer.Option(
            "--ranks-may-differ",
            help="Ranks logging different iterations is a warning, not an error (a run that "
            "logged with a different freq per pipeline stage).",
        ),
    ] = False,
) -> None:
    """Read a run's Transformer Engine debug-API statistics logs (nvdlfw_inspect) into a new run
    directory: telemetry.zarr, run.json (where from), status.json, and with --manifest its
    alerts replayed. Then: fp8ops inspect / alerts / console on it."""
    from fp8ops.te_import import import_te_debug  # numpy, zarr: only when it runs

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    result = import_te_debug(
        log_dir,
        out,
        recipe=recipe,
        manifest=manifest,
        naming=naming,
        ranks_may_differ=ranks_may_differ,
        warn=warn,
    )
    out_ = output()
    ranks = ", ".join(f"rank {r}: {n}" for r, n in result.steps.items())
    out_.print(
        f"{result.run_dir}: {len(result.modules)} modules, {result.lines:,} lines from "
        f"{len(result.steps)} rank logs in {result.seconds:.1f} s; steps from "
        f"{result.first_step} ({ranks})"
    )
    out_.print(
        f"recipe: {result.recipe or 'not known (recipe-named FP8 stats kept under TE names)'}"
    )
    mapped = ", ".join(f"{te} -> {ours}" for te, ours in result.mapped.items()) or "none"
    out_.print(f"mapped onto the catalogue: {mapped}")
    out_.print(f"kept under TE's names: {', '.join(result.kept) or 'none'}")
    if result.replay is not None:
        replay = result.replay
        stop = (
            ""
            if replay.stop is None
            else f"; a live run would have stopped at step {replay.stop_step}"
        )
        out_.print(f"alerts replayed by {manifest}: {len(replay.alerts)}{stop}")
    if result.warnings:
        out_.print(f"{len(result.warnings)} warning(s), also in run.json")
    out_.print(f"next: fp8ops inspect {result.run_dir} --worst input.amax")
