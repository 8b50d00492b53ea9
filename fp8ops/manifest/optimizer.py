"""The ``optimizer`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8ops.manifest.base import Section, added_field, raise_problems

# The optimizer steps float32 main weights, so its scalars must be float32 numbers.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a smaller eps is lost in
# sqrt(v) + eps, or flushed to zero


class OptimizerConfig(Section):
    """The optimizer. Defaults are Megatron/Llama fine-tuning values."""

    name: Literal["adamw", "sgd"] = Field(
        "adamw", description="'adamw', or 'sgd' (beta1 is its momentum; beta2, eps unused)."
    )
    lr: float = Field(
        1e-5, gt=0, le=FLOAT32_MAX, description="Peak learning rate (a fine-tuning default)."
    )
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the end of decay; at most lr.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Weight decay: decoupled for adamw, L2 in the gradient for sgd (torch's).",
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="First-moment decay (momentum for sgd).")
    beta2: float = Field(
        0.95, ge=0, lt=1, description="Second-moment decay; 0.95 is the usual LLM value."
    )
    eps: float = Field(
        1e-8, ge=FLOAT32_TINY, le=FLOAT32_MAX, description="Adam denominator epsilon."
    )
    clip_grad: float | None = Field(
        1.0, gt=0, le=FLOAT32_MAX, description="Global gradient-norm clip; null turns clipping off."
    )
    distributed: bool = added_field(
        False,
        added_in="0.1.0",
        description="Shard the float32 main weights and moments over data-parallel ranks "
        "(Megatron's distributed optimizer, use_distributed_optimizer): 12/DP bytes per "
        "parameter per rank instead of 12; the same results and checkpoints.",
    )

    @model_validator(mode="after")
    def _min_below_peak(self) -> OptimizerConfig:
        problems = []
        if self.min_lr > self.lr:
            problems.append((("min_lr",), self.min_lr, f"must be <= lr ({self.lr:g})"))
        # torch's AdamW multiplies by lr / (1 - beta1^t) and by 1 - lr * weight_decay in float32:
        # past FLOAT32_MAX it stops with an overflow inside the step.
        if self.name == "adamw" and self.lr / (1 - self.beta1) > FLOAT32_MAX:
            bound = FLOAT32_MAX * (1 - self.beta1)
            problems.append(
                (("lr",), self.lr, f"must be <= {bound:.3g}: AdamW's first step divides it by "
                 f"1 - beta1 ({1 - self.beta1:g}), past float32's largest number")
            )  # fmt: skip
        if self.lr * self.weight_decay > FLOAT32_MAX:
            problems.append(
                (("weight_decay",), self.weight_decay, f"lr x weight_decay must be <= "
                 f"{FLOAT32_MAX:.3g} (float32's largest number; lr is {self.lr:g})")
            )  # fmt: skip
        raise_problems("OptimizerConfig", problems)
        return self
