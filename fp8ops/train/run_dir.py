"""The run directory: everything a run leaves behind, written by rank 0 only.

::

    RUN_DIR/
      manifest.yaml        the manifest the run is locked to (the derived revision under --set)
      manifests/           every revision in its lineage, content-addressed (<sha256>.yaml)
      run.json             fingerprints: manifest, environment, topology, data, tokenizer, model
      status.json          running | paused | interrupted | completed | failed | stopped, and the step (every log_interval)
      run.lock             created exclusively when the run claims the directory
      layers.json          per-layer admission (fp8ops.admission)
      metrics.jsonl        one line per optimizer step
      eval.jsonl           one line per evaluation
      events.jsonl         what happened, in order (start, admission, evaluations, end, errors)
      final/               the trained weights (a weights checkpoint, fp8ops.train.weights)
      checkpoints/         training checkpoints and the `latest` pointer (fp8ops.checkpoint)
      overrides.jsonl      the per-layer override ledger (fp8ops.overrides)
      fallbacks.json       modules running BF16 by approved override: since when, which revision
      attempts/N/          an attempt that ended before its first checkpoint, set aside by a
                           `train --resume` that started the run over

A resume continues in the same directory: ``manifest.yaml`` becomes the resumed revision, the
logs go on (a step logged again after a resume from an earlier checkpoint supersedes the
earlier line: :func:`read_metrics`), and ``events.jsonl`` records the resume.

Files that are rewritten (status, run info) are replaced atomically; the JSONL logs are only
appended to, a line at a time, so a crash loses at most the line being written.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, atomic_write_text
from fp8ops.manifest import ManifestStore, manifest_hash, write_manifest
from fp8ops.manifest.canonical import to_yaml
from fp8ops.manifest.schema import Manifest

MANIFEST = "manifest.yaml"
STATUS = "status.json"
ATTEMPTS = "attempts"  # unfinished attempts without a checkpoint, set aside by train --resume


class RunAlreadyComplete(Fp8opsError):
    """The run directory already holds a completed run of this very manifest."""

    exit_code = 0
    collective = True  # every rank raises it; rank 0 says so


class RunDir:
    """Writes one run's files. Construct with :meth:`claim`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._status: dict[str, Any] | None = None  # what status.json holds, kept in memory

    @classmethod
    def check_free(cls, path: Path, manifest: Manifest) -> None:
        """Refuse a directory that holds another run (call on every rank, before any writes).

        A completed run of the same manifest raises :class:`RunAlreadyComplete` (exit code 0:
        rerunning a finished command is not an error); anything else already there is refused,
        since writing into it would mix two runs' records.
        """
        path = Path(path)
        if not path.exists():
            return
        if not path.is_dir():
            raise Fp8opsError(f"--run-dir {str(path)!r} is a file, not a directory")
        if not any(p.name not in (ATTEMPTS, "stop.request") for p in path.iterdir()):
            return
        status = read_status(path)
        digest = manifest_hash(manifest)
        # The run's own manifest, or one of its revisions (it may have ended under a later one:
        # overrides applied, drift accepted): rerunning the command that started it.
        ended_under = (status or {}).get("manifest")
        own = digest in _revisions_run(path, ended_under)
        if status and status.get("state") == "completed" and own:
            later = "" if ended_under == digest else f"; it ended under revision {ended_under[:12]}"
            raise RunAlreadyComplete(
                f"{path} already holds a completed run of this manifest (sha256 {digest[:12]}"
                f"{later}); nothing to do. Its results are in that directory."
            )
        if _trained_now(path):
            raise Fp8opsError(
                f"--run-dir {str(path)!r} is being trained by another fp8ops process right now; "
                "wait for it to finish or stop it, or choose a new --run-dir"
            )
        if status is None:
            raise Fp8opsError(
                f"--run-dir {str(path)!r} holds files that are not an fp8ops run; choose a new "
                "--run-dir (fp8ops never writes over existing files)"
            )
        resumable = (path / "checkpoints" / "latest").exists()
        if resumable and status.get("state") in (
            "paused",
            "interrupted",
            "failed",
            "stopped",
            "running",
        ):
            raise Fp8opsError(
                f"--run-dir {str(path)!r} holds a {status.get('state')} run with checkpoints; "
                f"continue it with `fp8ops resume {path}` (or `fp8ops train MANIFEST --resume "
                f"--run-dir {path}`), or choose a new --run-dir"
            )
        advice = {
            "completed": "choose a new --run-dir (fp8ops never writes over a run)",
            "failed": "read its events.jsonl, then remove the directory to start over, or choose "
            "a new --run-dir",
            "running": "if no fp8ops process is using it, it was interrupted: remove the "
            "directory to start over, or choose a new --run-dir",
        }.get(status.get("state"), "choose a new --run-dir")
        raise Fp8opsError(
            f"--run-dir {str(path)!r} already holds a {status.get('state')} run of manifest "
            f"{str(status.get('manifest'))[:12]}; {advice}"
        )

    @classmethod
    def set_aside_unfinished(cls, path: Path, manifest: Manifest) -> Path | None:
        """``train --resume`` with nothing to resume from: an unfinished attempt of this same
        manifest (killed or failed before its first checkpoint) is moved into
        ``RUN_DIR/attempts/N/``, kept for its logs, so the run can start over. Returns where it
        went; anything else is left for :meth:`check_free` to judge (rank 0 only)."""
        path = Path(path)
        status = read_status(path) if path.is_dir() else None
        if (
            status is None
            or status.get("state") == "completed"
            or status.get("manifest") != manifest_hash(manifest)
            or (path / "checkpoints" / "latest").exists()
        ):
            return None
        holder = cls(path)
        holder._hold()  # refuses while a live process trains it
        try:
            attempts = path / ATTEMPTS
            numbers = [int(a.name) for a in attempts.glob("*") if a.name.isdigit()]
            target = attempts / str(max(numbers, default=0) + 1)
            target.mkdir(parents=True)
            for entry in path.iterdir():
                if entry.name != ATTEMPTS:
                    os.replace(entry, target / entry.name)
        finally:
            holder.release()
        return target

    @classmethod
    def claim(cls, path: Path, manifest: Manifest, lineage: list[Manifest]) -> RunDir:
        """Create the directory with the locked manifest and its lineage (rank 0 only).

        ``run.lock`` is created exclusively first: of two runs started into one directory at
        once, both of which passed :meth:`check_free`, exactly one gets it.
        """
        run = cls(path)
        run.path.mkdir(parents=True, exist_ok=True)
        try:
            lock = os.open(run.path / "run.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise Fp8opsError(
                f"--run-dir {str(run.path)!r} was claimed by another fp8ops run a moment ago; "
                "choose a new --run-dir"
            ) from None
        with os.fdopen(lock, "w") as f:
            f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        run._hold()
        store = ManifestStore(run.path / "manifests")
        for revision in lineage:
            store.put(revision)
        write_manifest(manifest, run.path / MANIFEST)
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
        store = ManifestStore(run.path / "manifests")
        for revision in new_revisions:
            store.put(revision)
        # The lock moves to the resumed revision (a new one, or an earlier one after a rewind);
        # every revision stays in manifests/.
        file = run.path / MANIFEST
        if not file.is_file() or file.read_text() != to_yaml(manifest):
            atomic_write_text(file, to_yaml(manifest))
        # A fresh status: an earlier attempt's error, alert, step or checkpoint is not this one's.
        run._status = {}
        run.set_status(
            "running", manifest=manifest_hash(manifest), step=step, resumed_from=checkpoint
        )
        return run

    def release(self) -> None:
        """Let go of ``run.lock`` (the run ended; safe to call twice, or without a lock)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()  # closing the descriptor drops the flock
            self._lock = None

    def _hold(self) -> None:
        """Hold an exclusive lock on ``run.lock`` while this process trains the run (the OS
        drops it when the process ends, however it ends): a second trainer is refused."""
        self._lock = open(self.path / "run.lock", "a")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Fp8opsError(
                f"{self.path} is being trained by another fp8ops process right now; wait for it "
                "to finish or stop it first"
            ) from None

    # -- whole files, replaced atomically ---------------------------------------------------

    def write_json(self, name: str, document: dict[str, Any]) -> None:
        atomic_write_text(self.path / name, json.dumps(document, indent=2, sort_keys=True) + "\n")

    def set_status(self, state: str, **fields: Any) -> None:
        if self._status is None:
            self._status = read_status(self.path) or {}
        self._status.update(fields, state=state, updated=_now())
        self.write_json(STATUS, self._status)

    # -- append-only logs --------------------------------------------------------------------

    def append(self, name: str, record: dict[str, Any]) -> None:
        append_lines(self.path / name, json.dumps(record, sort_keys=True) + "\n")

    def event(self, kind: str, **fields: Any) -> None:
        self.append("events.jsonl", {"event": kind, "time": _now(), **fields})


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The run's per-step records in step order, the latest line winning for a step that was
    logged again after a resume from an earlier checkpoint."""
    from fp8ops.files import latest_per_step, read_jsonl

    file = Path(path) / "metrics.jsonl"
    return latest_per_step(read_jsonl(file)) if file.exists() else []


