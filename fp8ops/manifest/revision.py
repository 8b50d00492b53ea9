"""The ``revision`` section: where a manifest comes from (a root, or a derived revision)."""

from __future__ import annotations

from pydantic import Field, model_validator

from fp8ops.manifest.base import Section, Sha256, raise_problems


class Revision(Section):
    """Where this manifest comes from: a root (number 0) or a derived revision of a parent."""

    number: int = Field(
        0, ge=0, description="0 for a root manifest; parent's number + 1 for a derived one."
    )
    parent: Sha256 | None = Field(
        None, description="sha256 of the parent manifest's canonical form; null for a root."
    )
    reason: str | None = Field(
        None,
        description="Why this revision exists (required for a derived revision, null for a root).",
    )

    @model_validator(mode="after")
    def _root_or_derived(self) -> Revision:
        problems = []
        if self.number == 0:
            if self.parent is not None:
                problems.append(
                    (("parent",), self.parent, "must be null for revision 0 (a root has no parent)")
                )
            if self.reason is not None:
                problems.append(
                    (("reason",), self.reason, "must be null for revision 0 (a root has no reason)")
                )
        else:
            if self.parent is None:
                problems.append(
                    (("parent",), None, f"revision {self.number} needs its parent's sha256")
                )
            if self.reason is None or not self.reason.strip():
                problems.append(
                    (("reason",), self.reason, "a derived revision needs a non-empty reason")
                )
        raise_problems("Revision", problems)
        return self
