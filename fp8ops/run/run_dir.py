"""The run directory's one writer: :class:`RunDir` (its files: :mod:`fp8ops.run.layout`).

Every rank holds a ``RunDir``; only rank 0's writes (``writer=True``), so the code that trains
says what happened once, without asking which rank it is on.

A resume continues in the same directory: ``manifest.yaml`` becomes the resumed revision, the
logs go on (a step logged again after a resume from an earlier checkpoint supersedes the earlier
line: :func:`~fp8ops.run.records.read_metrics`), and ``events.jsonl`` records the resume.

Files that are rewritten (status, run record, fallbacks) are replaced atomically; the JSONL logs
are only appended to, a line at a time, so a crash loses at most the line being written.

What rank 0 appends is also handed, once written, to the run's listeners (:meth:`RunDir.listen`):
the metric sinks follow a run this way (``fp8ops.sinks``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, atomic_write_text, json_line, open_log, open_regular
from fp8ops.manifest import ManifestStore, load_manifest, manifest_hash, write_manifest
from fp8ops.manifest.canonical import to_yaml
from fp8ops.manifest.schema import Manifest
from fp8ops.run.layout import RunLayout
from fp8ops.run.records import (
    EvalRow,
    Fallback,
    MetricsRow,
    RunRecord,
    Status,
    find_status,
    read_fallbacks,
)


class RunDir:
    """Writes one run's files (rank 0: ``writer=True``; other ranks' writes do nothing).

    Rank 0 starts a run with :meth:`claim` or continues one with :meth:`reopen`; both hold
    ``run.lock`` until :meth:`release`, so a second trainer of the same directory is refused.
    """

    def __init__(self, path: Path, *, writer: bool = True):
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.writer = writer
        self._status: dict[str, Any] | None = None  # what status.json holds, kept in memory
        self._lock = None
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        # A listener's thread records its own failures as events: one append at a time.
        self._appending = threading.Lock()

    @classmethod
    def claim(cls, path: Path, manifest: Manifest, lineage: list[Manifest]) -> RunDir:
        """Create the directory with the locked manifest and its lineage (rank 0 only).

        ``run.lock`` is created exclusively first: of two runs started into one directory at
        once, both of which found it free, exactly one gets it.
        """
        run = cls(path)
        run.path.mkdir(parents=True, exist_ok=True)
        try:
            lock = os.open(run.layout.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise Fp8opsError(
                f"--run-dir {str(run.path)!r} was claimed by another fp8ops run a moment ago; "
                "choose a new --run-dir"
            ) from None
        os.close(lock)  # _hold takes it, and writes who holds it
        run._hold()
        with run._released_on_failure():
            store = ManifestStore(run.layout.manifests)
            for revision in lineage:
                store.put(revision)
            write_manifest(manifest, run.layout.manifest)
            run.set_status("running", step=0, manifest=manifest_hash(manifest))
        return run

    @classmethod
    def reopen(
        cls,
        path: Path,
        manifest: Manifest,
        new_revisions: list[Manifest],
        *,
        step: int,
        checkpoint: str,
    ) -> RunDir:
        """Continue a run in its own directory from ``checkpoint`` at ``step`` (a resume; rank 0
        only): the revisions the resume adds are stored and ``manifest.yaml`` becomes the one
        it is locked to."""
        run = cls(path)
        run._hold()
        with run._released_on_failure():
            store = ManifestStore(run.layout.manifests)
            for revision in new_revisions:
                store.put(revision)
            # The lock moves to the resumed revision (a new one, or an earlier one after a
            # rewind); every revision stays in manifests/.
            file = run.layout.manifest
            if not file.is_file() or file.read_text() != to_yaml(manifest):
                atomic_write_text(file, to_yaml(manifest))
            # A fresh status: an earlier attempt's error, alert, step or checkpoint is not this
            # one's.
            run._status = {}
            run.set_status(
                "running", manifest=manifest_hash(manifest), step=step, resumed_from=checkpoint
            )
        return run

    def advance_manifest(self, revision: Manifest) -> None:
        """A revision made during training (an auto-degrade switch) becomes the run's: stored
        in ``manifests/``, written to ``manifest.yaml`` and named in ``status.json``, as a
        resume does with the revisions it adds (rank 0 only)."""
        if not self.writer:
            return
        ManifestStore(self.layout.manifests).put(revision)
        atomic_write_text(self.layout.manifest, to_yaml(revision))
        self.set_status("running", manifest=manifest_hash(revision))

    @classmethod
    def set_aside_unfinished(cls, path: Path, manifest: Manifest) -> Path | None:
        """``train --resume`` with nothing to resume from: an unfinished attempt of this same
        manifest (killed or failed before its first checkpoint) is moved into
        ``RUN_DIR/attempts/N/``, kept for its logs, so the run can start over. Returns where it
        went; anything else is left alone (rank 0 only)."""
        layout = RunLayout(path)
        status = find_status(path) if layout.root.is_dir() else None
        if (
            status is None
            or status.state == "completed"
            or status.manifest != manifest_hash(manifest)
            or (layout.checkpoints / "latest").exists()
        ):
            return None
        holder = cls(path)
        holder._hold()  # refuses while a live process trains it
        try:
            numbers = [int(a.name) for a in layout.attempts.glob("*") if a.name.isdigit()]
            target = layout.attempts / str(max(numbers, default=0) + 1)
            target.mkdir(parents=True)
            for entry in layout.root.iterdir():
                if entry != layout.attempts:
                    os.replace(entry, target / entry.name)
        finally:
            holder.release()
        return target

    def release(self) -> None:
        """Let go of ``run.lock`` (the run ended; safe to call twice, or without a lock)."""
        if self._lock is not None:
            self._lock.close()  # closing the descriptor drops the flock
            self._lock = None

    @contextlib.contextmanager
    def _released_on_failure(self):
        """A claim or reopen that fails (a full disk) lets go of ``run.lock``: nobody else
        would, in a process that goes on (a test, a notebook)."""
        try:
            yield
        except BaseException:
            self.release()
            raise

    def _hold(self) -> None:
        """Hold an exclusive lock on ``run.lock`` while this process trains the run (the OS
        drops it when the process ends, however it ends): a second trainer is refused."""
        self._lock = open_log(self.layout.lock)  # held until release(); never through a link
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise Fp8opsError(trained_elsewhere(self.path, lock_holder(self.path))) from None
        # Who holds it, for the refusals of others (lock_holder): this process now.
        self._lock.truncate(0)
        self._lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        self._lock.flush()

    # -- the records ------------------------------------------------------------------------

    def started(self, record: RunRecord) -> None:
        """A new run's ``run.json`` and its ``run_started`` event."""
        self._write_json(self.layout.run_record, record.model_dump(mode="json"))
        self.event("run_started", manifest=record.manifest)

    def set_status(self, state: str, **fields: Any) -> None:
        """Merge ``fields`` into ``status.json`` under ``state`` (checked as a :class:`Status`)."""
        if not self.writer:
            return
        if self._status is None:
            found = find_status(self.path)
            self._status = {} if found is None else found.model_dump(exclude_unset=True)
        merged = {**self._status, **fields, "state": state, "updated": _now()}
        self._status = Status.model_validate(merged).model_dump(mode="json", exclude_unset=True)
        self._write_json(self.layout.status, self._status)

    def log_metrics(self, row: MetricsRow, *, with_status: bool) -> None:
        """A step's line in ``metrics.jsonl``; ``with_status``: ``status.json``'s step too
        (rewritten with an fsync, so not on every step)."""
        self._append(self.layout.metrics, row.model_dump(mode="json"))
        if with_status:
            self.set_status("running", step=row.step)

    def log_eval(self, row: EvalRow) -> None:
        self._append(self.layout.evals, row.model_dump(mode="json"))
        self.event("evaluated", step=row.step, loss=row.loss)

    def event(self, kind: str, **fields: Any) -> None:
        self._append(self.layout.events, {"event": kind, "time": _now(), **fields})

    def completed(self, step: int, seconds: float) -> None:
        self.set_status("completed", step=step)
        self.event("train_completed", seconds=round(seconds, 3))

    def paused(self, step: int, checkpoint: str, why: str, *, requested: bool) -> None:
        """Checkpointed and stopped at a step boundary: ``--stop-at`` (paused) or a stop request
        (interrupted: the scheduler requeues), which is answered."""
        state = "interrupted" if requested else "paused"
        self.set_status(state, step=step, checkpoint=checkpoint, reason=why)
        self.event(state, step=step, checkpoint=checkpoint, reason=why)
        if self.writer:
            self.layout.stop_request.unlink(missing_ok=True)

    def stopped(self, alert: dict[str, Any], checkpoint: str) -> None:
        """A Stop alert ended the run after a checkpoint of the step that raised it."""
        self.set_status("stopped", step=alert["step"], alert=alert, checkpoint=checkpoint)
        self.event("stopped", alert=alert, checkpoint=checkpoint)

    def failed(self, exc: BaseException, step: int | None = None) -> bool:
        """Why the run stopped (and the last ``step`` it finished, where known), so nobody
        mistakes it for a live or finished one. Whether ``status.json`` says so: on a full disk
        it may not be writable, and that is not raised, so the failure that stopped the run
        stays the one reported."""
        error = f"{type(exc).__name__}: {exc}"
        reached = {} if step is None else {"step": step}
        try:
            self.set_status("failed", error=error, **reached)
        except OSError:
            return False
        with contextlib.suppress(OSError):
            self.event("failed", error=error, **reached)
        return True

    def write_fallbacks(self, overrides: Iterable, *, from_step: int, revision: str) -> None:
        """``fallbacks.json``: module -> dtype, reason, the step it took effect, revision, for
        the manifest's ``precision.overrides``. An entry keeps its first step across resumes
        (the same approval); a lifted one is gone."""
        overrides = list(overrides)
        if not self.writer or (not overrides and not self.layout.fallbacks.exists()):
            return
        before = read_fallbacks(self.path)
        table = {}
        for override in overrides:
            earlier = before.get(override.module)
            if earlier is not None and earlier.approval == override.approval:
                table[override.module] = earlier
                continue
            gemms = getattr(override, "gemms", None)
            table[override.module] = Fallback(
                dtype=override.dtype,
                reason=override.reason,
                approval=override.approval,
                from_step=from_step,
                revision=revision,
                gemms=None if gemms is None else list(gemms),
            )
        document = {
            module: entry.model_dump(mode="json", exclude=None if entry.gemms else {"gemms"})
            for module, entry in table.items()
        }
        self._write_json(self.layout.fallbacks, document)

    def _write_json(self, file: Path, document: dict[str, Any]) -> None:
        if self.writer:
            atomic_write_text(file, json.dumps(document, indent=2, sort_keys=True) + "\n")

    def listen(self, listener: Callable[[str, dict[str, Any]], None]) -> None:
        """Hand every record appended from now on to ``listener(file name, record)`` once it is
        written (rank 0: ``metrics.jsonl``, ``eval.jsonl``, ``events.jsonl``). Called on the
        training step's path, so it must return at once (the sinks queue it)."""
        if self.writer:
            self._listeners.append(listener)

    def _append(self, file: Path, record: dict[str, Any]) -> None:
        if self.writer:
            with self._appending:
                append_lines(file, json_line(record))
            for listener in self._listeners:
                listener(file.name, record)


