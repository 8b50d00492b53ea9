"""The FP8 linear's cast as hand-written Triton kernels: FP8 data, its transposed copy and the
amax in one pass over the input, as Transformer Engine's fused cast-transpose does.

The compiled casts (``compiled.py``) leave this to Inductor, which on an H200 moved about 16
bytes per input element for the cast with its transposed copy (docs/gpu.md), where the pass
needs 4 (2 read, 1 + 1 written). Here each program casts one tile and writes it twice: row
major, and transposed through a layout change in shared memory, so both stores are coalesced.
Each tile's amax goes to its own slot of a partial buffer, and a second, one-program kernel
folds their max into history row 0: no atomics, and the same value in any order (a max). The
kernels are in ``cast_kernel_triton.py``.

On the steps telemetry measures, the same pass also counts what the cast did (saturated,
underflowed, NaN and Inf elements: ``quantize.CastStats``), each tile into its own slot of a
second partial buffer that the fold sums: no pass over the data beyond the ordinary cast's
(what that costs on a GPU is not measured yet: docs/gpu.md, "The next run").

:func:`cast_and_record` and :func:`cast_record_and_count` are fast versions of the FP8
linear's two eager casts (the ordinary step's, and the measuring step's, which also counts),
with their signature and outputs: ``linear.py`` runs each through
:class:`~fp8ops.precision.compiled.Compiled` with its eager cast as the reference, so each
specialisation is checked bit for bit against the eager code at its first call and runs
eager where it differs. The arithmetic is the eager code's: one float32 multiply, a clamp that
keeps NaN, a round-to-nearest-even conversion, NaN ignored and +inf kept in the amax.

Triton is imported only when the kernel is first used (it ships with torch's CUDA builds). With
``TRITON_INTERPRET=1`` set before that, the kernel runs on the CPU through Triton's interpreter,
which is how the tests run it where there is no GPU.
"""

from __future__ import annotations

import importlib

import torch

from fp8ops.precision.compiled import record_probes

KERNELS_MODULE = "fp8ops.precision.cast_kernel_triton"
BLOCK = (64, 64)  # rows x columns of the input per program
NUM_WARPS = 4
FOLD_BLOCK = 1024  # tiles per loop of the fold (4096 x 14336 is 14,336 tiles)
# Counting, a tile's four counts are packed into one int64, this many bits apiece: a tile has
# fewer than 2**16 elements, so no count can carry into the next.
COUNT_BITS = 16


def _kernels():
    """The two kernels, from the module that defines them (imported at first use)."""
    module = importlib.import_module(KERNELS_MODULE)
    return module.cast_transpose_amax, module.fold_amax


def key(x: torch.Tensor, *args) -> tuple[str, ...]:
    """What the kernel is specialised on beyond ``Compiled``'s key: which sizes divide by 16."""
    return ("div16:" + "".join("y" if size % 16 == 0 else "n" for size in x.shape),)


