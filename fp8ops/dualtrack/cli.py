"""``fp8ops dualtrack``: the control, candidate and fallback tracks of one manifest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from fp8ops.compare.cli import compare_command
from fp8ops.manifest import load_manifest, parse_assignments
from fp8ops.manifest.cli import ManifestFile
from fp8ops.terminal import output
from fp8ops.train.cli import PROGRESS_HELP


def dualtrack_command(
    file: ManifestFile,
    out: Annotated[
        Path | None,
        typer.Option(
            help="The dual-track directory (default: runs/NAME-dualtrack).", show_default=False
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="PATH=VALUE: evaluate a derived revision of MANIFEST."),
    ] = None,
    compare: Annotated[
        bool, typer.Option(help="Compare the tracks at the end (fp8ops compare OUT).")
    ] = True,
    png: Annotated[bool, typer.Option(help="Export the main plots as PNG too.")] = True,
    progress: Annotated[bool, typer.Option(help=PROGRESS_HELP)] = True,
    tracks: Annotated[
        str | None,
        typer.Option(
            help="Compare recipes instead: bf16 and any of delayed, current, block, mxfp8, "
            "comma-separated (each the manifest under that precision.scaling).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train MANIFEST three ways on the same data and tokens (a BF16 control, the FP8
    candidate, FP8 with high-risk modules in BF16), then compare them against the manifest's
    gates: exit 0 when every candidate passes, 1 when one fails.

    Resumable: run it again to continue an interrupted evaluation. For more than one rank,
    start it with `torchrun --nproc-per-node N -m fp8ops dualtrack ...`.
    """
    from fp8ops.dualtrack.run import run_dualtrack
    from fp8ops.dualtrack.tracks import parse_tracks

    requested = parse_tracks(tracks) if tracks is not None else None
    suffix = "recipes" if requested else "dualtrack"
    out = out or Path("runs") / f"{load_manifest(file).name}-{suffix}"
    outcomes = run_dualtrack(
        file,
        out,
        assignments=parse_assignments(set_ or []),
        progress=progress,
        tracks=requested,
    )
    if os.environ.get("RANK", "0") != "0":
        return
    console = output()
    for outcome in outcomes:
        note = f" ({outcome.note})" if outcome.note else ""
        console.print(
            f"{outcome.track.label}: {outcome.status} in {outcome.seconds:.0f} s "
            f"-> {outcome.track.run_dir}{note}"
        )
    if compare:
        compare_command([out], out=None, png=png)
    else:
        console.print(f"compare them with: fp8ops compare {out}")
