"""The notebook ``fp8ops console`` serves: one cell that builds the app and displays it.

``notebooks/console.ipynb`` is this notebook, written by :func:`write_notebook` (a test checks
that the two agree); an installed fp8ops without the repository writes it to a temporary
directory instead. All logic lives in :mod:`fp8ops.console.app`.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = """\
# The fp8ops ops console (docs/console.md). `fp8ops console [RUNS_DIR] [--user NAME]` serves
# this notebook with Voila. In Jupyter it shows $FP8OPS_CONSOLE_RUNS, else the nearest runs/.
from fp8ops.console import ConsoleApp

app = ConsoleApp.from_environment()
app"""

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def notebook():
    import nbformat

    cell = nbformat.v4.new_code_cell(SOURCE)
    cell["id"] = "fp8ops-console"  # fixed, so the file is the same every time it is written
    return nbformat.v4.new_notebook(
        cells=[cell],
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
    )


def write_notebook(path: str | Path) -> Path:
    import nbformat

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook(), path)
    return path
