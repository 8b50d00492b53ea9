"""Runs fp8ops did not train, read in: Transformer Engine's debug-API statistics logs.

Reading order: ``logs`` (nvdlfw_inspect's per-rank statistics logs, line by line, every problem
naming its file and line), ``names`` (TE's layer, tensor and stat names, and which stats fill a
metric of fp8ops' catalogue), ``importer`` (:func:`import_te_debug`: the store, the run records
and, with a manifest, the replayed alerts, written whole or not at all), ``cli``
(``fp8ops import-te-debug``). What is read, the name mapping and the limits:
docs/telemetry.md, "Importing Transformer Engine debug logs".
"""

import importlib

# Loaded on first use (PEP 562): every `fp8ops` command imports `te_import.cli` to register
# `import-te-debug`, and the importer's imports (numpy, zarr, the alert rules) are not needed
# for that.
_WHERE = {"ImportResult": "importer", "import_te_debug": "importer", "TeLogError": "logs"}

__all__ = ["ImportResult", "TeLogError", "import_te_debug"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
