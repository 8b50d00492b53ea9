"""``fp8ops preflight MANIFEST|RUN_DIR``: the production launch checklist (docs/preflight.md).

Prints each item as it finishes, then a table: item, result, evidence, seconds. Exit 0 when no
item fails, 1 when one does, 2 on bad input. torch and Megatron are imported by the items, so
``fp8ops --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fp8ops.errors import Fp8opsError

if TYPE_CHECKING:
    from fp8ops.preflight.checklist import Report
    from fp8ops.preflight.results import Item, ItemResult

MARKS = {"pass": "✓", "fail": "✗", "n/a": "–", "skipped": "·"}  # noqa: RUF001 - as printed


def preflight_command(
    target: Annotated[
        Path,
        typer.Argument(
            help="A manifest file to launch, or a run directory.",
            metavar="MANIFEST|RUN_DIR",
            show_default=False,
        ),
    ],
    steps: Annotated[
        int, typer.Option(min=2, help="Steps of the rehearsal runs (stopped and resumed at half).")
    ] = 6,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where the rehearsals train (new or empty; default: a temporary directory).",
            show_default=False,
        ),
    ] = None,
    keep: Annotated[bool, typer.Option(help="Keep the rehearsal runs afterwards.")] = False,
    json_file: Annotated[
        Path | None,
        typer.Option(
            "--json", help="Also write the results to this file as JSON.", show_default=False
        ),
    ] = None,
    skip: Annotated[
        list[str] | None,
        typer.Option(
            help="Skip an item, by number or name, e.g. 9 or topology (repeatable); "
            "reported as skipped, never as passed.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """The production launch checklist, item by item with evidence: versions, version control,
    fingerprints, FP8 state through save and load, the BF16 control, per-layer telemetry, gates
    and alerts, a BF16 fallback and a restore at another TP size, the last four rehearsed for
    real on the manifest shortened to --steps. Exit 0 when no item fails, 1 when one does."""
    from fp8ops.preflight.checklist import Options, run_preflight, write_json
    from fp8ops.preflight.results import find_item
    from fp8ops.preflight.target import resolve_target

    if "RANK" in os.environ:
        raise Fp8opsError(
            "preflight: run it as one process, not under torchrun or srun: it starts torchrun "
            "itself for the rehearsals that need several ranks"
        )
    try:
        skipped = frozenset(find_item(name).number for name in skip or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--skip") from None
    resolved = resolve_target(target)
    progress = _Progress(Console(stderr=True, highlight=False, markup=False))
    report = run_preflight(
        resolved,
        Options(steps=steps, work_dir=work_dir, keep=keep, skip=skipped),
        on_start=progress.start,
        on_done=progress.done,
        say=progress.say,
    )
    out = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
    out.print(_table(report))
    counts = report.counts()
    out.print(
        f"{target}: {counts['pass']} passed, {counts['fail']} failed, {counts['n/a']} n/a, "
        f"{counts['skipped']} skipped in {report.seconds:.0f} s"
    )
    if counts["fail"]:
        failed = ", ".join(str(r.item.number) for r in report.results if r.outcome == "fail")
        out.print(f"NOT ready to launch: item(s) {failed} failed")
    elif counts["skipped"]:
        out.print("no item failed, but skipped items were not checked: not a complete preflight")
    else:
        out.print("ready to launch: every item passed or does not apply")
    if report.kept is not None:
        out.print(f"rehearsal runs kept in {report.kept}")
    if json_file is not None:
        write_json(report, json_file)
    raise typer.Exit(report.exit_code)


class _Progress:
    """A spinner naming the item and what it trains (a terminal), or plain lines (a log)."""

    def __init__(self, console: Console):
        self.console = console
        self.status = None
        self.current = ""

    def start(self, item: Item) -> None:
        self.current = f"{item.number}. {item.title}"
        if self.console.is_terminal:
            self.status = self.console.status(Text(self.current))
            self.status.start()

    def say(self, text: str) -> None:
        if self.status is not None:
            self.status.update(Text(f"{self.current}: {text}"))
        else:
            self.console.print(f"   {text}")

    def done(self, result: ItemResult) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        self.console.print(
            f"{MARKS[result.outcome]} {self.current}: {result.outcome} ({result.seconds:.1f} s)"
        )


def _table(report: Report) -> Table:
    from rich import box

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, show_lines=True)
    for name in ("#", "item", "result", "evidence", "s"):
        table.add_column(name, overflow="fold", justify="right" if name in ("#", "s") else "left")
    for r in report.results:
        evidence = "\n".join(f"{MARKS[f.outcome]} {f.text}" for f in r.evidence.findings)
        table.add_row(str(r.item.number), r.item.title, r.outcome, evidence, f"{r.seconds:.1f}")
    return table
