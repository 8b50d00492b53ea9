"""The ``fp8ops`` command line.

Thin on purpose: each command parses its arguments, calls one package function and prints.
User errors are ``Fp8opsError``s; ``main`` prints their message (no traceback) and exits
with their code (2). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fp8ops.compare.cli import compare_command
from fp8ops.errors import Fp8opsError, ManifestError, RevisionError
from fp8ops.launch.cli import launch_app
from fp8ops.manifest import (
    ManifestStore,
    derive,
    diff_manifests,
    load_manifest,
    manifest_hash,
    parse_assignments,
    write_manifest,
)
from fp8ops.manifest.messages import yaml_value
from fp8ops.manifest.summary import summary_rows
from fp8ops.overrides.cli import overrides_app
from fp8ops.preflight.cli import preflight_command

app = typer.Typer(
    name="fp8ops",
    help="Auditable, observable and locally reversible FP8 fine-tuning.",
    no_args_is_help=True,
    add_completion=False,
)
manifest_app = typer.Typer(
    help="Validate, hash, compare and revise run manifests.", no_args_is_help=True
)
app.add_typer(manifest_app, name="manifest")
app.add_typer(overrides_app, name="overrides")
app.add_typer(launch_app, name="launch")
app.command("compare")(compare_command)
app.command("preflight")(preflight_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``fp8ops`` script and ``python -m fp8ops``."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        app(args=argv, prog_name="fp8ops")
    except Fp8opsError as exc:
        # Errors every rank raises alike (drift, a stop request, a Stop alert) are said once.
        if rank == 0 or not getattr(exc, "collective", False):
            print(exc if rank == 0 else f"[rank {rank}] {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except OSError as exc:
        if exc.filename is None:  # not about a path (a connection, a device): a real fault
            raise
        # A path given (or the disk under it) failed: say which, as for every user error.
        paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
        print(
            f"[rank {rank}] " * (rank != 0) + f"{' -> '.join(paths)}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _console() -> Console:
    # Globs like "[0-3]" are not markup; piped output gets room for the wider tables.
    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)


# --------------------------------------------------------------------------------------
# fp8ops manifest ...
# --------------------------------------------------------------------------------------

PROGRESS_HELP = (
    "Per-step progress: a bar on a terminal, log lines otherwise; --no-progress prints only the "
    "summary at the end."
)
ManifestFile = Annotated[
    Path, typer.Argument(help="A manifest YAML file.", metavar="MANIFEST", show_default=False)
]


@manifest_app.command()
def validate(
    file: ManifestFile,
    inputs: Annotated[
        bool,
        typer.Option(
            "--inputs",
            help="Also read the files it names, as train does before it starts: the "
            "tokenizer, and the data built and tokenized (model.vocab_size and model.seq_length "
            "checked against them). Without it only the manifest itself is checked, so a "
            "cluster's manifest validates anywhere.",
        ),
    ] = False,
) -> None:
    """Check a manifest and summarise it."""
    m = load_manifest(file)
    rows = summary_rows(m)
    if inputs:
        rows.append(("inputs", _check_inputs(m, file)))
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, text in rows:
        table.add_row(label, text)
    out = _console()
    out.print(f"{file}: valid" + (", and its inputs read" if inputs else ""))
    out.print(table)


def _check_inputs(m, file: Path) -> str:
    """What ``validate --inputs`` reads: the tokenizer and the data, built as a run builds them."""
    from fp8ops.data import build_data, tokenizer_for

    try:
        tokenizer = tokenizer_for(m.tokenizer)
        data = build_data(m, tokenizer)
    except ManifestError as exc:
        raise ManifestError(f"{file}: {exc}") from None
    return (
        f"tokenizer {tokenizer.kind}, {tokenizer.vocab_size:,} ids, end-of-document id "
        f"{tokenizer.eod}; data {len(data.train):,} train and {len(data.eval):,} eval "
        f"sequences, fingerprint {data.fingerprint[:12]}"
    )


@manifest_app.command("hash")
def hash_(file: ManifestFile) -> None:
    """Print the manifest's sha256 (of its canonical form: formatting and comments don't count)."""
    print(manifest_hash(load_manifest(file)))


@manifest_app.command()
def diff(a: ManifestFile, b: ManifestFile) -> None:
    """Compare two manifests field by field. Exit 0 if they mean the same run, 1 if not."""
    changes = diff_manifests(load_manifest(a), load_manifest(b))
    out = _console()
    if not changes:
        out.print(f"identical: {a} and {b} mean the same run")
        return
    table = Table(
        title=f"{len(changes)} field(s) differ: old = {a}, new = {b}", title_justify="left"
    )
    table.add_column("field", no_wrap=True)
    table.add_column("old", overflow="fold")
    table.add_column("new", overflow="fold")
    for change in changes:
        old = "(absent)" if change.kind == "added" else yaml_value(change.old, limit=None)
        new = "(absent)" if change.kind == "removed" else yaml_value(change.new, limit=None)
        table.add_row(change.path, old, new)
    out.print(table)
    raise typer.Exit(1)


@manifest_app.command("derive")
def derive_(
    parent: ManifestFile,
    assignments: Annotated[
        list[str],
        typer.Option(
            "--set", help="PATH=VALUE, VALUE in YAML (repeatable), e.g. precision.margin=1."
        ),
    ],
    reason: Annotated[str, typer.Option(help="Why this revision exists (recorded in it).")],
    out: Annotated[Path | None, typer.Option(help="Write the new revision here.")] = None,
    store: Annotated[
        Path | None, typer.Option(help="Also keep parent and child in this manifest store.")
    ] = None,
) -> None:
    """Make the next revision of PARENT with some fields changed."""
    if out is None and store is None:
        raise typer.BadParameter("give --out FILE, --store DIR or both")
    parent_manifest = load_manifest(parent)
    child = derive(
        parent_manifest, parse_assignments(assignments), reason, source=f"{parent} with --set"
    )
    if out is not None:
        write_manifest(child, out)
    if store is not None:
        manifest_store = ManifestStore(store)
        manifest_store.put(parent_manifest)
        manifest_store.put(child)
    print(manifest_hash(child))


@manifest_app.command()
def chain(
    store: Annotated[
        Path, typer.Argument(help="A manifest store directory, or a manifest file inside one.")
    ],
    head: Annotated[
        str | None, typer.Argument(help="Hash (or unique prefix) of the last revision.")
    ] = None,
) -> None:
    """Verify a store and list a revision chain, root first."""
    if store.is_file():
        head = head or manifest_hash(load_manifest(store))
        store = store.parent
    if not store.is_dir():
        raise RevisionError(f"{store}: no such manifest store directory")
    manifest_store = ManifestStore(store)
    manifest_store.verify()
    if head is None:
        heads = manifest_store.heads()
        if len(heads) != 1:
            found = ", ".join(h[:12] for h in heads) or "none (empty store)"
            raise RevisionError(f"{store}: name the head revision; heads found: {found}")
        head = heads[0]
    revisions = manifest_store.chain(manifest_store.resolve(head))
    table = Table(title=f"{store}: {len(revisions)} revision(s), verified", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("sha256", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("reason", overflow="fold")
    for m in revisions:
        table.add_row(
            str(m.revision.number), manifest_hash(m)[:12], m.name, m.revision.reason or "(root)"
        )
    _console().print(table)


# --------------------------------------------------------------------------------------
# fp8ops train: the main job
# --------------------------------------------------------------------------------------


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


@app.command()
def train(
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
    )
    _report_training(result)


@app.command()
def resume(
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


@app.command()
def dualtrack(
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
) -> None:
    """Train MANIFEST three ways on the same data and tokens (a BF16 control, the FP8
    candidate, FP8 with high-risk modules in BF16), then compare them against the manifest's
    gates: exit 0 when every candidate passes, 1 when one fails.

    Resumable: run it again to continue an interrupted evaluation. For more than one rank,
    start it with `torchrun --nproc-per-node N -m fp8ops dualtrack ...`.
    """
    from fp8ops.dualtrack.run import run_dualtrack

    out = out or Path("runs") / f"{load_manifest(file).name}-dualtrack"
    outcomes = run_dualtrack(
        file, out, assignments=parse_assignments(set_ or []), progress=progress
    )
    if os.environ.get("RANK", "0") != "0":
        return
    console = _console()
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


def _report_training(result) -> None:
    if os.environ.get("RANK", "0") != "0":
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


# --------------------------------------------------------------------------------------
# fp8ops inspect: what a run directory records
# --------------------------------------------------------------------------------------


@app.command("inspect")
def inspect_run(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    layers: Annotated[
        bool, typer.Option("--layers", help="Every module's precision and why (layers.json).")
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
    """Summarise a run: recipe, per-layer precision (--layers: the full table), and the modules
    worst by a telemetry metric over the run's committed steps."""
    from rich import box

    from fp8ops.admission import read_layers_json  # no torch or Megatron needed to read it

    document = read_layers_json(run_dir)
    table = document.table
    out = _console()
    if not out.is_terminal:
        out.width = 200  # a log or a file: seven columns without folding module names
    recipe = document.recipe
    out.print(
        f"{run_dir}: manifest {document.manifest_hash[:12]}, tensor_parallel "
        f"{document.tensor_parallel}, layer table {document.table_hash[:12]}"
    )
    out.print(
        f"recipe: {recipe.fp8_format}, amax_history_len {recipe.amax_history_len}, "
        f"{recipe.amax_compute_algo}, margin {recipe.margin}, reduce_amax {recipe.reduce_amax}"
    )
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
                row.precision,
                row.reason.text,
            )
        out.print(grid)
    out.print(table.summary())
    if not layers:
        out.print(f"fp8ops inspect {run_dir} --layers: every module's precision and why")
    if (Path(run_dir) / "telemetry.zarr").exists():
        _print_worst(out, run_dir, worst, top, rank)


