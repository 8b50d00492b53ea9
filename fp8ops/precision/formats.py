"""FP8 formats, which tensor role gets which, and the saturating cast.

Transformer Engine (TE) gives every *forward* tensor (input, weight, output) E4M3 and, under
HYBRID, every *backward* tensor (grad output, grad input) E5M2, which trades precision for
the wider range gradients need. Pure E5M2 training is rejected, as TE's recipe does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Dtype:
    """One FP8 encoding: its name, largest finite value and torch storage dtype."""

    name: str
    max: float
    torch_dtype: torch.dtype


E4M3 = Fp8Dtype("e4m3", 448.0, torch.float8_e4m3fn)
E5M2 = Fp8Dtype("e5m2", 57344.0, torch.float8_e5m2)


class Fp8Format(enum.Enum):
    """The recipe-level choice: which encoding forward and backward tensors use."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"
    E5M2 = "e5m2"  # exists only to be refused with a clear message

    @classmethod
    def parse(cls, name: str) -> Fp8Format:
        fmt = cls(name.lower())
        if fmt is cls.E5M2:
            raise ValueError(
                "pure E5M2 training is not supported (Transformer Engine refuses it too); "
                "use 'hybrid', which gives E5M2 to gradients and E4M3 to forward tensors"
            )
        return fmt

    @property
    def forward(self) -> Fp8Dtype:
        """Encoding of input, weight and output casts."""
        return E4M3

    @property
    def backward(self) -> Fp8Dtype:
        """Encoding of grad-output and grad-input casts."""
        return E5M2 if self is Fp8Format.HYBRID else E4M3


def saturating_cast(x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype) -> torch.Tensor:
    """Cast ``x * scale`` to FP8 like TE's cast kernels (``__NV_SATFINITE``).

    The product is taken in float32; rounding is to nearest even; anything beyond the largest
    finite value, infinities included, becomes +-max; NaN stays NaN. torch's own
    ``.to(float8_e5m2)`` sends overflow to inf (and its E4M3 overflow behaviour has varied
    across releases), hence the explicit clamp, which keeps NaN because ``clamp`` propagates it.
    """
    scaled = x.float() * scale.float()
    return scaled.clamp(-fp8.max, fp8.max).to(fp8.torch_dtype)
