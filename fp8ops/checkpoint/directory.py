"""Where a run's training checkpoints live, and how they are made durable and found again.

::

    RUN_DIR/checkpoints/
      step_00000100/            one checkpoint (a Megatron dist_checkpointing directory + ours)
        fp8ops_checkpoint.json  what it holds, what it was made under, every file's sha256
        manifest.yaml           the manifest revision it was trained under (self-contained)
        .metadata, *.distcp, common.pt, metadata.json   (dist_checkpointing's files)
      step_00000200/
      latest                    the name of the newest complete checkpoint, replaced atomically
      superseded/               checkpoints after the one a resume went back to (kept, unused)
      .step_00000300.partial/   a save in progress (or cut short): never read

A save writes into the hidden ``.partial`` directory, renames it into place when complete, and
only then moves ``latest``. Old checkpoints are renamed away before they are deleted. So a
``kill -9`` at any moment leaves ``latest`` naming a whole checkpoint.

Loading never runs pickled code that is not a checkpoint's own metadata: torch's distributed
checkpoint keeps its index (``.metadata``) as a pickle, which is read here through an
allow-list of torch's metadata classes before torch reads it; ``common.pt`` is loaded with
``weights_only``; everything of fp8ops' own is JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import itertools
import os
import pickle
import re
import shutil
from pathlib import Path

from fp8ops.errors import Fp8opsError
from fp8ops.files import atomic_write_text
from fp8ops.run import RunLayout

LATEST = "latest"
SUPERSEDED = "superseded"  # checkpoints after the one a resume went back to
META_FILE = "fp8ops_checkpoint.json"
_NAME = re.compile(r"step_(\d{8})")


class CheckpointError(Fp8opsError):
    """A checkpoint that is missing, incomplete or damaged; the message names the file."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(name: str) -> int | None:
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


