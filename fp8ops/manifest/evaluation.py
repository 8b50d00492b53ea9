"""How a run is judged: the dual-track ``gates``, the generation-based ``capability``
evaluation, and the modules the third track keeps in the base dtype (``dualtrack``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from fp8ops.manifest.base import Globs, Section


class Gates(Section):
    """Acceptance bar for the dual-track (FP8 vs base dtype) evaluation."""

    loss_gap: float = Field(
        0.01,
        ge=0,
        description=(
            "Largest allowed matched-step eval-loss gap, FP8 minus reference (the bar "
            "marin#7298 used)."
        ),
    )
    bucket_accuracy_gap: float = Field(
        0.02, ge=0, description="Largest allowed accuracy drop in any evaluation bucket."
    )
    allow_nonfinite: bool = Field(False, description="Pass a run that ever produced NaN/Inf.")
    allow_skipped_steps: bool = Field(False, description="Pass a run that skipped optimizer steps.")
    bucket_significance: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        0.05,
        description=(
            "A bucket's accuracy drop beyond bucket_accuracy_gap fails the gate only if it is "
            "also unlikely to be noise: the exact one-sided sign test (McNemar's) on the items "
            "the two runs answered differently is significant at this level, with Holm's "
            "correction over the gated buckets (all of them are tested at once). null: the drop "
            "alone decides."
        ),
    )
    min_bucket_items: int = Field(
        20,
        ge=1,
        description=(
            "Buckets with fewer held-out items than this are reported but not gated: one item "
            "more or less right would swing their accuracy by more than the gap allows."
        ),
    )
    require_resume_continuity: bool = Field(
        True,
        description=(
            "Require a resumed run to continue its trajectory: the FP8 state and weights were "
            "verified at load, the steps are contiguous, and the loss does not jump."
        ),
    )
    resume_loss_jump: float = Field(
        0.1,
        ge=0,
        description=(
            "Largest allowed rise of the mean training loss over the 10 steps after a resume "
            "against the 10 steps before it."
        ),
    )


class Capability(Section):
    """Generation-based evaluation: greedy answers to held-out task items, exact match per bucket.

    Only for SFT data (examples with answers); text data has nothing to check and skips it.
    """

    enabled: bool = Field(True, description="Evaluate generation on held-out items.")
    items: int | None = Field(
        240,
        ge=1,
        description=(
            "Held-out items generated each time: the first N of the evaluation split, always "
            "the same ones; null takes all of them."
        ),
    )
    interval: int | None = Field(
        None,
        ge=1,
        description="Steps between capability evaluations; null: once, after the last step.",
    )
    max_new_tokens: int = Field(
        16, ge=1, description="Generation stops at an end-of-document token or after this many."
    )


class DualTrack(Section):
    """Which modules the third track (FP8 with fallbacks) keeps in the base dtype."""

    fallback_first_last: bool = Field(
        True,
        description=(
            "The FP8 modules of the first and last transformer layers, the ones published FP8 "
            "recipes most often keep in BF16."
        ),
    )
    fallback_alerted: bool = Field(
        True,
        description="Modules the FP8 candidate track raised Degrade or Stop alerts for.",
    )
    fallback_modules: Globs = Field((), description="More modules, as globs on module names.")