def _print_worst(out: Console, run_dir: Path, metric: str, top: int, rank: int) -> None:
    """The ``top`` modules with the largest ``metric`` over the run (NaN: never measured)."""
    import pandas as pd
    from rich import box

    from fp8ops.telemetry import open_run

    store = open_run(run_dir)
    window = store.metric_window(metric, rank=rank)  # steps x modules
    if window.empty:
        out.print(f"telemetry: no committed steps yet on rank {rank}")
        return
    summary = pd.DataFrame(
        {"max": window.max(), "mean": window.mean(), "last": window.ffill().iloc[-1]}
    ).sort_values("max", ascending=False)  # NaN (never measured) last
    measured = window.notna().sum()
    grid = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        title=f"worst {min(top, len(summary))} modules by {metric}, steps "
        f"{window.index[0]}-{window.index[-1]}, rank {rank}",
    )
    for name in ("module", "max", "mean", "last", "measured steps"):
        grid.add_column(name, overflow="fold", justify="left" if name == "module" else "right")
    for module, row in summary.head(top).iterrows():
        grid.add_row(
            str(module),
            f"{row['max']:.4g}",
            f"{row['mean']:.4g}",
            f"{row['last']:.4g}",
            str(int(measured[module])),
        )
    out.print(grid)


# --------------------------------------------------------------------------------------
# fp8ops alerts: what the alert rules reported during a run
# --------------------------------------------------------------------------------------


