"""``fp8ops checkpoints list|export``: a run's training checkpoints."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from fp8ops.errors import Fp8opsError
from fp8ops.terminal import output

checkpoints_app = typer.Typer(help="A run's training checkpoints.", no_args_is_help=True)


@checkpoints_app.command("list")
def checkpoints_list(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    verify: Annotated[
        bool, typer.Option(help="Also re-hash every file of every checkpoint.")
    ] = False,
) -> None:
    """List RUN_DIR's checkpoints: step, why it was saved, manifest, topology, size (exit 1
    when one is damaged)."""
    from fp8ops.checkpoint.consistency import read_consistent
    from fp8ops.checkpoint.directory import CheckpointDir, CheckpointError, verify_files

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
            meta = read_consistent(path)
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
    out = output()
    out.print(grid)
    out.print("* = latest (what `fp8ops resume` continues from)")
    if damaged:
        raise typer.Exit(1)  # scripts can gate on a damaged checkpoint


class ExportFormat(str, Enum):
    fp8ops = "fp8ops"
    hf = "hf"


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
    format_: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="fp8ops: a weights checkpoint for model.init_checkpoint; hf: a Hugging Face "
            "checkpoint (safetensors, config.json, tokenizer files) for transformers.",
        ),
    ] = ExportFormat.fp8ops,
    verify: Annotated[
        bool | None,
        typer.Option(
            "--verify/--no-verify",
            help="--format hf: transformers' logits for the export must equal fp8ops' (without "
            "either flag the comparison runs and is recorded whenever transformers is installed; "
            "--no-verify skips it).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write one checkpoint's weights as a weights checkpoint (what final/ holds at the end),
    for model.init_checkpoint: the release of an earlier step, or a new run from a paused one;
    or, with --format hf, as a Hugging Face checkpoint to serve."""
    if verify is not None and format_ is not ExportFormat.hf:
        raise Fp8opsError("--verify/--no-verify: only with --format hf (a transformers check)")
    if format_ is ExportFormat.hf:
        from fp8ops.train.export import export_hf

        summary = export_hf(run_dir, checkpoint, out, verify=verify)
        check = summary.get("verification")
        verdict = (
            "not compared (transformers is not installed)"
            if check is None
            else f"largest logit difference from transformers {check['max_abs_logit_difference']:.2g}"
            f" ({'within' if check['passed'] else 'OVER'} {check['bound']:.2g})"
        )
        print(
            f"{out}: step {summary['steps']} of {summary['exported_from']} in Hugging Face form, "
            f"{summary['tensors']} tensors in {summary['shards']} file(s), {summary['dtype']}; "
            f"{verdict}"
        )
        return
    from fp8ops.train.export import export_weights  # torch and Megatron: only when asked

    written = export_weights(run_dir, checkpoint, out)
    print(
        f"{out}: the weights of {written['exported_from']} (step {written['steps']}), "
        f"fingerprint {written['fingerprint'][:12]}; give it as model.init_checkpoint"
    )
