"""Drift: how what a resume would run differs from what the checkpoint was made under.

Compared before any model is built: the manifest (field by field, its revision bookkeeping
aside; the topology is part of it) and the environment fingerprint (Python, torch,
megatron-core, TE, CUDA, GPU). After the model is built the start-up adds one more: the
admission table, should the rules have changed under an unchanged manifest. Any difference
refuses the resume (exit code 4) unless the operator accepts it with a reason; a manifest change
is then recorded as a new revision, and the whole drift in the ``resumed`` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import diff_manifests
from fp8ops.manifest.schema import Manifest


class DriftRefused(Fp8opsError):
    """A resume whose manifest, environment or topology differs from its checkpoint's."""

    exit_code = 4
    collective = True  # every rank raises it; rank 0 says so


@dataclass(frozen=True)
class Change:
    what: str  # "manifest" | "environment" | "admission"
    path: str
    old: object
    new: object

    def line(self) -> str:
        return f"  {self.what:<11} {self.path}: {_show(self.old)} -> {_show(self.new)}"


@dataclass
class Drift:
    changes: list[Change] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def report(self) -> str:
        return "\n".join(change.line() for change in self.changes)

    def summary(self) -> str:
        """One line for a revision's reason: the changed paths."""
        return ", ".join(f"{c.what} {c.path}" for c in self.changes)

    def to_json(self) -> list[dict]:
        return [{"what": c.what, "path": c.path, "old": c.old, "new": c.new} for c in self.changes]


def manifest_drift(saved: Manifest, requested: Manifest) -> list[Change]:
    """Field changes, leaving out ``revision.*``: the same content under another revision
    number is the same run."""
    return [
        Change("manifest", c.path, c.old, c.new)
        for c in diff_manifests(saved, requested)
        if not c.path.startswith("revision.")
    ]


def environment_drift(saved: dict, current: dict) -> list[Change]:
    return [
        Change("environment", key, saved.get(key), current.get(key))
        for key in sorted(saved.keys() | current.keys())
        if saved.get(key) != current.get(key)
    ]


def refuse(drift: Drift, checkpoint: str, hint: str) -> DriftRefused:
    return DriftRefused(
        f"refusing to resume from {checkpoint}: what would run differs from what the checkpoint "
        f"was made under:\n{drift.report()}\n{hint}"
    )


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