@app.command("alerts")
def alerts_(
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
) -> None:
    """List a run's alerts (alerts.jsonl): step, level, module, metric, value, threshold."""
    from rich import box

    from fp8ops.alerts import LEVELS, read_run_alerts, select_alerts
    from fp8ops.alerts.records import format_value

    if level is not None and level not in LEVELS:
        raise typer.BadParameter(f"{level!r}: choose {', '.join(LEVELS)}", param_hint="--level")
    alerts = read_run_alerts(run_dir)
    shown = select_alerts(alerts, level, module)
    out = _console()
    if not out.is_terminal:
        out.width = 200  # a log or a file: the table without folding module names
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


# --------------------------------------------------------------------------------------
# fp8ops checkpoints list
# --------------------------------------------------------------------------------------

checkpoints_app = typer.Typer(help="A run's training checkpoints.", no_args_is_help=True)
app.add_typer(checkpoints_app, name="checkpoints")


@checkpoints_app.command("list")
def checkpoints_list(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    verify: Annotated[
        bool, typer.Option(help="Also re-hash every file of every checkpoint.")
    ] = False,
) -> None:
    """List RUN_DIR's checkpoints: step, why it was saved, manifest, topology, size (exit 1
    when one is damaged)."""
    from rich import box

    from fp8ops.checkpoint import CheckpointDir, CheckpointError, read_meta
    from fp8ops.checkpoint.directory import verify_files

    store = CheckpointDir(run_dir)
    found = store.complete()
    if not found:
        raise Fp8opsError(f"{run_dir}: no checkpoints (no {store.path}/step_*)")
    try:
        latest = store.latest()
    except CheckpointError:
        latest = None
    damaged = False
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    columns = ["", "checkpoint", "step", "reason", "saved", "manifest", "TP x DP", "MiB"]
    for name in columns + (["files"] if verify else []):
        # Folded, not cropped: a damaged checkpoint's row names the file to look at.
        grid.add_column(
            name, justify="right" if name in ("step", "MiB") else "left", overflow="fold"
        )
    for path in found:
        try:
            meta = read_meta(path)
        except CheckpointError as exc:
            grid.add_row("", path.name, "", f"damaged: {exc}", "", "", "", "")
            damaged = True
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        topo = meta.topology
        row = [
            "*" if path == latest else "",
            path.name,
            str(meta.step),
            meta.reason,
            meta.saved_at,
            meta.manifest[:12],
            f"{topo.tensor_parallel} x {topo.data_parallel}",
            f"{size:.1f}",
        ]
        if verify:
            try:
                verify_files(path, meta.files)
                row.append("ok")
            except CheckpointError as exc:
                row.append(f"DAMAGED: {exc}")
                damaged = True
        grid.add_row(*row)
    out = _console()
    out.print(grid)
    out.print("* = latest (what `fp8ops resume` continues from)")
    if damaged:
        raise typer.Exit(1)  # scripts can gate on a damaged checkpoint


