"""The ``review`` section: who may decide a per-layer override in the run's ledger."""

from __future__ import annotations

from pydantic import Field, model_validator

from fp8ops.manifest.base import NonEmptyStr, Section, Sha256, added_field, raise_problems


class Review(Section):
    """Who may decide a per-layer override in the run's ledger (``overrides.jsonl``)."""

    allow_self_approval: bool = Field(
        False,
        description=(
            "true lets the operator who staged an override approve it too (a one-person team); "
            "by default another operator must."
        ),
    )
    allowed_signers: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "An SSH allowed-signers file (ssh-keygen(1), ALLOWED SIGNERS; a line per operator: "
            'principal namespaces="fp8ops-ledger" ssh-ed25519 AAAA...): operators sign '
            "their ledger records with their SSH key, and the review rule compares the principals "
            "this file binds to the keys that signed (docs/overrides.md). A relative path is read "
            "from the current directory. null: records are not signed and names are typed."
        ),
    )
    allowed_signers_sha256: Sha256 | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "sha256 of the allowed_signers file, checked whenever it is read: a swapped or edited "
            "file is refused. Required with allowed_signers."
        ),
    )
    require_signatures: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "true: an operator's record (staged, approved, rejected, revoked) that is unsigned or "
            "does not verify is refused when written and an error on every read (verify, the "
            "console, a resume). false: it is written and flagged. Needs allowed_signers."
        ),
    )

    @model_validator(mode="after")
    def _signers_pinned(self) -> Review:
        problems = []
        if (self.allowed_signers is None) != (self.allowed_signers_sha256 is None):
            missing = (
                "allowed_signers" if self.allowed_signers is None else "allowed_signers_sha256"
            )
            problems.append(
                (
                    (missing,),
                    None,
                    "allowed_signers and allowed_signers_sha256 go together (sha256sum FILE)",
                )
            )
        if self.require_signatures and self.allowed_signers is None:
            problems.append((("require_signatures",), True, "needs allowed_signers (who may sign)"))
        raise_problems("Review", problems)
        return self
