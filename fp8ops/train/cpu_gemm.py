"""bf16 GEMMs on CPUs that have no bf16 GEMM instructions, computed on float32 copies.

torch multiplies bf16 matrices fast on a CPU only where oneDNN takes them (its test asks for
AVX512; AVX512-BF16 and AMX are faster still). Elsewhere (AVX2 only: AMD EPYC before Zen 4, many
laptops) it falls back to a scalar loop. Measured on a 2-core AVX2 machine: a [2048, 512] x
[512, 512] matmul took 857 ms in bf16 and 25 ms in float32, and the CPU default's bf16 base
trained at about 3.6 s a step, where an AVX512 machine had taken 0.13 s (``docs/training.md``,
"bf16 on CPUs without bf16 GEMMs").

On such a CPU the trainer of a bf16 model runs its forward and backward passes under
:class:`Fp32Gemm`: each ``mm``, ``bmm``, ``addmm`` and ``baddbmm`` whose operands are all bf16
is computed on float32 copies of them and rounded to bf16 once (mixed dtypes go to torch, which
refuses them as before). That is what a GPU's bf16 GEMM does (float32 accumulation, one rounding
of the output), so only the summation order differs from torch's own bf16 kernel. It is a
dispatch mode, below autograd, so it also sees the GEMMs of backward passes, Megatron's custom
autograd functions included; a function mode would miss those.

Where the CPU has bf16 GEMMs, or on a GPU, nothing changes. ``run.json`` records which
(``cpu_bf16_gemm``). ``FP8OPS_CPU_BF16_GEMM=native`` or ``=float32`` chooses on a CPU instead
(``ci/bench_train.py`` run under each times both; ``native`` is torch's own kernel, which runs
made before this existed used).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8ops.errors import Fp8opsError

_aten = torch.ops.aten
GEMMS = frozenset({_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default})


def cpu_has_bf16_gemm() -> bool:
    """Whether torch's CPU kernels multiply bf16 through oneDNN (its bf16 test: AVX512)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


CHOICE_VARIABLE = "FP8OPS_CPU_BF16_GEMM"
CHOICES = ("native", "float32")


def cpu_bf16_gemm(device: torch.device) -> str | None:
    """How bf16 GEMMs run on ``device``: "native", "float32" (under :class:`Fp32Gemm`), or None
    off the CPU. What ``run.json`` records."""
    if device.type != "cpu":
        return None
    chosen = os.environ.get(CHOICE_VARIABLE)
    if chosen:
        if chosen not in CHOICES:
            raise Fp8opsError(
                f"{CHOICE_VARIABLE}={chosen!r}: choose {' or '.join(CHOICES)}, "
                "or unset it to let the CPU decide"
            )
        return chosen
    return "native" if cpu_has_bf16_gemm() else "float32"


class Fp32Gemm(TorchDispatchMode):
    """bf16 GEMMs computed in float32 and rounded to bf16 once (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in GEMMS and tensors and all(t.dtype == torch.bfloat16 for t in tensors):
            upcast = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*upcast, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def check_compiled_casts(device: torch.device, choice: str | None) -> None:
    """torch.compile does not trace under a dispatch mode (Dynamo skips the frame), so compiled
    FP8 casts would run eager there while the run recorded them as compiled: refused."""
    from fp8ops.precision.linear import cast_path

    path = cast_path(device)
    if choice == "float32" and path != "eager":
        raise Fp8opsError(
            f"FP8OPS_COMPILED_CASTS asks for {path} casts on the CPU, but this CPU's bf16 GEMMs "
            "run in float32 under a dispatch mode, where torch.compile does not run (docs/"
            f"training.md). Unset FP8OPS_COMPILED_CASTS, or set {CHOICE_VARIABLE}=native"
        )
