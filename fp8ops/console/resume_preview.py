"""What the next ``fp8ops resume RUN_DIR`` would apply, worked out without building anything.

``fp8ops.start.plan_resume`` makes the real decision from JSON and YAML alone: the
manifest the resumed run is locked to and the revisions it adds (approved overrides on, revoked
applied ones off). The preview runs it against the checkpoint's own environment fingerprint:
the console may run on another machine than the training, and the environment is checked
again by the resume itself where it runs. A refusal (no checkpoint, a damaged one, drift) is
shown as its message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import FieldChange, Manifest, diff_manifests, manifest_hash
from fp8ops.overrides import Override


@dataclass(frozen=True)
class Revision:
    """One manifest revision the resume would add, and how it differs from its parent."""

    number: int
    sha256: str
    reason: str
    changes: tuple[FieldChange, ...]


@dataclass
class ResumePreview:
    checkpoint: str | None = None  # the checkpoint directory's name
    step: int | None = None
    locked_to: str | None = None  # sha256 of the manifest the resumed run would run under
    revisions: list[Revision] = field(default_factory=list)
    applied: list[Override] = field(default_factory=list)
    lifted: list[Override] = field(default_factory=list)
    refusal: str | None = None

    def lines(self) -> list[str]:
        """The preview as plain text lines (the console renders them; tests read them)."""
        if self.refusal is not None:
            return [f"no resume possible now: {self.refusal}"]
        out = [f"resume from {self.checkpoint} (step {self.step})"]
        if not self.revisions:
            out.append(f"no new revision: continues under manifest {self.locked_to[:12]}")
        for r in self.revisions:
            out.append(f"new revision {r.number} ({r.sha256[:12]}): {r.reason}")
            out += [f"  {_change(c)}" for c in r.changes]
        out += [f"  applies {o.id[:12]}: {o.module} -> {o.target}" for o in self.applied]
        out += [f"  lifts {o.id[:12]}: {o.module} -> fp8 (revoked)" for o in self.lifted]
        return out


def _change(c: FieldChange) -> str:
    return f"{c.path}: {c.old!r} -> {c.new!r}"


def preview_resume(run_dir: Path) -> ResumePreview:
    """What resuming ``run_dir`` from its latest checkpoint would apply."""
    from fp8ops.checkpoint import CheckpointDir
    from fp8ops.checkpoint.consistency import read_consistent
    from fp8ops.start import plan_resume

    try:
        directory = CheckpointDir(run_dir).find(None)
        meta = read_consistent(directory)
        plan = plan_resume(run_dir, environment=meta.environment)
    except Fp8opsError as exc:  # CheckpointError, DriftRefused, ManifestError, LedgerError
        return ResumePreview(refusal=str(exc))
    parent: Manifest = plan.saved_manifest
    revisions = []
    for child in plan.new_revisions:
        revisions.append(
            Revision(
                child.revision.number,
                manifest_hash(child),
                child.revision.reason or "",
                tuple(
                    c for c in diff_manifests(parent, child) if not c.path.startswith("revision.")
                ),
            )
        )
        parent = child
    return ResumePreview(
        checkpoint=plan.checkpoint.name,
        step=plan.step,
        locked_to=manifest_hash(plan.manifest),
        revisions=revisions,
        applied=list(plan.applied_overrides),
        lifted=list(plan.lifted_overrides),
    )
