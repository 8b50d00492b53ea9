"""One exception hierarchy for everything a user can get wrong.

Every message says *where*: the file, the field path, the value and what is allowed.
The CLI turns these into a one-line (or few-line) message and the error's ``exit_code``, never a
traceback: 2 for what a user got wrong; subclasses elsewhere use 0 (nothing to do), 3 (a Stop
alert), 4 (a resume refused for drift), 5 (a run trained to its end whose result is not
releasable) and 75 (stopped on request: requeue). Under several
ranks, errors marked ``collective`` (every rank raises them alike) are printed by rank 0 only.
"""

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
