"""The ``alerts`` section: per-layer alert thresholds, and the policy under which a Degrade
alert acts alone (``auto_degrade``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from fp8ops.manifest.base import Fraction, Section, added_field, list_to_tuple, raise_problems
from fp8ops.manifest.levels import (
    BlocksAtFloorLevels,
    Fp8ErrorLevels,
    SaturationLevels,
    ScaleChangeLevels,
    UnderflowLevels,
)

# The Degrade rules an auto-degrade policy may let act alone (fp8ops.alerts: the module-level
# rules that propose a BF16 override).
DegradeRule = Literal[
    "saturation",
    "underflow",
    "scale_jitter",
    "fp8_error",
    "fp8_error_growing",
    "grad_spike",
    "blocks_at_floor",
]


class AutoDegrade(Section):
    """A reviewed policy under which the run takes a module out of FP8 itself: a Degrade alert
    of one of ``rules`` switches that module to BF16 at the next step boundary, without a
    restart and without a person, recorded in the ledger as approved by this manifest revision.
    A person can revoke it; the module returns to FP8 at the next resume."""

    rules: Annotated[tuple[DegradeRule, ...], BeforeValidator(list_to_tuple)] = Field(
        description="The Degrade rules that may act alone, e.g. [saturation, underflow]."
    )
    max_modules: int = Field(
        ge=1,
        description=(
            "At most this many modules switched by the policy in the run (counted over every "
            "revision's policy); later alerts only propose, as without a policy."
        ),
    )
    until_step: int | None = Field(
        None,
        ge=1,
        description=(
            "The policy acts on alerts up to this training step; after it (overnight is "
            "over) they only propose. null: for the whole run."
        ),
    )
    granularity: Literal["module", "gemm"] = added_field(
        "module",
        added_in="0.1.0",
        description=(
            "What a switch takes to BF16: 'module', all three of the module's GEMMs; 'gemm', "
            "only the GEMMs that read the tensor whose metric alerted (input: fprop and wgrad; "
            "weight: fprop and dgrad; grad_output: dgrad and wgrad; the forward output's "
            "fp8_error: fprop), the whole module for an alert that names no tensor "
            "(grad_spike). Its proposals carry those GEMMs."
        ),
    )

    def acts_on(self, rule: str, step: int) -> bool:
        """Whether an alert of ``rule`` at ``step`` is one this policy may act on alone (its
        ``max_modules`` is counted in the run's ledger)."""
        return rule in self.rules and (self.until_step is None or step <= self.until_step)

    @field_validator("rules")
    @classmethod
    def _some_rule(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one Degrade rule, e.g. [saturation]")
        if len(set(value)) != len(value):
            raise ValueError("names a rule twice")
        return value


class Alerts(Section):
    """Per-layer alert thresholds, evaluated on every telemetry step (rules: ``fp8ops.alerts``).

    Steps count the steps a metric was measured on (``telemetry.every_steps``); the sampled
    FP8-vs-reference error counts in samples (``telemetry.error_sample_every``).
    """

    saturation: SaturationLevels = Field(
        default_factory=SaturationLevels,
        description="Clipping at the FP8 max (fraction of elements).",
    )
    underflow: UnderflowLevels = Field(
        default_factory=UnderflowLevels,
        description="Flush to zero (fraction of non-zero elements).",
    )
    scale_change: ScaleChangeLevels = Field(
        default_factory=ScaleChangeLevels, description="Step-to-step scale change (ratio > 1)."
    )
    fp8_rel_error: Fp8ErrorLevels = Field(
        default_factory=Fp8ErrorLevels,
        description="Sampled FP8-vs-reference GEMM error (relative).",
    )
    blocks_at_floor: BlocksAtFloorLevels = added_field(
        default_factory=BlocksAtFloorLevels,
        added_in="0.1.0",
        description=(
            "Blocks whose scale sat at its floor (block scaling, MXFP8; fraction of the non-zero "
            "blocks). Not measured under delayed or current scaling. Off unless levels are set "
            "(suggested: observe 1e-3, degrade 1e-2)."
        ),
    )
    nonfinite_stop: bool = Field(
        True,
        description=(
            "Stop at the first NaN/Inf in loss, gradients or scales; never waits for patience. "
            "false reports them as observe alerts (the optimizer still skips such steps)."
        ),
    )
    patience_steps: int = Field(
        3,
        ge=1,
        description=(
            "Consecutive steps over a threshold before the alert fires: one-step spikes (first "
            "step after resume, a big value leaving the history window) are common and harmless."
        ),
    )
    window_steps: int = Field(
        20,
        ge=4,
        description=(
            "Measured steps in the trend windows: rising underflow compares the newer half of "
            "the window with the older half, and a gradient spike is measured against the "
            "module's median over the window. Long enough that a median ignores a few spikes, "
            "short enough to follow a fine-tuning run's moving statistics."
        ),
    )
    underflow_rise_factor: float = Field(
        2.0,
        gt=1,
        description=(
            "Rising zero-value ratio (observe): the newer half of the window flushes at least "
            "this many times more values to zero than the older half. Doubling means the "
            "tensor's range is drifting below what its scale can represent."
        ),
    )
    underflow_rise_floor: Fraction = Field(
        1e-3,
        description=(
            "Rising underflow is reported only once the newer half's mean reaches this "
            "fraction (a tenth of the default observe level): doubling a negligible loss is "
            "noise, not a trend."
        ),
    )
    error_growth_samples: int = Field(
        4,
        ge=3,
        description=(
            "Growing FP8-vs-reference error (degrade): this many consecutive error samples, "
            "each larger than the one before. Counted in samples (telemetry.error_sample_every "
            "steps apart); three rises in a row are unlikely from sampling noise alone."
        ),
    )
    error_growth_floor: Annotated[float, Field(ge=0)] = Field(
        0.04,
        description=(
            "Growth is reported only once the latest sample reaches this relative error: "
            "rounding both operands to E4M3 alone gives ~0.037 on well-scaled data, so growth "
            "below that floor is rounding noise."
        ),
    )
    grad_spike_factor: float = Field(
        5.0,
        gt=1,
        description=(
            "Gradient anomaly (degrade): a module's gradient norm above this many times its "
            "median over the window, for patience_steps steps. In torchtitan#3109 the grad "
            "norm went 105 -> 572 (5.4x) the step before the loss turned NaN."
        ),
    )
    amax_jump_factor: float = Field(
        4.0,
        gt=1,
        description=(
            "Early warning (observe, no patience): a tensor's amax this many times above the "
            "previous step's window max. The scale in use was computed from that history (under "
            "most_recent, from its last amax alone), so the cast clipped unless the margin leaves "
            "that much headroom; a per-layer amax spike is what precedes FP8 NaNs "
            "(torchtitan#3109). Delayed scaling only: a stateless recipe scales each cast by its "
            "own amax."
        ),
    )
    update_blowup_factor: float | None = added_field(
        100.0,
        added_in="0.1.0",
        gt=1,
        description=(
            "Optimizer blow-up (stop, at once): a step whose update's norm is above this many "
            "times the norm of the weights it changed. AdamW moves each weight by about lr a "
            "step, so a healthy update is a small fraction of the weights (at most 0.014 in the "
            "CPU default's first 30 steps at lr 2e-3); one 100 times the weights has replaced "
            "them, and the next step trains on garbage (lr 1e30 there: an update of 9.1e32 on "
            "weights of norm 37, then a NaN loss). "
            "Runs before this rule existed never reached it without going non-finite next, so "
            "it is on for them too. null: off."
        ),
    )
    divergence_factor: float = Field(
        2.0,
        gt=1,
        description=(
            "Divergence (stop): the training loss above this many times the lowest loss seen "
            "so far, for patience_steps steps. A run at twice its best loss is not recovering "
            "by itself; a checkpoint taken now is still worth resuming from."
        ),
    )
    divergence_warmup_steps: int = Field(
        10,
        ge=0,
        description=(
            "Observed steps before the lowest loss starts to count: the first steps of a run "
            "swing widely. A resume continues the count (its FP8 scales are restored exactly); "
            "one at another world size or alert configuration starts it again."
        ),
    )

    auto_degrade: AutoDegrade | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "A policy under which a Degrade alert switches its module to BF16 during training, "
            "approved by this revision (docs/overrides.md). null: Degrade only proposes."
        ),
    )

    @model_validator(mode="after")
    def _window_holds_patience(self) -> Alerts:
        # A spike that lasts patience_steps enters the window it is compared with; once it
        # fills half the window it is its own median and never fires.
        problems = []
        if self.window_steps < 2 * self.patience_steps:
            if "window_steps" in self.model_fields_set:
                problems.append(
                    (
                        ("window_steps",),
                        self.window_steps,
                        f"must be >= 2 * patience_steps ({2 * self.patience_steps})",
                    )
                )
            else:
                problems.append(
                    (
                        ("patience_steps",),
                        self.patience_steps,
                        f"must be <= window_steps / 2 ({self.window_steps // 2}, from "
                        "window_steps' default)",
                    )
                )
        raise_problems("Alerts", problems)
        return self
