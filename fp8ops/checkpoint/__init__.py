"""Training checkpoints with the exact FP8 state, and the manifest-locked resume.

``directory`` (where checkpoints live, atomic publish, integrity), ``meta`` (the JSON record),
``state`` (what is saved, as sharded tensors), ``training`` (save/load, collective),
``drift`` and ``resume`` (the decision before any model is built). See docs/resume.md.
"""

from fp8ops.checkpoint.directory import CheckpointDir, CheckpointError
from fp8ops.checkpoint.drift import DriftRefused
from fp8ops.checkpoint.meta import CheckpointMeta, read_meta
from fp8ops.checkpoint.resume import ResumePlan, plan_resume

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "CheckpointMeta",
    "DriftRefused",
    "ResumePlan",
    "plan_resume",
    "read_meta",
]
