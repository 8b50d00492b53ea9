"""Training checkpoints with the exact FP8 state, and the weights checkpoints runs start from
and end with.

``directory`` (where checkpoints live, atomic publish, integrity), ``meta`` (the JSON record),
``state`` (what is saved, as sharded tensors), ``training`` (save/load, collective), ``weights``
(a base in, ``final/`` out, with fingerprints). Whether and how a run resumes from one is
decided in :mod:`fp8ops.start`. See docs/resume.md.
"""

from fp8ops.checkpoint.directory import CheckpointDir, CheckpointError
from fp8ops.checkpoint.meta import CheckpointMeta, read_meta

__all__ = ["CheckpointDir", "CheckpointError", "CheckpointMeta", "read_meta"]
