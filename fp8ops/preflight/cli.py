"""``fp8ops preflight MANIFEST|RUN_DIR`` (placeholder: being written)."""

from __future__ import annotations


def preflight_command() -> None:
    """The launch checklist (being written)."""
    raise NotImplementedError
