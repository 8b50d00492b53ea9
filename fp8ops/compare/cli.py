"""``fp8ops compare RUN...`` (placeholder: being written)."""

from __future__ import annotations


def compare_command() -> None:
    """Compare runs against gates (being written)."""
    raise NotImplementedError
