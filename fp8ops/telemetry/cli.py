"""``fp8ops inspect``: what a run directory records, per layer and by telemetry metric."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fp8ops.terminal import output


def inspect_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Every module's precision and why (layers.json), and the switches during "
            "training (the precision schedule's, the auto-degrade policy's).",
        ),
    ] = False,
    worst: Annotated[
        str,
        typer.Option(
            help="Rank modules by this telemetry metric (e.g. weight.saturation, "
            "grad_output.underflow, fp8_rel_error, input.scale_change)."
        ),
    ] = "input.saturation",
    top: Annotated[int, typer.Option(min=1, help="How many modules to list.")] = 10,
    rank: Annotated[int, typer.Option(min=0, help="Whose telemetry (ranks record their own).")] = 0,
) -> None:
    """Summarise a run: recipe, per-layer precision (--layers: the full table and its switches
    during training), and the modules worst by a telemetry metric over the run's committed
    steps."""
    from fp8ops.run import RunLayout, read_layers_json  # the run's records: only when asked

    out = output()
    if not out.is_terminal:
        out.width = 200  # a log or a file: seven columns without folding module names
    imported = _imported(run_dir)
    if imported is not None:  # no layers.json: TE's logs give no shapes or admission
        _print_imported(out, run_dir, imported, layers)
        _print_worst(out, run_dir, worst, top, rank)
        return
    document = read_layers_json(run_dir)
    table = document.table
    recipe = document.recipe
    out.print(
        f"{run_dir}: manifest {document.manifest_hash[:12]}, tensor_parallel "
        f"{document.tensor_parallel}, layer table {document.table_hash[:12]}"
    )
    out.print(f"recipe: {recipe.summary}")
    if layers:
        # Every column folds rather than crops: a narrow terminal loses no text.
        grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for name in (
            "module",
            "kind",
            "parallel",
            "global K x N",
            "per-rank K x N",
            "precision",
            "reason",
        ):
            grid.add_column(name, overflow="fold")
        for row in table.rows:
            grid.add_row(
                row.fqn,
                row.kind,
                row.parallel,
                str(row.global_shape),
                str(row.rank_shape),
                row.gemm_summary(),
                _reason(row),
            )
        out.print(grid)
    out.print(table.summary())
    if layers:
        _print_switches(out, run_dir)
    else:
        out.print(f"fp8ops inspect {run_dir} --layers: every module's precision and why")
    if RunLayout(run_dir).telemetry.exists():
        _print_worst(out, run_dir, worst, top, rank)


def _print_switches(out: Console, run_dir: Path) -> None:
    """The table's switches during training (the schedule's and the auto-degrade policy's),
    oldest first: from which step, why, and what the modules run from then on."""
    from fp8ops.run.switches import read_switches

    switches = read_switches(run_dir)
    if not switches:
        return
    out.print(f"precision switches ({len(switches)}), each from the step it names:")
    for switch in switches:
        out.print(f"  step {switch.step}: {switch.cause}")
        for now, modules in switch.grouped():
            out.print(f"    {now}: {', '.join(modules)}")


def _imported(run_dir: Path):
    """Where an imported run came from (run.json's ``imported``); None for a run with a
    layers.json (fp8ops trained it) or without a run.json (read_layers_json then says what is
    wrong)."""
    from fp8ops.run import RunLayout, read_run_record

    layout = RunLayout(run_dir)
    if layout.layers.is_file() or not layout.run_record.is_file():
        return None
    return read_run_record(run_dir).imported


def _reason(row) -> str:
    """A row's reason, and for a module with some GEMMs in the base dtype theirs."""
    if not row.some_gemms:
        return row.reason.text
    by_text: dict[str, list[str]] = {}
    for name, gemm in row.gemms.items():
        if gemm.precision != "fp8":
            by_text.setdefault(gemm.reason.text, []).append(name)
    return row.reason.text + "".join(f"; {', '.join(n)}: {t}" for t, n in by_text.items())


def _print_imported(out: Console, run_dir: Path, imported, layers: bool) -> None:
    """What an imported run is: where from, the recipe assumed, what the store holds."""
    from fp8ops.telemetry import open_run

    store = open_run(run_dir)
    kept = [m for m in store.metrics if m.startswith("te.")]
    out.print(
        f"{run_dir}: imported from Transformer Engine debug logs in {imported.source} "
        f"({len(imported.files)} rank logs, {sum(f.lines for f in imported.files):,} lines, "
        f"iterations {imported.first_iteration}-{imported.last_iteration}, "
        f"{imported.imported_at})"
    )
    out.print(f"recipe: {imported.recipe or 'not known'} ({imported.recipe_from or 'not given'})")
    mapped = ", ".join(f"{te} -> {ours}" for te, ours in imported.mapped.items()) or "none"
    out.print(f"mapped onto the catalogue: {mapped}")
    out.print(f"kept under TE's names: {', '.join(kept) or 'none'}")
    if imported.warnings:
        out.print(f"{len(imported.warnings)} warning(s) at import (run.json imported.warnings)")
    out.print(
        f"{len(store.modules)} modules in the store; no layers.json (TE's logs give no GEMM "
        "shapes, parallelism or admission)"
    )
    if layers:
        for module in store.modules:
            out.print(f"  {module}")


def _print_worst(out: Console, run_dir: Path, metric: str, top: int, rank: int) -> None:
    """The ``top`` modules with the worst ``metric`` over the run: the largest, or the
    smallest where low is worse (a scale, a block exponent); NaN (never measured) last."""
    import pandas as pd

    from fp8ops.telemetry import open_run  # zarr and pandas: only when a store is read
    from fp8ops.telemetry.catalogue import worst_end

    store = open_run(run_dir)
    window = store.metric_window(metric, rank=rank)  # steps x modules
    if window.empty:
        out.print(f"telemetry: no committed steps yet on rank {rank}")
        return
    end = worst_end(metric)
    summary = pd.DataFrame(
        {end: getattr(window, end)(), "mean": window.mean(), "last": window.ffill().iloc[-1]}
    ).sort_values(end, ascending=end == "min")  # NaN (never measured) last
    measured = window.notna().sum()
    grid = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        title=f"worst {min(top, len(summary))} modules by {metric}, steps "
        f"{window.index[0]}-{window.index[-1]}, rank {rank}",
    )
    for name in ("module", end, "mean", "last", "measured steps"):
        grid.add_column(name, overflow="fold", justify="left" if name == "module" else "right")
    for module, row in summary.head(top).iterrows():
        grid.add_row(
            str(module),
            f"{row[end]:.4g}",
            f"{row['mean']:.4g}",
            f"{row['last']:.4g}",
            str(int(measured[module])),
        )
    out.print(grid)
