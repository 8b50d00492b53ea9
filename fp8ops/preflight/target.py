"""What preflight checks: a manifest file about to be launched, or a run directory.

For a run directory the manifest is the run's locked ``manifest.yaml``, and the file the run was
started from is looked up in ``run.json``'s command line (``fp8ops train FILE ...``), since the
version-control and gates items are about that file, not about the canonical copy fp8ops wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import load_manifest
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunLayout, RunRecord, RunRecordError, read_run_record
from fp8ops.run.layout import MANIFEST, RUN_RECORD

# Options of `fp8ops train` that take a value: the manifest is the argument that is none of them.
# The options of `fp8ops train` and `fp8ops dualtrack` that take a value (the manifest file is
# the one positional argument of either).
_VALUED_OPTIONS = {"--run-dir", "--set", "--accept-drift", "--stop-at", "--out"}
_STARTERS = ("train", "dualtrack")


@dataclass(frozen=True)
class Target:
    path: Path  # as given on the command line
    manifest: Manifest  # the file's, or the run's locked manifest.yaml
    manifest_file: Path | None  # the manifest file (for a run: the one it started from, if found)
    run_dir: Path | None = None  # None: a manifest file
    run_info: RunRecord | None = None  # run.json
    source_problem: str | None = None  # why a run's manifest file was not found

    @property
    def is_run(self) -> bool:
        return self.run_dir is not None


def resolve_target(path: Path) -> Target:
    """The target ``path`` names; :class:`Fp8opsError` (exit 2) for anything else."""
    path = Path(path)
    if not path.exists():
        raise Fp8opsError(
            f"preflight: {path}: no such file or directory; give a manifest file "
            "(e.g. manifests/tiny-gpt-cpu.yaml) or a run directory (e.g. runs/tiny-gpt-cpu)"
        )
    if path.is_file():
        return Target(path, load_manifest(path), path)  # an invalid manifest: its own message
    layout = RunLayout(path)
    if not layout.run_record.is_file() or not layout.manifest.is_file():
        missing = RUN_RECORD if not layout.run_record.is_file() else MANIFEST
        raise Fp8opsError(
            f"preflight: {path} is a directory but not an fp8ops run (no {missing}); give a run "
            "directory that `fp8ops train` has started (it writes run.json when training "
            "starts), or a manifest file"
        )
    try:
        info = read_run_record(path)
    except RunRecordError as exc:
        raise Fp8opsError(f"preflight: {exc}") from None
    source, problem = _source_file(info)
    return Target(path, load_manifest(layout.manifest), source, path, info, problem)


def _source_file(info: RunRecord) -> tuple[Path | None, str | None]:
    """The manifest file in run.json's command line, or why there is none to be found."""
    command = info.command
    shown = " ".join(map(str, command)) or "(none)"
    starter = next((word for word in _STARTERS if word in command), None)
    if starter is None:
        return None, (
            f"run.json's command ({shown}) is not an `fp8ops train` or `fp8ops dualtrack` "
            "command line, so the manifest file the run started from cannot be found"
        )
    args = iter(command[command.index(starter) + 1 :])
    for arg in args:
        if arg in _VALUED_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            file = Path(arg)
            if file.is_file():
                return file, None
            return None, (
                f"the run was started from {arg} (run.json's command: {shown}), which is not "
                f"there relative to {Path.cwd()}; run preflight from the directory the run was "
                "started in"
            )
    return None, f"run.json's command ({shown}) names no manifest file"