def _trained_now(path: Path) -> bool:
    """Whether a live process holds the run's ``run.lock`` (``RunDir._hold``)."""
    try:
        with open(Path(path) / "run.lock", "rb") as lock:  # read-only: any reader may probe
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError:  # no lock file, or not readable: nothing known to hold it
        return False
    return False


def locked_manifest(path: Path) -> Manifest:
    """The run's ``manifest.yaml``, checked to be the revision ``status.json`` names and to
    be stored in ``manifests/``: decisions read from it (who may approve an override) must not
    follow an edit of the file."""
    from fp8ops.manifest import load_manifest

    file = Path(path) / MANIFEST
    manifest = load_manifest(file)
    digest, status = manifest_hash(manifest), read_status(path) or {}
    store = ManifestStore(Path(path) / "manifests")
    locked = status.get("manifest", digest)
    if digest != locked or not store.path_for(digest).exists():
        restore = (
            f"cp {store.path_for(locked)} {file}"
            if store.path_for(locked).exists()
            else ("restore it from a copy")
        )
        raise Fp8opsError(
            f"{file} hashes to {digest[:12]}, but the run is locked to {locked[:12]} "
            f"({Path(path) / STATUS}, {store.directory}): the file was edited after the run "
            f"wrote it. A change to a run is a new revision (fp8ops resume --set ... "
            f"--accept-drift); restore the file: {restore}"
        )
    store.get(digest)  # the stored copy still hashes to its name
    return manifest


