"""How a run starts: a command's request becomes a plan (:class:`New`, :class:`Resume`,
:class:`Finish` or :class:`Complete`), and every check it rests on refuses what it cannot verify.
See :mod:`fp8ops.start.plan` (the decision), :mod:`fp8ops.start.plans` (what it decides) and
:mod:`fp8ops.start.checks`; docs/resume.md for users.

No torch here: a resume refused for drift answers from the checkpoint's JSON alone.
"""

from fp8ops.start.checks import StopUnanswered
from fp8ops.start.drift import DriftRefused
from fp8ops.start.plan import ResumeRequest, TrainRequest, plan_resume, plan_start
from fp8ops.start.plans import Complete, Finish, New, Resume, StartPlan

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
