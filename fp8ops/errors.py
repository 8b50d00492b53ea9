"""One exception hierarchy for everything a user can get wrong.

Every message says *where*: the file, the field path, the value and what is allowed.
The CLI turns these into a one-line (or few-line) message and exit code 2, never a traceback.
"""


class Fp8opsError(ValueError):
    """Root of all user-facing fp8ops errors."""

    exit_code = 2


class ManifestError(Fp8opsError):
    """A manifest file is missing, unreadable, malformed or inconsistent."""


class RevisionError(ManifestError):
    """A manifest revision chain is broken (missing parent, wrong hash, edited file)."""