@checkpoints_app.command("export")
def checkpoints_export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="The weights checkpoint to write (a new directory).", show_default=False
        ),
    ],
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="A checkpoint's name or step (default: the latest).", metavar="NAME|STEP"
        ),
    ] = None,
) -> None:
    """Write one checkpoint's weights as a weights checkpoint (what final/ holds at the end),
    for model.init_checkpoint: the release of an earlier step, or a new run from a paused one."""
    from fp8ops.train.export import export_weights

    written = export_weights(run_dir, checkpoint, out)
    print(
        f"{out}: the weights of {written['exported_from']} (step {written['steps']}), "
        f"fingerprint {written['fingerprint'][:12]}; give it as model.init_checkpoint"
    )


# --------------------------------------------------------------------------------------
# fp8ops console, fp8ops whatif (fp8ops.console; docs/console.md)
# --------------------------------------------------------------------------------------


@app.command("console")
def console_(
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


@app.command("whatif")
def whatif_(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
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
    """Replay recorded amaxes through TE's delayed-scaling update under another window: the
    steps that would have overflowed and the headroom left, against the run's own settings."""
    import json

    from rich import box

    from fp8ops.console.whatif import SLOTS, report

    result = report(
        run_dir,
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
    out = _console()
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


# Further command groups (console, dualtrack, ...) go here, each a thin function over its
# package, registered on `app`.


if __name__ == "__main__":
    main()