class CheckpointDir:
    """``RUN_DIR/checkpoints``: the complete checkpoints, newest last, and the ``latest`` pointer."""

    def __init__(self, run_dir: Path):
        self.path = RunLayout(run_dir).checkpoints

    def complete(self) -> list[Path]:
        """Every complete checkpoint directory, oldest first (partial saves are not listed)."""
        if not self.path.is_dir():
            return []
        found = [
            p for p in self.path.iterdir() if p.is_dir() and checkpoint_step(p.name) is not None
        ]
        return sorted(found, key=lambda p: checkpoint_step(p.name))

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, or None when the run has none yet.

        Without the pointer, the newest complete checkpoint: a save killed between its rename
        and the pointer's update left a whole checkpoint that nothing points to yet.
        """
        pointer = self.path / LATEST
        if not pointer.is_file():
            complete = self.complete()
            return complete[-1] if complete else None
        name = pointer.read_text(errors="replace").strip()
        replaced = self.path / f".{name}.replaced"
        named = self.path / name
        if checkpoint_step(name) is not None and replaced.is_dir() and not named.exists():
            raise CheckpointError(
                f"{pointer} names {name!r}, whose save again was cut short between its two "
                f"renames; the previous {name} is whole in {replaced}. Put it back with "
                f"`mv {replaced} {named}`, then resume"
            )
        if checkpoint_step(name) is None or not named.is_dir():
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a checkpoint here; "
                f"list them with `fp8ops checkpoints list {self.path.parent}` and resume from one "
                "with --checkpoint NAME"
            )
        return self.path / name

    def find(self, name: str | None) -> Path:
        """The checkpoint to resume from: ``name`` (a directory name or a step) or the latest."""
        if name is None:
            latest = self.latest()
            if latest is None:
                raise CheckpointError(
                    f"{self.path.parent} has no checkpoint to resume from (no {self.path / LATEST})"
                )
            return latest
        wanted = checkpoint_name(int(name)) if name.isdigit() else name
        path = self.path / wanted
        if checkpoint_step(wanted) is None or not path.is_dir():
            names = ", ".join(p.name for p in self.complete()) or "none"
            raise CheckpointError(f"{path}: no such checkpoint (this run has: {names})")
        return path

    def begin(self, step: int) -> Path:
        """A fresh, empty ``.partial`` directory for the save of ``step`` (rank 0 only).

        Leftovers of saves and deletions that a crash cut short (hidden ``.partial`` and
        ``.deleting`` directories, the pointer's temporary files) are removed first: one
        process trains a run at a time (``run.lock``), so none of them is in use. A
        ``.replaced`` checkpoint whose step is missing is the only copy of that step, and is
        moved to ``superseded/`` instead.
        """
        if self.path.is_dir():
            for leftover in self.path.glob(".*"):
                name = leftover.name.removeprefix(".").removesuffix(".replaced")
                if leftover.name.endswith(".replaced") and not (self.path / name).exists():
                    # The only whole copy of its step (a save of it again was cut short): kept
                    # where it is never loaded or pruned.
                    os.replace(leftover, self._superseded(name))
                elif leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
        partial = self.path / f".{checkpoint_name(step)}.partial"
        partial.mkdir(parents=True)
        return partial

    def partial(self) -> list[Path]:
        """The ``.partial`` directories of saves in progress or cut short."""
        return sorted(self.path.glob(".*.partial")) if self.path.is_dir() else []

    def discard_partial(self) -> list[str]:
        """Remove the ``.partial`` directories of saves that failed (a full disk: the space
        they hold is what the run's records need to say so); their names (rank 0 only). Never
        read, and :meth:`begin` would remove them anyway."""
        partial = self.partial()
        for leftover in partial:
            shutil.rmtree(leftover, ignore_errors=True)
        return [p.name for p in partial]

    def publish(self, partial: Path, step: int, keep: int | None) -> Path:
        """Make a finished save visible: fsync its files, rename it into place, move ``latest``,
        then delete all but the newest ``keep`` checkpoints (None: none deleted; rank 0
        only)."""
        for file in partial.rglob("*"):
            if file.is_file():
                _fsync_path(file)
        _fsync_path(partial)
        final = self.path / checkpoint_name(step)
        replaced = None
        if final.exists():  # the same step saved again (a resume at or before it, then a stop)
            replaced = final.with_name(f".{final.name}.replaced")
            os.replace(final, replaced)  # renamed, not yet deleted: `latest` may still name it
        os.replace(partial, final)
        _fsync_path(self.path)
        atomic_write_text(self.path / LATEST, final.name + "\n")
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        for old in self.complete()[:-keep] if keep is not None else []:
            _remove(old)
        return final

    def rewind(self, checkpoint: Path) -> list[Path]:
        """A resume from ``checkpoint`` when later ones exist: those move to ``superseded/``
        (kept, never loaded or pruned) and ``latest`` names ``checkpoint``, so a requeue before
        the next save continues this run, not the abandoned one (rank 0 only)."""
        later = [
            p for p in self.complete() if checkpoint_step(p.name) > checkpoint_step(checkpoint.name)
        ]
        pointer = self.path / LATEST
        named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
        if not later and named == checkpoint.name:  # (a pointer to nothing is rewritten)
            return []
        atomic_write_text(self.path / LATEST, checkpoint.name + "\n")  # first: never a gap
        moved = []
        for path in later:
            target = self._superseded(path.name)
            os.replace(path, target)
            moved.append(target)
        return moved

    def _superseded(self, name: str) -> Path:
        """A new place in ``superseded/`` for checkpoint ``name``: a second rewind past the same
        step keeps both abandoned checkpoints (``step_N``, ``step_N.2``, ...)."""
        target = self.path / SUPERSEDED / name
        for attempt in itertools.count(2):
            if not target.exists():
                break
            target = self.path / SUPERSEDED / f"{name}.{attempt}"
        target.parent.mkdir(exist_ok=True)
        return target


def _remove(path: Path) -> None:
    # Renamed first (atomic), so a crash mid-delete leaves a hidden leftover, not a damaged
    # checkpoint that looks complete.
    doomed = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- integrity ----------------------------------------------------------------------------


def file_digests(directory: Path) -> dict[str, dict[str, int | str]]:
    """``{relative path: {size, sha256}}`` of every file but the metadata file itself."""
    digests = {}
    for file in sorted(directory.rglob("*")):
        if file.is_file() and file.name != META_FILE:
            digests[file.relative_to(directory).as_posix()] = {
                "size": file.stat().st_size,
                "sha256": _sha256(file),
            }
    return digests


def verify_files(directory: Path, expected: dict[str, dict[str, int | str]]) -> None:
    """Every file the checkpoint was saved with is there, whole and unchanged; then its pickles
    are checked to hold only data (see the module docstring)."""
    for name, want in expected.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; {damaged(directory)}")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"{file}: {size} bytes, but it was saved with {want['size']} (truncated or "
                f"replaced); {damaged(directory)}"
            )
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(
                f"{file}: its content changed since it was saved (sha256 mismatch); "
                f"{damaged(directory)}"
            )
    present = {
        f.relative_to(directory).as_posix()
        for f in directory.rglob("*")
        if f.is_file() and f.name != META_FILE
    }
    extra = sorted(present - set(expected))
    if extra:
        raise CheckpointError(
            f"{directory / extra[0]}: not part of the checkpoint as saved; remove it or "
            f"{damaged(directory)}"
        )
    for file in directory.rglob(".metadata"):
        check_dcp_metadata(file)
    import torch  # here: listing and planning read no tensors

    for file in directory.rglob("common.pt"):
        try:
            torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means: do not load it
            raise CheckpointError(
                f"{file}: holds more than tensors and plain data ({exc}); {damaged(directory)}"
            ) from None


def damaged(directory: Path) -> str:
    """Advice for a damaged checkpoint: the previous complete one, to resume from."""
    store = CheckpointDir(directory.parent.parent)
    older = [p for p in store.complete() if p.name < directory.name]
    if older:
        return (
            f"the checkpoint {directory.name} is damaged. The previous one is {older[-1].name}: "
            f"resume from it with --checkpoint {older[-1].name}"
        )
    return (
        f"the checkpoint {directory.name} is damaged and the run has no earlier one: restore it "
        "from a backup, or train the run again in a new --run-dir"
    )


# torch's distributed-checkpoint index: the dataclasses and enums these modules define (not
# whatever they import: pathlib.Path, torch.Tensor, writers), torch dtypes, torch.Size, and
# torch's layout lookup. Anything else in the pickle is refused unread.
_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if module in _DCP_MODULES:
            found = super().find_class(module, name)
            plain = dataclasses.is_dataclass(found) or (
                isinstance(found, type) and issubclass(found, enum.Enum)
            )
            if isinstance(found, type) and found.__module__ == module and plain:
                return found
        torch_type = module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        )
        if torch_type or (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def check_dcp_metadata(path: Path) -> None:
    """Refuse a ``.metadata`` pickle that names anything but torch's checkpoint metadata."""
    try:
        _DcpMetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not let torch unpickle it
        raise CheckpointError(
            f"{path}: not a plain torch checkpoint index ({exc}); refusing to load it"
        ) from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
