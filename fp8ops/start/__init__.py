"""How a run starts: a command's request becomes a plan (:class:`New`, :class:`Resume`,
:class:`Finish` or :class:`Complete`), and every check it rests on refuses what it cannot verify.
See :mod:`fp8ops.start.plan` and :mod:`fp8ops.start.checks`; docs/resume.md for users.

No torch here: a resume refused for drift answers from the checkpoint's JSON alone.
"""

from fp8ops.start.checks import StopUnanswered
from fp8ops.start.drift import DriftRefused
from fp8ops.start.plan import (
    Complete,
    Finish,
    New,
    Resume,
    ResumeRequest,
    StartPlan,
    TrainRequest,
    plan_resume,
    plan_start,
)

__all__ = [
    "Complete",
    "DriftRefused",
    "Finish",
    "New",
    "Resume",
    "ResumeRequest",
    "StartPlan",
    "StopUnanswered",
    "TrainRequest",
    "plan_resume",
    "plan_start",
]
