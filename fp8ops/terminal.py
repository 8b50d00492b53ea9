"""How commands print tables: one rich console setting for every ``cli.py``."""

from __future__ import annotations

import sys

from rich.console import Console


def output(width: int = 120) -> Console:
    """A console for a command's output. Markup is off (globs like ``[0-3]`` are text); piped
    output (a log, a file) gets ``width`` columns, room for the wider tables."""
    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else width)
