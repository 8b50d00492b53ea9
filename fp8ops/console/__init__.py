"""The ops console: a Jupyter widgets app over a directory of runs, served by Voila.

Reading order: ``app`` (:class:`ConsoleApp`, the widgets and what they do), ``data`` (telemetry
pooled for the views), ``figures`` (the plotly figures), ``runs`` (finding runs, the header),
``ledger_state`` and ``resume_preview`` (the override ledger per module, what the next resume
applies), ``whatif`` (replaying recorded amaxes under another scaling window), ``server``
(``fp8ops console``: Voila on 127.0.0.1), ``notebook`` (the thin notebook it serves). See
``docs/console.md``.

Needs the ``console`` extra (ipywidgets, plotly, voila); ``whatif`` needs torch. Attributes load
on first use, so ``fp8ops console`` starts without importing any of them.
"""

import importlib

_WHERE = {"ConsoleApp": "app"}
__all__ = ["ConsoleApp"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
