"""The GEMMs of a linear layer in high precision: what each of fprop, dgrad and wgrad runs when
it is taken out of FP8 (the names and which tensor each reads: ``fp8ops.gemm_roles``).

A GEMM in high precision multiplies the high-precision tensors exactly as Megatron's local
linear does with FP8 off (``LinearWithGradAccumulationAndAsyncCommunication``: ``matmul`` of the
input and the weight's transpose, the bias added after; ``grad_output.matmul(weight)``;
``grad_output.t().matmul(x)``), so a linear with all three in high precision computes what the
base-dtype module computes.
"""

from __future__ import annotations

import torch

from fp8ops.gemm_roles import ALL_GEMMS, GEMMS, READERS, cast_roles, check_gemms, in_order

__all__ = [
    "ALL_GEMMS",
    "GEMMS",
    "READERS",
    "cast_roles",
    "check_gemms",
    "hp_dgrad",
    "hp_fprop",
    "hp_wgrad",
    "in_order",
]


# -- the GEMMs in high precision (Megatron's local linear's, see the module docstring) ---------


def hp_fprop(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.matmul(x2d, weight.t())
    return out if bias is None else out + bias


def hp_dgrad(grad2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad2d.matmul(weight)


def hp_wgrad(grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    return grad2d.t().matmul(x2d)
