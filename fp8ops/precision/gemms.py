"""The three GEMMs of a linear layer, which tensor each reads, and the high-precision GEMM each
runs when it is taken out of FP8.

A linear ``y = x W^T + b`` runs three GEMMs, named as Transformer Engine names them
(``DisableQuantizationGEMM``'s ``gemms``; TE's debug quantizer maps each tensor to the GEMMs
that read it the same way)::

    fprop   y  = x  W^T      reads the input and the weight
    dgrad   dx = dy W        reads the output's gradient and the weight
    wgrad   dW = dy^T x      reads the output's gradient and the input

Each runs in FP8 or in the layer's high-precision dtype, on its own. Both operands of a GEMM are
in the same precision, so a tensor is cast to FP8 (and, under delayed scaling, its amax
recorded) only when some FP8 GEMM reads it: :func:`cast_roles`. A GEMM in high precision
multiplies the high-precision tensors exactly as Megatron's local linear does with FP8 off
(``LinearWithGradAccumulationAndAsyncCommunication``: ``matmul`` of the input and the weight's
transpose, the bias added after; ``grad_output.matmul(weight)``; ``grad_output.t().matmul(x)``),
so a linear with all three in high precision computes what the base-dtype module computes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

GEMMS = ("fprop", "dgrad", "wgrad")
ALL_GEMMS: frozenset[str] = frozenset(GEMMS)

# Which GEMMs read each tensor role (the FP8 state's slots: input, weight, grad_output).
READERS = {
    "input": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "grad_output": ("dgrad", "wgrad"),
}


def check_gemms(gemms: Iterable[str], where: str = "gemms") -> frozenset[str]:
    """``gemms`` as a frozenset, refused (ValueError naming ``where``) when a name is not a GEMM
    of a linear, is given twice, or none is given."""
    listed = list(gemms)
    unknown = [g for g in listed if g not in ALL_GEMMS]
    if unknown:
        raise ValueError(
            f"{where}: {unknown[0]!r} is not a GEMM; a linear's are {', '.join(GEMMS)}"
        )
    if len(set(listed)) != len(listed):
        twice = next(g for g in listed if listed.count(g) > 1)
        raise ValueError(f"{where}: {twice!r} is listed twice")
    if not listed:
        raise ValueError(f"{where}: empty; name at least one of {', '.join(GEMMS)}")
    return frozenset(listed)


def in_order(gemms: Iterable[str]) -> tuple[str, ...]:
    """``gemms`` in the order fprop, dgrad, wgrad."""
    given = set(gemms)
    return tuple(g for g in GEMMS if g in given)


def cast_roles(fp8_gemms: Iterable[str]) -> tuple[str, ...]:
    """The tensor roles some GEMM of ``fp8_gemms`` reads: the ones cast to FP8."""
    fp8 = set(fp8_gemms)
    return tuple(role for role, readers in READERS.items() if fp8 & set(readers))


# -- the GEMMs in high precision (Megatron's local linear's, see the module docstring) ---------


def hp_fprop(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.matmul(x2d, weight.t())
    return out if bias is None else out + bias


def hp_dgrad(grad2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad2d.matmul(weight)


def hp_wgrad(grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    return grad2d.t().matmul(x2d)
