"""The ``fp8ops`` command line: the root mounts each package's commands (its ``cli.py``).

Each command parses its arguments, calls its package and prints. User errors are
``Fp8opsError``s; ``main`` prints their message (no traceback) and exits with their code (2, or
the error's own). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from fp8ops.alerts.cli import alerts_command
from fp8ops.checkpoint.cli import checkpoints_app
from fp8ops.compare.cli import compare_command
from fp8ops.console.cli import console_command, whatif_command
from fp8ops.dualtrack.cli import dualtrack_command
from fp8ops.errors import STORAGE_ERRNOS, Fp8opsError, StorageFull
from fp8ops.hf.cli import hf_app
from fp8ops.launch.cli import launch_app
from fp8ops.manifest.cli import manifest_app
from fp8ops.overrides.cli import overrides_app
from fp8ops.preflight.cli import preflight_command
from fp8ops.te_import.cli import import_te_debug_command
from fp8ops.telemetry.cli import inspect_command
from fp8ops.train.cli import resume_command, train_command

app = typer.Typer(
    name="fp8ops",
    help="Auditable, observable and locally reversible FP8 fine-tuning.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(manifest_app, name="manifest")
app.command("train")(train_command)
app.command("resume")(resume_command)
app.command("dualtrack")(dualtrack_command)
app.command("inspect")(inspect_command)
app.command("alerts")(alerts_command)
app.command("import-te-debug")(import_te_debug_command)
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(hf_app, name="hf")
app.command("console")(console_command)
app.command("whatif")(whatif_command)
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
        full = exc.errno in STORAGE_ERRNOS  # a full disk, wherever it was met: said once
        if exc.filename is None and not full:  # not about a path (a connection): a real fault
            raise
        # A path given (or the disk under it) failed: say which, as for every user error.
        paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
        where = f"{' -> '.join(paths)}: " if paths else ""
        print(f"[rank {rank}] " * (rank != 0) + f"{where}{exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(StorageFull.exit_code if full else 2) from None


if __name__ == "__main__":
    main()
