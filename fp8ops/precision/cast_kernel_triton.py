"""The Triton kernels of ``cast_kernel.py`` (which says what they compute and how they are
checked). A module of its own, imported at first use: Triton decides when a kernel is defined
whether it is compiled or interpreted (``TRITON_INTERPRET``), and the CPU tests set that first.

Only Triton's built-ins and this module's own jit functions are used, none of
``triton.language.standard``'s (``tl.cdiv``, ``tl.max``, ``tl.sum``, ``tl.zeros``): those were
defined when Triton was first imported, and in a process that imported Triton before asking for
the interpreter (Megatron imports it), the interpreter cannot run them.
"""

import triton
import triton.language as tl


@triton.jit
def larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def plus(a, b):
    return a + b


# The slot is not specialised on (Triton would compile slot 1 apart). Sizes are: Triton
# vectorises loads and stores only for sizes it knows divide by 16, so that is part of the
# verification key and the probes come in the same class (cast_kernel.probes).
@triton.jit(do_not_specialize=["slot"])
def cast_transpose_amax(
    x_ptr,
    scale_ptr,
    slot,
    data_ptr,
    data_t_ptr,
    partial_ptr,
    counts_ptr,
    rows,
    cols,
    fp8_max,
    FP8: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One flat grid (a second grid dimension is capped at 65535 programs).
    tiles_c = (cols + BLOCK_C - 1) // BLOCK_C
    pid_r = tl.program_id(0) // tiles_c
    pid_c = tl.program_id(0) % tiles_c
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    offsets = r[:, None].to(tl.int64) * cols + c[None, :]
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)

    scaled = x * tl.load(scale_ptr + slot)
    # torch.clamp keeps NaN; Triton's minimum and maximum would turn it into a bound.
    clamped = tl.minimum(tl.maximum(scaled, -fp8_max), fp8_max)
    clamped = tl.where(scaled != scaled, scaled, clamped)
    data = clamped.to(FP8, fp_downcast_rounding="rtne")
    tl.store(data_ptr + offsets, data, mask=inside)
    if TRANSPOSED:
        offsets_t = c[:, None].to(tl.int64) * rows + r[None, :]
        inside_t = (c[:, None] < cols) & (r[None, :] < rows)
        tl.store(data_t_ptr + offsets_t, tl.trans(data), mask=inside_t)

    # |x| with NaN as 0 (the casts' fmaxf reduction), +inf kept; masked lanes are 0.
    magnitude = tl.where(x != x, 0.0, tl.abs(x))
    tile_amax = tl.reduce(tl.reduce(magnitude, 1, larger), 0, larger)
    tl.store(partial_ptr + tl.program_id(0), tile_amax)

    if COUNT:
        # The tile's CastStats.counts (quantize.COUNTS), as quantize._cast_with_stats counts
        # them (masked lanes hold 0, which is none of the four). Each flag goes into its own
        # COUNT_BITS of an int64, wide enough for a tile's elements, so one sum counts all
        # four: one reduction instead of four, and one store. The fold takes them apart.
        tl.static_assert(BLOCK_R * BLOCK_C < (1 << COUNT_BITS))
        fp8_zero = (data.to(tl.uint8, bitcast=True) & 0x7F) == 0  # +0 or -0
        saturated = tl.abs(scaled) > fp8_max  # inf included
        underflow = (x != 0) & fp8_zero
        nan = x != x
        inf = tl.abs(x) == float("inf")
        flags = (
            saturated.to(tl.int64)
            | (underflow.to(tl.int64) << COUNT_BITS)
            | (nan.to(tl.int64) << (2 * COUNT_BITS))
            | (inf.to(tl.int64) << (3 * COUNT_BITS))
        )
        tl.store(counts_ptr + tl.program_id(0), tl.reduce(tl.reduce(flags, 1, plus), 0, plus))


@triton.jit(do_not_specialize=["tiles", "slot"])
def fold_amax(
    partial_ptr,
    tiles,
    history_ptr,
    slot,
    counts_ptr,
    amax_ptr,
    totals_ptr,
    BLOCK: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_BITS: tl.constexpr,
):
    # history[0, slot] = fmax(history[0, slot], max(partial)) in one program: one launch
    # where torch takes three (amax, fmax, the write back). With COUNT also the cast's own
    # amax and its four counts summed over the tiles (int64, as torch sums them).
    amax = tl.full((BLOCK,), 0.0, tl.float32)
    totals = tl.full((BLOCK, 4), 0, tl.int64)
    for start in range(0, tiles, BLOCK):
        index = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.load(partial_ptr + index, mask=index < tiles, other=0.0))
        if COUNT:
            packed = tl.load(counts_ptr + index, mask=index < tiles, other=0)
            fields = packed[:, None] >> (COUNT_BITS * tl.arange(0, 4)[None, :])
            totals += fields & ((1 << COUNT_BITS) - 1)
    amax = tl.reduce(amax, 0, larger)
    old = tl.load(history_ptr + slot)
    new = tl.where(old != old, amax, tl.maximum(old, amax))
    tl.store(history_ptr + slot, new)
    if COUNT:
        tl.store(amax_ptr, amax)
        tl.store(totals_ptr + tl.arange(0, 4), tl.reduce(totals, 0, plus))
