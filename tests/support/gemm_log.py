"""Shared by the CPU GEMM tests: what reaches torch's GEMM kernels."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
GEMMS = frozenset({_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default})


class GemmLog(TorchDispatchMode):
    """Entered before ``Fp32Gemm`` (the trainer's, or a test's), so below it: records each GEMM
    that reaches torch's kernels, with its operands' dtypes. The values alone cannot show which
    path ran: at small sizes torch's own bf16 kernel gives the float32 path's bits."""

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            self.gemms.append((func.__name__, dtypes))
        return func(*args, **(kwargs or {}))