def _revisions_run(path: Path, ended_under: str | None) -> set[str]:
    """The revisions a run trained under: from the one it ended under back through each
    parent to the one it started with (``run.json``). Not the parents of that one: a manifest
    given with ``--set`` is stored with the run, but never trained."""
    try:
        started = json.loads((path / "run.json").read_text()).get("manifest")
    except (OSError, ValueError, AttributeError):
        started = None
    store, found, digest = ManifestStore(path / "manifests"), set(), ended_under
    while digest and digest not in found:
        found.add(digest)
        if digest == started or not store.path_for(digest).exists():
            break
        digest = store.get(digest).revision.parent
    return found


def check_unedited(path: Path) -> None:
    """Before a resume: ``manifest.yaml`` is still one of the run's stored revisions. A resume
    runs its checkpoint's revision and writes that back to the file, so an edit there would be
    dropped without a word; it is refused (exit 4), with the fields it changed."""
    from fp8ops.checkpoint.drift import DriftRefused, manifest_drift
    from fp8ops.errors import ManifestError
    from fp8ops.manifest import load_manifest

    file = Path(path) / MANIFEST
    store = ManifestStore(Path(path) / "manifests")
    if not file.is_file() or not store.directory.is_dir():  # nothing to hold it to
        return
    locked = (read_status(path) or {}).get("manifest")
    known = locked is not None and store.path_for(locked).exists()
    restore = f"cp {store.path_for(locked)} {file}" if known else "restore it from a copy"
    try:
        manifest = load_manifest(file)
    except ManifestError as exc:
        raise DriftRefused(
            f"refusing to resume: {file} was edited after the run wrote it and no longer "
            f"loads ({exc}); restore it: {restore}"
        ) from None
    if store.path_for(manifest_hash(manifest)).exists():
        return
    changes = manifest_drift(store.get(locked), manifest) if known else []
    listed = "".join(f"\n{change.line()}" for change in changes)
    raise DriftRefused(
        f"refusing to resume: {file} was edited after the run wrote it{':' if listed else ''}"
        f"{listed}\nA resume runs its checkpoint's revision and would write over the edit. "
        f"Restore the file ({restore}), then resume; to change the run, add --set FIELD=VALUE "
        f"--accept-drift REASON (a new revision), or resume with the edited file as the "
        f"manifest: fp8ops train {file} --run-dir {Path(path)} --resume --accept-drift REASON"
    )


def read_status(path: Path) -> dict[str, Any] | None:
    """A run directory's status, or None if it has none."""
    file = Path(path) / STATUS
    try:
        status = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8opsError(f"{file}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(status, dict):
        raise Fp8opsError(
            f"{file}: holds a JSON {type(status).__name__}, not an object; the file is damaged"
        )
    return status


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
