"""Runs fp8ops did not train, read in: Transformer Engine's debug-API statistics logs.

Reading order: ``logs`` (nvdlfw_inspect's per-rank statistics logs, line by line, every problem
naming its file and line), ``names`` (TE's layer, tensor and stat names, and which stats fill a
metric of fp8ops' catalogue), ``importer`` (:func:`import_te_debug`: the store, the run records
and, with a manifest, the replayed alerts, written whole or not at all), ``cli``
(``fp8ops import-te-debug``). What is read, the name mapping and the limits:
docs/telemetry.md, "Importing Transformer Engine debug logs".
"""

from fp8ops.te_import.importer import ImportResult, import_te_debug
from fp8ops.te_import.logs import TeLogError

__all__ = ["ImportResult", "TeLogError", "import_te_debug"]
