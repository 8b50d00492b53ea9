"""One exception hierarchy for everything a user can get wrong.

Every message says *where*: the file, the field path, the value and what is allowed.
The CLI turns these into a one-line (or few-line) message and the error's ``exit_code``, never a
traceback: 2 for what a user got wrong; subclasses elsewhere use 0 (nothing to do), 3 (a Stop
alert), 4 (a resume refused for drift), 5 (a run trained to its end whose result is not
releasable), 74 (a write refused by a full, over-quota or read-only file system:
:class:`StorageFull`) and 75 (stopped on request: requeue). Under several
ranks, errors marked ``collective`` (every rank raises them alike) are printed by rank 0 only.
"""

import errno
from pathlib import Path


def relative(path: Path) -> str:
    """For a message about a path: where a relative one was looked for (a resume started in
    another directory reads the manifest's relative paths from there)."""
    return "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"


class Fp8opsError(ValueError):
    """Root of all user-facing fp8ops errors."""

    exit_code = 2


class ManifestError(Fp8opsError):
    """A manifest file is missing, unreadable, malformed or inconsistent."""


class RevisionError(ManifestError):
    """A manifest revision chain is broken (missing parent, wrong hash, edited file)."""


class StorageFull(Fp8opsError):
    """A write failed because the file system under it is full, over quota or read-only; the
    message names the path and what was kept."""

    exit_code = 74  # sysexits.h's EX_IOERR (75, EX_TEMPFAIL, asks for a requeue)
    # Said once: the ranks meet one full disk (a save fails on every rank; the records are
    # rank 0's), each with its own path in the message, and rank 0 says it.
    collective = True


# What each storage errno means, as a message says it.
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
}


def storage_error(exc: BaseException) -> OSError | None:
    """The earliest ``OSError`` saying the disk is full, over quota or read-only among
    ``exc``, what it was raised from or while handling, and the failures it collects from
    workers (:func:`worker_failures`). None when none says so."""
    found, seen = [], set()

    def walk(error: BaseException | None) -> None:
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            found.append(error)
            for inner in worker_failures(error):
                walk(inner)
            suppressed = error.__suppress_context__ and error.__cause__ is None
            error = error.__cause__ or (None if suppressed else error.__context__)

    walk(exc)
    storage = [e for e in found if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS]
    return storage[-1] if storage else None


def worker_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions ``exc`` collects from the workers that failed (torch's
    ``CheckpointException.failures``: rank -> the exception, or (exception, its stack))."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    inner = [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return [f for f in inner if isinstance(f, BaseException)]
