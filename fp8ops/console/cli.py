"""``fp8ops console`` (the ops console, served by Voila) and ``fp8ops whatif`` (another amax
window, replayed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from fp8ops.terminal import output


def console_command(
    runs_dir: Annotated[
        Path, typer.Argument(help="A directory of runs, or one run directory.")
    ] = Path("runs"),
    user: Annotated[
        str | None,
        typer.Option(
            help="Who acts in the ledger (default: $FP8OPS_USER, else the login name).",
            show_default=False,
        ),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: a free one).")] = None,
) -> None:
    """Serve the ops console (Voila, 127.0.0.1 only) and print its URL; Ctrl-C stops it."""
    from fp8ops.console.server import serve  # no ipywidgets, plotly or torch in this process

    serve(runs_dir, user, port, echo=lambda line: print(line, flush=True))


def whatif_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    recipe: Annotated[
        str,
        typer.Option(
            help="delayed (another window, the fields below) or current (per-tensor current "
            "scaling: each cast by its own amax)."
        ),
    ] = "delayed",
    power_2_scale: Annotated[
        bool, typer.Option(help="With --recipe current: scales rounded down to powers of 2.")
    ] = False,
    history_len: Annotated[
        int | None, typer.Option(min=1, help="amax_history_len to try (default: the run's).")
    ] = None,
    algo: Annotated[
        str | None,
        typer.Option(
            help="amax_compute_algo to try: max, most_recent, quantile:Q, trimmed_max:K "
            "(default: the run's)."
        ),
    ] = None,
    margin: Annotated[int | None, typer.Option(min=0, help="margin (default: the run's).")] = None,
    module: Annotated[
        str | None, typer.Option(help="Only modules matching this glob.", show_default=False)
    ] = None,
    slot: Annotated[
        list[str] | None,
        typer.Option(help="input, weight or grad_output (repeatable; default: all three)."),
    ] = None,
    steps: Annotated[
        int, typer.Option(min=0, help="Replay the last N committed steps (0: all of them).")
    ] = 10_000,
    top: Annotated[int, typer.Option(min=1, help="How many rows to print.")] = 20,
    rank: Annotated[int, typer.Option(min=0, help="Whose telemetry.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Every row as JSON.")] = False,
) -> None:
    """Replay recorded amaxes through TE's delayed-scaling update under another window, or
    through current scaling: the steps that would have overflowed and the headroom left,
    against the run's own settings."""
    from fp8ops.console.whatif import SLOTS, report

    result = report(
        run_dir,
        recipe=recipe,
        power_2_scale=power_2_scale,
        history_len=history_len,
        algo=algo,
        margin=margin,
        module=module,
        slots=slot or SLOTS,
        steps=steps,
        rank=rank,
    )
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
        return
    out = output()
    if not out.is_terminal:
        out.width = 200
    out.print(
        f"{run_dir}: steps {result.first_step}-{result.last_step}, rank {rank}; run's "
        f"window: {result.own}; what-if: {result.other}"
    )
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in (
        "module",
        "slot",
        "overflow steps: run",
        "what-if",
        "median headroom bits: run",
        "what-if",
        "p10: run",
        "what-if",
        "first what-if overflows",
    ):
        grid.add_column(name, overflow="fold", justify="left" if name == "module" else "right")
    for r in result.rows[:top]:
        grid.add_row(
            r.module,
            r.slot,
            str(r.run.overflow_steps),
            str(r.what_if.overflow_steps),
            f"{r.run.headroom_median:.2f}",
            f"{r.what_if.headroom_median:.2f}",
            f"{r.run.headroom_p10:.2f}",
            f"{r.what_if.headroom_p10:.2f}",
            ", ".join(map(str, r.what_if.first_overflows)),
        )
    out.print(grid)
    run_total = sum(r.run.overflow_steps for r in result.rows)
    what_if_total = sum(r.what_if.overflow_steps for r in result.rows)
    out.print(
        f"{len(result.rows)} module slots; overflowing steps in all: run {run_total}, "
        f"what-if {what_if_total} (headroom: log2(fp8_max / (amax x scale)) per step; "
        "docs/console.md says what the replay approximates)"
    )
