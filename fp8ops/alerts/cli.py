"""``fp8ops alerts``: what the alert rules reported during a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from fp8ops.alerts.records import LEVELS, format_value, select_alerts
from fp8ops.terminal import output


def alerts_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    level: Annotated[
        str | None,
        typer.Option(help="Show this level and above: observe, degrade or stop."),
    ] = None,
    module: Annotated[
        str | None,
        typer.Option(
            help="Only modules matching this glob, e.g. '*.linear_fc1'.", show_default=False
        ),
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            metavar="MANIFEST",
            help="Run this manifest's alert rules again over the run's telemetry.zarr and list "
            "what they find. An imported run (fp8ops import-te-debug) keeps the result as its "
            "alerts.jsonl; a run fp8ops trained keeps its own.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """List a run's alerts (alerts.jsonl): step, level, module, metric, value, threshold."""
    from fp8ops.alerts.files import read_run_alerts  # the run's records: only when asked

    if level is not None and level not in LEVELS:
        raise typer.BadParameter(f"{level!r}: choose {', '.join(LEVELS)}", param_hint="--level")
    out = output()
    if not out.is_terminal:
        out.width = 200  # a log or a file: the table without folding module names
    if replay is None:
        alerts = read_run_alerts(run_dir)
    else:
        alerts = _replay(out, run_dir, replay)
    shown = select_alerts(alerts, level, module)
    filters = " and ".join(
        text
        for text in (level and f"level {level} or above", module and f"module {module}")
        if text
    )
    scope = f" ({filters}; {len(alerts)} in all)" if filters else ""
    if not shown:
        out.print(f"{run_dir}: no alerts{scope}")
        return
    ranks = any(a.rank is not None for a in shown)  # gathered from several ranks
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in (
        "step",
        "level",
        *(["rank"] if ranks else []),
        "module",
        "metric",
        "value",
        "threshold",
        "message",
    ):
        grid.add_column(
            name, overflow="fold", justify="right" if name in ("step", "rank") else "left"
        )
    for a in shown:
        rank = [] if not ranks else ["" if a.rank is None else str(a.rank)]
        grid.add_row(
            str(a.step),
            a.level,
            *rank,
            a.module or "(run)",
            a.metric or "",
            format_value(a.value),
            "" if a.threshold is None else format_value(a.threshold),
            a.message,
        )
    out.print(grid)
    counts = ", ".join(f"{sum(a.level == name for a in shown)} {name}" for name in LEVELS)
    out.print(f"{run_dir}: {len(shown)} alert(s){scope}: {counts}")


def _replay(out, run_dir: Path, manifest_file: Path) -> list:
    """Replay ``manifest_file``'s rules over ``run_dir``'s store; keep them if it is imported."""
    from fp8ops.alerts.replay import record_replay, replay_alerts  # zarr, numpy: when asked
    from fp8ops.errors import Fp8opsError
    from fp8ops.manifest import load_manifest
    from fp8ops.run import RunLayout

    if not RunLayout(run_dir).telemetry.exists():
        raise Fp8opsError(f"{run_dir}: no telemetry.zarr to replay the alert rules over")
    result = replay_alerts(run_dir, load_manifest(manifest_file))
    steps = ", ".join(f"rank {rank}: {count}" for rank, count in result.steps.items())
    kept = "kept as its alerts.jsonl" if result.imported else "shown only: its alerts.jsonl stays"
    out.print(f"{run_dir}: the alert rules of {manifest_file} replayed over {steps} steps ({kept})")
    if result.missing_metrics:
        out.print(f"not in the store, never judged: {', '.join(result.missing_metrics)}")
    if result.stop is not None:
        out.print(
            f"a live run would have stopped at step {result.stop_step}: {result.stop.message}"
        )
    if result.imported:
        record_replay(run_dir, result, manifest_file)
    return result.alerts