def trained_now(path: Path) -> bool:
    """Whether a live process holds the run's ``run.lock`` (``RunDir._hold``)."""
    return lock_holder(path) is not None


def trained_elsewhere(path: Path, holder: str | None) -> str:
    """What every refusal of a run that another live process trains says."""
    return (
        f"{path} is being trained by another fp8ops process right now "
        f"({holder or 'an unknown process'}): wait for it to finish, or stop it first"
    )


def lock_holder(path: Path) -> str | None:
    """Who holds the run's ``run.lock`` ("pid N on HOST", or "an unknown process"), or None
    when no live process holds it. A ``run.lock`` that is not a regular file (a link, a FIFO
    that an ordinary open waits on forever) is refused (:func:`~fp8ops.files.open_regular`)."""
    try:
        with open_regular(RunLayout(path).lock) as lock:  # read-only: any reader may probe
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                said = lock.read(200).decode(errors="replace").strip()
                said = "".join(c for c in said if c.isprintable())  # anyone may write the file
                return said if said.startswith("pid ") else "an unknown process"
            fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError:  # no lock file, or not readable: nothing known to hold it
        return None
    return None


def locked_manifest(path: Path) -> Manifest:
    """The run's ``manifest.yaml``, checked to be the revision ``status.json`` names and to
    be stored in ``manifests/``: decisions read from it (who may approve an override) must not
    follow an edit of the file."""
    layout = RunLayout(path)
    manifest = load_manifest(layout.manifest)
    digest, status = manifest_hash(manifest), find_status(path)
    store = ManifestStore(layout.manifests)
    locked = status.manifest if status is not None and status.manifest else digest
    if digest != locked or not store.path_for(digest).exists():
        restore = (
            f"cp {store.path_for(locked)} {layout.manifest}"
            if store.path_for(locked).exists()
            else "restore it from a copy"
        )
        raise Fp8opsError(
            f"{layout.manifest} hashes to {digest[:12]}, but the run is locked to {locked[:12]} "
            f"({layout.status}, {store.directory}): the file was edited after the run "
            f"wrote it. A change to a run is a new revision (fp8ops resume --set ... "
            f"--accept-drift); restore the file: {restore}"
        )
    store.get(digest)  # the stored copy still hashes to its name
    return manifest


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
