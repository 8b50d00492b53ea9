"""The ``optimizer`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8ops.manifest.base import Section, added_field, raise_problems


class OptimizerConfig(Section):
    """The optimizer. Defaults are Megatron/Llama fine-tuning values."""

    name: Literal["adamw", "sgd"] = Field(
        "adamw", description="'adamw', or 'sgd' (beta1 is its momentum; beta2, eps unused)."
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (a fine-tuning default).")
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
    eps: float = Field(1e-8, gt=0, description="Adam denominator epsilon.")
    clip_grad: float | None = Field(
        1.0, gt=0, description="Global gradient-norm clip; null turns clipping off."
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
        raise_problems("OptimizerConfig", problems)
        return self
