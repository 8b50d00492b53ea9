"""Training checkpoints with the exact FP8 state, and the weights checkpoints runs start from
and end with.

``directory`` (where checkpoints live, atomic publish, integrity), ``meta`` (the JSON record),
``state`` (what is saved, as sharded tensors), ``training`` (save/load, collective), ``weights``
(a base in, ``final/`` out, with fingerprints), ``cli`` (``fp8ops checkpoints``). Whether and how
a run resumes from one is decided in :mod:`fp8ops.start`. See docs/resume.md.

Attributes load on first use (PEP 562): every ``fp8ops`` command imports ``checkpoint.cli``.
"""

import importlib

_WHERE = {
    "CheckpointDir": "directory",
    "CheckpointError": "directory",
    "CheckpointMeta": "meta",
    "read_meta": "meta",
}
__all__ = ["CheckpointDir", "CheckpointError", "CheckpointMeta", "read_meta"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    # `from fp8ops.checkpoint import weights` and other submodules import as usual.
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
