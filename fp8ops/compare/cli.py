"""``fp8ops compare RUN...``: the gates table, the causes, and where the report is.

Exit codes: 0 every candidate passes, 1 some candidate fails (CI can gate on it), 2 bad input.
A PNG export that fails (no kaleido, no browser) is a warning: the verdict still decides.
Plotly, pandas and zarr are imported only when the command runs, so ``fp8ops --help`` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def compare_command(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="Run directories (the reference first, then candidates), or one dual-track "
            "directory (with dualtrack.json).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where verdict.json, report.html and png/ go (default: DUALTRACK_DIR/compare, "
            "or compare-REF-vs-CANDIDATES/ beside the reference run).",
            show_default=False,
        ),
    ] = None,
    png: Annotated[
        bool, typer.Option("--png/--no-png", help="Also export the main plots as PNGs (kaleido).")
    ] = True,
    gates: Annotated[
        Path | None,
        typer.Option(
            metavar="MANIFEST",
            help="Judge every candidate by this manifest's gates section (default: the runs' "
            "own gates, which must agree).",
            show_default=False,
        ),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            help="The target GPU (H200 or B300): a ranking of recipes shows its published GEMM "
            "speedups only (default: both).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Judge FP8 candidates against a reference run with one set of release gates (the runs'
    manifests', or --gates); write verdict.json and report.html. Exit 0: all pass, 1: some
    fail, 2: bad input."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from fp8ops.compare.comparison import compare
    from fp8ops.compare.recipes import GPUS
    from fp8ops.compare.report import format_value
    from fp8ops.errors import Fp8opsError

    if gpu is not None and gpu.upper() not in GPUS:
        raise Fp8opsError(
            f"--gpu {gpu}: Transformer Engine publishes speedups for {' and '.join(GPUS)} only"
        )
    result = compare(runs, out, png=png, gates=gates, gpu=gpu and gpu.upper())
    verdict = result.verdict
    # Module names are not markup; a cause stays on one line (soft_wrap), for grep and CI logs.
    console = Console(
        highlight=False, markup=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160
    )

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("candidate", "gate", "value", "threshold", "result"):
        table.add_column(name, overflow="fold")
    for candidate in verdict.candidates:
        for gate in candidate.gates:
            table.add_row(
                candidate.label,
                gate.name,
                format_value(gate.value),
                format_value(gate.threshold),
                "pass" if gate.passed else "FAIL",
            )
    reference = verdict.reference
    console.print(f"reference: {reference['label']} ({reference['run_dir']})")
    console.print(f"gates: {verdict.gates['source']}")
    console.print(table)
    for candidate in verdict.candidates:
        if candidate.passed:
            console.print(f"{candidate.label}: pass")
        else:
            console.print(f"{candidate.label}: FAIL: {candidate.cause}")
    if verdict.recipes:
        ranking = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        gpus = list(verdict.recipes[0].published)
        columns = ("rank", "candidate", "scaling", "gates", "alerts s/d/o", "loss gap", *gpus)
        for name in columns:
            ranking.add_column(name if name not in gpus else f"{name} GEMM x (published)")
        for row in verdict.recipes:
            ranking.add_row(
                str(row.rank),
                row.label,
                row.scaling,
                "pass" if row.passed else "FAIL: " + ", ".join(row.failed_gates),
                "/".join(str(row.alerts[level]) for level in ("stop", "degrade", "observe")),
                format_value(row.loss_gap),
                *(f"{row.published[g]:.2f}" if row.published[g] else "not published" for g in gpus),
            )
        console.print(
            "recipes, ranked by the gates, then Stop and Degrade alerts, then the loss gap"
        )
        console.print(
            "(speedups: Transformer Engine's published GEMM times of a 5B-class layer over "
            "BF16, not measured here):"
        )
        console.print(ranking)
    failed = sum(not c.passed for c in verdict.candidates)
    console.print(
        f"verdict: {verdict.verdict.upper()} ({failed} of {len(verdict.candidates)} "
        "candidates failed)"
    )
    console.print(f"verdict.json: {result.verdict_path}")
    console.print(f"report.html:  {result.report_path}")
    if result.pngs:
        console.print(f"png:          {', '.join(str(p) for p in result.pngs)}")
    if result.png_error:  # the verdict stands; a node without a browser still gates
        print(f"warning: no PNGs: {result.png_error}", file=sys.stderr)
    if verdict.verdict != "pass":
        raise typer.Exit(1)
