"""Test oracle: a naive, scalar re-implementation of Transformer Engine's fused
delayed-scaling update (``fused_amax_and_scale_update_after_reduction``, i.e.
``common/recipe/delayed_scaling.cu::kernel_bulk``).

It is written only from the per-slot pseudocode below (TE's kernel, with its
handling of NaN, inf and zero amax and the inf-scale substitute), and on
purpose shares no code with ``fp8ops``: it loops over slots and history rows one
scalar at a time, using ``np.float32`` arithmetic only, so that it is easy to check
by eye against the pseudocode.  Tests compare ``fp8ops`` against it bit for bit.

Per slot k (``reduced`` is the all-reduced amax, ``history`` is ``[L, n]``):

    last = reduced[k] if reduced[k] != 0 else history[0, k]     # NaN != 0 -> reduced
    amax = 0
    if last != 0:                                              # no roll at all otherwise
        window = history[1:L, k] ++ [last]
        amax   = fmaxf-reduce(0.0, window)                     # NaN ignored, +inf kept
        history[:, k] = [0] ++ history[2:L, k] ++ [last]       # L == 1 -> [0]
    if algo == "most_recent": amax = last
    s = f32(scaled_max) / f32(amax) if isfinite(amax) and amax > 0 else scale[k]
    if isinf(s): s = FLT_MAX
    scale[k] = s

with ``scaled_max = f32(fp8_max * 2**-margin)`` (exact for the margins used here) and
the division done as an IEEE round-to-nearest float32 / float32 division (the
kernel's ``div.rn.f32``; not ``reciprocal * fp8_max``).
"""

from __future__ import annotations

import math

import numpy as np

FLT_MAX = np.float32(np.finfo(np.float32).max)  # 3.4028234663852886e38
_ZERO = np.float32(0.0)

__all__ = ["FLT_MAX", "fmaxf", "reference_update", "scaled_max_f32"]


def fmaxf(a: np.float32, b: np.float32) -> np.float32:
    """C99 ``fmaxf``: if exactly one argument is NaN, return the other one."""
    if math.isnan(b):
        return a
    if math.isnan(a):
        return b
    return a if a >= b else b


def scaled_max_f32(fp8_max: float, margin: int) -> np.float32:
    """``f32(fp8_max) * f32(2.0) ** (-margin)``; exact for integer margins that keep
    the product representable (448 / 57344 with margin <= 155)."""
    return np.float32(float(fp8_max) * 2.0 ** (-int(margin)))


def reference_update(
    amax_history: np.ndarray,
    scale: np.ndarray,
    amax: np.ndarray,
    fp8_max: float,
    margin: int,
    algo: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(new_history [L, n], new_scale [n])`` as new float32 arrays.

    ``amax_history`` is ``[L, n]``, ``scale`` and ``amax`` (the reduced amax) are
    ``[n]``; all float32.  The inputs are not modified.
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"Unsupported amax compute algorithm: {algo!r}")
    history_in = np.asarray(amax_history)
    scale_in = np.asarray(scale)
    reduced_in = np.asarray(amax)
    if (
        history_in.dtype != np.float32
        or scale_in.dtype != np.float32
        or reduced_in.dtype != np.float32
    ):
        raise TypeError("reference_update expects float32 arrays")
    if history_in.ndim != 2:
        raise ValueError("amax_history must be [L, n]")
    L, n = history_in.shape
    if L < 1 or scale_in.shape != (n,) or reduced_in.shape != (n,):
        raise ValueError("shape mismatch")

    new_history = history_in.copy()
    new_scale = scale_in.copy()
    scaled_max = scaled_max_f32(fp8_max, margin)

    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        for k in range(n):
            col = [np.float32(history_in[i, k]) for i in range(L)]  # old column, scalars
            r = np.float32(reduced_in[k])
            last = r if r != 0.0 else col[0]

            a = _ZERO
            if last != 0.0:
                # window = history[1:L] ++ [last]; fmaxf-reduce starting at 0.0
                window = col[1:L] + [last]
                acc = _ZERO
                for v in window:
                    acc = fmaxf(acc, v)
                a = acc
                # roll: [0.0] ++ history[2:L] ++ [last]; for L == 1 just [0.0]
                if L == 1:
                    rolled = [_ZERO]
                else:
                    rolled = [_ZERO] + col[2:L] + [last]
                assert len(rolled) == L
                for i in range(L):
                    new_history[i, k] = rolled[i]

            if algo == "most_recent":
                a = last

            if math.isfinite(a) and a > 0.0:
                s = np.float32(scaled_max) / np.float32(a)  # float32 / float32 in numpy
                assert isinstance(s, np.float32)
            else:
                s = np.float32(scale_in[k])
            if math.isinf(s):
                s = FLT_MAX
            new_scale[k] = s

    return new_history, new_scale


def _self_check() -> None:
    # IEEE float32 division, not reciprocal-then-multiply (spec 2.6).
    s = scaled_max_f32(448.0, 0) / np.float32(4.9626e-07)
    assert s.dtype == np.float32 and float(s) == 902752640.0, float(s)
    _, sc = reference_update(
        np.array([[4.9626e-07]], np.float32),
        np.ones(1, np.float32),
        np.array([4.9626e-07], np.float32),
        448.0,
        0,
        "max",
    )
    assert float(sc[0]) == 902752640.0, float(sc[0])


_self_check()