def probes(x, history, scales, slot, fp8_max, dtype, transposed):
    """:func:`~fp8ops.precision.compiled.record_probes`, each probe grown to rows and columns
    that divide by 16 where ``x``'s do and do not where they do not (size-1 dimensions stay 1),
    so the variant the probes verify is the one ``x`` runs. Grown by repeating its first rows or
    columns."""
    shaped = []
    for probe, *rest in record_probes(x, history, scales, slot, fp8_max, dtype, transposed):
        for dim in range(2):
            size = probe.shape[dim]
            if size == 1 or (size % 16 == 0) == (x.shape[dim] % 16 == 0):
                continue
            grown = -(-size // 16) * 16 if x.shape[dim] % 16 == 0 else size + 1
            probe = torch.cat([probe, probe.narrow(dim, 0, grown - size)], dim)
        shaped.append((probe.contiguous(), *rest))
    return shaped


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[dtype]


def cast_and_record(x, history, scales, slot: int, fp8_max: float, dtype, transposed: bool):
    """The ordinary step's cast through the kernels: ``x`` (2-D, contiguous) cast with
    ``scales[slot]``, its amax folded into ``history[0, slot]`` in place (NaN ignored, as
    ``torch.fmax``); returns ``(data,)`` or ``(data, data_t)``."""
    return _cast(x, history, scales, slot, fp8_max, dtype, transposed, count=False)


def cast_record_and_count(x, history, scales, slot: int, fp8_max: float, dtype, transposed):
    """The measuring step's cast through the kernels: :func:`cast_and_record`, also returning
    the cast's amax and counting what it did in the same pass; returns ``(data, amax, counts)`` or
    ``(data, amax, counts, data_t)``, ``counts`` as ``quantize.CastStats.counts``."""
    return _cast(x, history, scales, slot, fp8_max, dtype, transposed, count=True)


def _cast(x, history, scales, slot, fp8_max, dtype, transposed: bool, count: bool):
    rows, cols = x.shape
    # Triton specialises on 16-byte alignment too; the probes are aligned, so the kernels are
    # verified for aligned tensors only. A copy is cheap next to running an unchecked variant.
    if x.data_ptr() % 16:
        x = x.clone()
    if scales.data_ptr() % 16 or scales.stride(0) != 1:
        scales = scales.clone()  # read only: the kernel never writes the scales
    row0 = history[0]  # written in place, so it must be the history itself, not a copy
    data = torch.empty((rows, cols), dtype=dtype, device=x.device)
    data_t = torch.empty((cols, rows), dtype=dtype, device=x.device) if transposed else data
    tiles = -(-rows // BLOCK[0]) * -(-cols // BLOCK[1])
    tile_amax = torch.empty(tiles, dtype=torch.float32, device=x.device)
    # Counting: each tile's packed counts, and what the fold makes of them, the cast's amax and
    # the four totals. Not counting, the kernels never touch these (any tensor will do).
    tile_counts, cast_amax, totals = (
        (
            torch.empty(tiles, dtype=torch.int64, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device),
            torch.empty(4, dtype=torch.int64, device=x.device),
        )
        if count
        else (tile_amax, tile_amax, tile_amax)
    )
    cast_transpose_amax, fold_amax = _kernels()
    cast_transpose_amax[(tiles,)](
        x,
        scales,
        slot,
        data,
        data_t,
        tile_amax,
        tile_counts,
        rows,
        cols,
        fp8_max,
        FP8=_triton_dtype(dtype),
        TRANSPOSED=transposed,
        COUNT=count,
        COUNT_BITS=COUNT_BITS,
        BLOCK_R=BLOCK[0],
        BLOCK_C=BLOCK[1],
        num_warps=NUM_WARPS,
    )
    if row0.data_ptr() % 16 == 0 and row0.stride(0) == 1:
        fold_amax[(1,)](
            tile_amax,
            tiles,
            row0,
            slot,
            tile_counts,
            cast_amax,
            totals,
            BLOCK=FOLD_BLOCK,
            COUNT=count,
            COUNT_BITS=COUNT_BITS,
        )
    else:  # a history the kernel was not verified for (a view into a larger buffer, say)
        cast_amax = tile_amax.amax()
        history[0, slot] = torch.fmax(history[0, slot], cast_amax)  # as the eager cast folds it
        if count:
            totals = _unpacked(tile_counts).sum(dim=0)
    outputs = (data, cast_amax, totals) if count else (data,)
    return (*outputs, data_t) if transposed else outputs


def _unpacked(tile_counts: torch.Tensor) -> torch.Tensor:
    """``[tiles]`` packed counts (``COUNT_BITS`` apiece) as ``[tiles, 4]`` int64, as the fold
    kernel unpacks them."""
    shifts = COUNT_BITS * torch.arange(4, device=tile_counts.device)
    return (tile_counts[:, None] >> shifts) & ((1 << COUNT_BITS) - 1)
