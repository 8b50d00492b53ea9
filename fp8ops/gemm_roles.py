"""The three GEMMs of a linear layer, and which tensors each reads.

A linear ``y = x W^T + b`` runs three GEMMs, named as Transformer Engine names them
(``DisableQuantizationGEMM``'s ``gemms``; TE's debug quantizer maps each tensor to the GEMMs
that read it the same way)::

    fprop   y  = x  W^T      reads the input and the weight
    dgrad   dx = dy W        reads the output's gradient and the weight
    wgrad   dW = dy^T x      reads the output's gradient and the input

Each may run in FP8 or in high precision on its own. Both operands of a GEMM are in the same
precision, so a tensor is cast to FP8 (and, under delayed scaling, its amax recorded) only when
some FP8 GEMM reads it (:func:`cast_roles`).

Outside ``fp8ops.precision`` on purpose, as ``amax_algo`` is: the manifest, the run records and
the ledger check these names, and loading them must not import torch. The GEMMs themselves run
in ``fp8ops.precision``.
"""

from __future__ import annotations

from collections.abc import Iterable

GEMMS = ("fprop", "dgrad", "wgrad")
ALL_GEMMS: frozenset[str] = frozenset(GEMMS)

# Which GEMMs read each tensor role (the FP8 state's slots: input, weight, grad_output).
READERS = {
    "input": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "grad_output": ("dgrad", "wgrad"),
}


def gemms_problem(gemms: Iterable[str]) -> str | None:
    """Why ``gemms`` is not a list of a linear's GEMMs (a name that is not one, a name given
    twice, none given), in words; None when it is."""
    listed = list(gemms)
    unknown = [g for g in listed if g not in ALL_GEMMS]
    if unknown:
        return f"{unknown[0]!r} is not a GEMM; a linear's are {', '.join(GEMMS)}"
    twice = [g for g in listed if listed.count(g) > 1]
    if twice:
        return f"{twice[0]!r} is listed twice"
    if not listed:
        return f"empty; name at least one of {', '.join(GEMMS)} (or leave it out: all three)"
    return None


def check_gemms(gemms: Iterable[str], where: str = "gemms") -> frozenset[str]:
    """``gemms`` as a frozenset; ValueError naming ``where`` when :func:`gemms_problem` finds
    one."""
    listed = list(gemms)
    problem = gemms_problem(listed)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return frozenset(listed)


def in_order(gemms: Iterable[str]) -> tuple[str, ...]:
    """``gemms`` in the order fprop, dgrad, wgrad."""
    given = set(gemms)
    return tuple(g for g in GEMMS if g in given)


def cast_roles(fp8_gemms: Iterable[str]) -> tuple[str, ...]:
    """The tensor roles some GEMM of ``fp8_gemms`` reads: the ones cast to FP8."""
    fp8 = set(fp8_gemms)
    return tuple(role for role, readers in READERS.items() if fp8 & set(readers))


def describe(gemms: Iterable[str]) -> str:
    """``gemms`` for a sentence: "fprop, dgrad and wgrad", "wgrad"."""
    names = in_order(gemms)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
