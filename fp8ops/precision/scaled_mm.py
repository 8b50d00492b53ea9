"""The native FP8 GEMM: ``torch._scaled_mm`` behind the :class:`~fp8ops.precision.linear.Fp8Gemm`
protocol.

On GPUs of compute capability 8.9 and up (Ada, Hopper: H100/H200, Blackwell), ``torch._scaled_mm``
is cuBLASLt's FP8 tensor-core GEMM; torch's CPU build runs the same operator through oneDNN, so
this backend is built and tested on a CPU as well. It receives the FP8 operands and ``scale_inv``s
that :class:`~fp8ops.precision.linear.EmulatedGemm` receives: the casts, the amax bookkeeping and
the delayed-scaling updates are the shared core (``linear.py``, ``scope.py``), and switching
backends changes only the multiply.

``_scaled_mm``'s rules (CUDA's, the strictest), and how :class:`ScaledMmGemm` meets them:

* **Layout.** The first operand row-major, the second column-major. The protocol's ``b`` is
  ``[N, K]`` row-major (a weight, or the transposed copy the casts make, as TE keeps
  a transposed FP8 copy), so ``b.t()`` is column-major as it is: no copy.
* **Formats.** E4M3 x E4M3, E5M2 x E4M3 and E4M3 x E5M2; cuBLASLt has no E5M2 x E5M2 kernel.
  Under HYBRID the E5M2 tensor is the gradient, which is the first operand of dgrad
  (``g @ W``) and of wgrad (``g^T @ x``), so fp8ops' linears never ask for the refused pair; a
  caller that does gets a ValueError.
* **Shapes.** K and N multiples of 16 (M is free). An unaligned K or N is zero-padded, which is
  exact: padded products are 0, and the padded output columns are cut off. The padding is
  there for the token dimension, which is the K of wgrad and depends on the batch, not on the
  model; a *module* whose own dimensions are unaligned is refused when its admission is decided
  (``fp8ops.admission``, reason ``unaligned``), since padding its weight on every GEMM would
  cost more than a GEMM that small saves in FP8. The rule is applied on every device, so a CPU run makes the
  calls a GPU run makes.
* **Scales.** Tensor-wise: float32 scalars on the operands' device, which the ``scale_inv``s are.
* **Block scales** (block scaling's 1x128 and 128x128 blocks, MXFP8's 1x32): a block's scale
  varies along K, which no single tensor-wise or row-wise GEMM can apply. The GEMM runs one
  row-wise-scaled ``_scaled_mm`` per K block (a ``[M, 1]`` scale for ``a``'s rows, ``[1, N]``
  for ``b``'s, each the scale of that row's block) with float32 output, and sums the K blocks'
  partial products in float32: TE's block GEMM computes the same sum of scaled block products,
  in one kernel. Row-wise GEMMs with float32 output run where torch has them: oneDNN on a CPU
  and, in torch's CUDA builds, cuBLAS on Hopper (compute capability 9.0) from CUDA 12.9;
  :func:`block_scaled_mm_unsupported` tries one and says where not.
* **One call per block-scaled GEMM, where the device has it.** torch's
  ``torch.nn.functional.scaled_mm`` takes 1x128 and 128x128 block scales in one GEMM
  (``ScalingType.BlockWise1x128`` / ``BlockWise128x128``: cuBLAS 12.9+ on Hopper; not on a
  CPU). Its scale layouts are its own: 1x128 scales outer-dim-major (``[rows, K / 128]`` with
  stride ``(1, rows)``), 128x128 grids with their K blocks padded to a multiple of 4 and
  stored K-block-major; K is padded to whole blocks, and the rows of a 128x128 operand too.
  It is used for a combination of formats, blocks and output dtype only after
  :func:`one_call_block_gemm_unsupported` has run that combination once on the device and
  found every element exact (small integers and block scales of 1 to 1.75 times a power of
  two, so that any summation order gives the same float32 sum): a layout misread, or a kernel the device lacks, leaves the GEMM
  on the per-K-block path above. cuBLAS takes no fast accumulation with these scales, so the
  one-call GEMM accumulates exactly as the per-K-block one does.
  MXFP8 is refused on this backend by the manifest: its GPU GEMM is Blackwell's
  ``BlockWise1x32``, not called yet.
* **Bias and output dtype.** CUDA fuses a bias into the epilogue only for bf16 or fp16 output,
  with a bias of that dtype; the epilogue adds it to the float32 accumulator before the one
  rounding. In every other case (float32 output, a bias of another dtype) the GEMM writes
  float32 and the bias is added there before rounding to the output dtype, as
  :class:`~fp8ops.precision.linear.EmulatedGemm` does: the same arithmetic either way.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8ops.precision.blocks import BLOCK, BlockQuantized
from fp8ops.precision.formats import E4M3, E5M2
from fp8ops.precision.quantize import QuantizedTensor

# cuBLASLt's FP8 GEMMs need K and N (and the leading dimensions) to be multiples of 16 elements.
ALIGNMENT = 16
_FUSED_BIAS_DTYPES = (torch.bfloat16, torch.float16)


class ScaledMmGemm:
    """``a @ b.T (+ bias)`` of two FP8 tensors with ``torch._scaled_mm`` (module docstring).

    ``use_fast_accum`` is cuBLASLt's fast FP8 accumulation on Hopper (TE uses it for the forward
    GEMM): faster, with partial sums kept in fewer bits. Off by default, so the result is what
    the emulation computes up to accumulation order; backends ignore it where it does not apply.
    """

    def __init__(self, *, use_fast_accum: bool = False, one_call_blocks: bool = True):
        self.use_fast_accum = use_fast_accum
        # False keeps block-scaled GEMMs on the per-K-block path (to compare the two)
        self.one_call_blocks = one_call_blocks

    def __call__(
        self,
        a: QuantizedTensor | BlockQuantized,
        b: QuantizedTensor | BlockQuantized,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_operands(a, b)
        if isinstance(a, BlockQuantized) or isinstance(b, BlockQuantized):
            return self._block_scaled(a, b, out_dtype, bias)
        n = b.data.shape[0]
        k_padded, n_padded = _aligned(a.data.shape[1]), _aligned(n)
        a_data = _pad(a.data, a.data.shape[0], k_padded)  # [M, K']
        b_data = _pad(b.data, n_padded, k_padded)  # [N', K']
        device = a_data.device

        fused = bias is not None and out_dtype in _FUSED_BIAS_DTYPES and bias.dtype == out_dtype
        epilogue_bias = None
        if fused:
            epilogue_bias = bias if n_padded == n else F.pad(bias, (0, n_padded - n))
        out = torch._scaled_mm(
            a_data,
            b_data.t(),  # [K', N'] column-major: a view, no copy
            scale_a=_on(a.scale_inv, device),
            scale_b=_on(b.scale_inv, device),
            bias=epilogue_bias,
            out_dtype=out_dtype if bias is None or fused else torch.float32,
            use_fast_accum=self.use_fast_accum,
        )
        out = out[:, :n]  # [M, N]
        if bias is not None and not fused:
            out = (out + bias.float()).to(out_dtype)
        return out

    def _block_scaled(
        self, a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, bias
    ) -> torch.Tensor:
        """``a @ b.T`` of two block-scaled operands: one row-wise GEMM per K block, summed in
        float32 (module docstring)."""
        if not (isinstance(a, BlockQuantized) and isinstance(b, BlockQuantized)):
            raise ValueError("a block-scaled GEMM takes two block-scaled operands")
        width = a.block[1]
        if b.block[1] != width:
            raise ValueError(
                f"FP8 GEMM operands blocked {a.block} and {b.block}: their blocks along K differ"
            )
        if width % ALIGNMENT:
            raise ValueError(f"K blocks of {width}: _scaled_mm takes K in multiples of {ALIGNMENT}")
        if self._in_one_call(a, b, out_dtype, bias):
            return _one_call_block_gemm(a, b, out_dtype, bias)
        (m, k), n = a.data.shape, b.data.shape[0]
        k_blocks, n_padded = -(-k // width), _aligned(n)
        # Each K block's slice of an operand, contiguous; a partial last block zero-padded.
        a_blocks = _k_blocks(a.data, m, k_blocks, width)
        b_blocks = _k_blocks(b.data, n_padded, k_blocks, width)
        # Each row's scale in each K block, K block first: [k_blocks, rows] (a 128x128 block
        # covers 128 rows), so that a block's scales are one contiguous row.
        device = a.data.device
        scale_a = _on(a.scale_inv, device).repeat_interleave(a.block[0], dim=0)[:m]
        scale_b = _on(b.scale_inv, device).repeat_interleave(b.block[0], dim=0)[:n]
        scale_a = scale_a.t().contiguous()
        scale_b = F.pad(scale_b.t(), (0, n_padded - n), value=1.0).contiguous()
        out = torch.zeros(m, n_padded, dtype=torch.float32, device=device)
        for j in range(k_blocks):
            out += torch._scaled_mm(
                a_blocks[j],
                b_blocks[j].t(),
                scale_a=scale_a[j].reshape(m, 1),
                scale_b=scale_b[j].reshape(1, n_padded),
                out_dtype=torch.float32,
                use_fast_accum=self.use_fast_accum,
            )
        out = out[:, :n]
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    def block_calls(
        self,
        a: BlockQuantized,
        b: BlockQuantized,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> int:
        """How many GEMMs ``a @ b.T`` of two block-scaled operands takes on their device: 1
        where torch's one-call block GEMM runs that combination exactly, else one per K
        block."""
        if self._in_one_call(a, b, out_dtype, bias):
            return 1
        return -(-a.data.shape[1] // a.block[1])

    def _in_one_call(self, a, b, out_dtype, bias) -> bool:
        """Whether ``a @ b.T`` runs as torch's one-call block GEMM: its blocks are a pair torch
        takes, and the device ran that combination exactly (written in float32 under a bias,
        which is added there)."""
        if not self.one_call_blocks or (a.block, b.block) not in ONE_CALL_PAIRS:
            return False
        written = torch.float32 if bias is not None else out_dtype
        formats = (a.data.dtype, b.data.dtype)
        return not one_call_block_gemm_unsupported(
            a.data.device, formats, (a.block, b.block), written
        )


def _check_operands(a, b) -> None:
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        raise ValueError(
            "torch._scaled_mm has no E5M2 x E5M2 GEMM (cuBLASLt offers none); one operand "
            "must be E4M3, as under the 'hybrid' and 'e4m3' recipes"
        )
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"FP8 GEMM operands {tuple(a.data.shape)} and {tuple(b.data.shape)} do not share K"
        )


def _k_blocks(data: torch.Tensor, rows: int, k_blocks: int, width: int) -> torch.Tensor:
    """``data`` ``[R, K]`` (FP8) as ``[k_blocks, rows, width]``, K block j at ``[j]``,
    zero-padded to ``rows`` rows and whole blocks."""
    padded = _pad(data, rows, k_blocks * width).view(torch.uint8)
    blocks = padded.reshape(rows, k_blocks, width).transpose(0, 1)
    return blocks.contiguous().view(data.dtype)


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def _pad(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``data`` (2-D, FP8, row-major) in the top-left corner of zeros of ``[rows, cols]``."""
    data = data.contiguous()
    if data.shape == (rows, cols):
        return data
    # Padding works on the bytes: 0x00 is +0 in E4M3 and in E5M2, and byte tensors pad on every
    # device and torch version.
    padding = (0, cols - data.shape[1], 0, rows - data.shape[0])
    return F.pad(data.view(torch.uint8), padding).view(data.dtype)


def _on(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    # State kept on the host (a plain Fp8Linear moved to a GPU) gives host scales; _scaled_mm
    # takes them on the operands' device only. Megatron layers keep their state on the device.
    return scale if scale.device == device else scale.to(device)


@functools.cache
def _probe(device_type: str, index: int | None) -> str | None:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return (
                f"{name} has compute capability {major}.{minor}; FP8 tensor cores need 8.9 or "
                "newer (Ada, Hopper such as H100/H200, Blackwell)"
            )
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    a = torch.zeros(ALIGNMENT, ALIGNMENT, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return f"torch {torch.__version__}'s _scaled_mm fails for FP8 on {device}: {exc}"
    return None


def scaled_mm_unsupported(device: torch.device | str = "cpu") -> str | None:
    """None when ``torch._scaled_mm`` runs FP8 GEMMs on ``device``, else the reason it cannot
    (a tiny GEMM is tried once per device)."""
    return _probe(*_probe_key(device))


def block_scaled_mm_unsupported(device: torch.device | str = "cpu") -> str | None:
    """None when :class:`ScaledMmGemm` runs block-scaled GEMMs on ``device``, else why not: no
    FP8 ``_scaled_mm`` at all, or no row-wise scaled GEMM with float32 output (one is tried,
    and its result checked, once per device)."""
    reason = scaled_mm_unsupported(device)
    return reason if reason is not None else _rowwise_probe(*_probe_key(device))


def _probe_key(device: torch.device | str) -> tuple[str, int | None]:
    """The device a probe's answer is cached for: a bare ``cuda`` is the current GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return "cuda", torch.cuda.current_device()
    return device.type, device.index


@functools.cache
def _rowwise_probe(device_type: str, index: int | None) -> str | None:
    """One GEMM as :meth:`ScaledMmGemm._block_scaled` makes them: E5M2 x E4M3 (a gradient's
    GEMMs under HYBRID), an odd M, and scales that are a row of a larger grid (so they start
    where the K block's row does, not at an aligned address)."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    m = ALIGNMENT + 1
    a = torch.ones(m, ALIGNMENT, device=device).to(torch.float8_e5m2)
    b = torch.ones(ALIGNMENT, ALIGNMENT, device=device).to(torch.float8_e4m3fn)
    grid_a = torch.arange(1, 2 * m + 1, dtype=torch.float32, device=device).reshape(2, m)
    grid_b = torch.arange(1, 2 * ALIGNMENT + 1, dtype=torch.float32, device=device)
    grid_b = grid_b.reshape(2, ALIGNMENT)
    scale_a, scale_b = grid_a[1].reshape(m, 1), grid_b[1].reshape(1, ALIGNMENT)
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return (
            f"torch {torch.__version__} has no row-wise scaled FP8 GEMM with float32 output on "
            f"{device} ({str(exc).splitlines()[0]}); block scales are applied that way"
        )
    expected = ALIGNMENT * scale_a * scale_b  # exact: small integers
    if not torch.equal(out, expected):
        return f"torch {torch.__version__}'s row-wise scaled FP8 GEMM on {device} scales wrongly"
    return None


# ----------------------------------------------------------------------------------------
# torch's one-call block-scaled GEMM (torch.nn.functional.scaled_mm), checked on the device
# ----------------------------------------------------------------------------------------

# The block pairs (a's, b's) torch multiplies in one call; 128x128 by 128x128 is not one.
ONE_CALL_PAIRS = {
    ((1, BLOCK), (BLOCK, BLOCK)),
    ((1, BLOCK), (1, BLOCK)),
    ((BLOCK, BLOCK), (1, BLOCK)),
}


def one_call_block_gemm_unsupported(
    device: torch.device | str,
    formats: tuple[torch.dtype, torch.dtype],
    blocks: tuple[tuple[int, int], tuple[int, int]],
    out_dtype: torch.dtype,
) -> str | None:
    """None when torch's one-call block-scaled GEMM multiplies operands of these FP8
    ``formats`` and ``blocks`` into ``out_dtype`` on ``device``, exactly; else why not. Tried
    once per device and combination (module docstring)."""
    key = (*_probe_key(device), formats, blocks, out_dtype)
    return _one_call_probe(*key)


def ask_one_call_block_gemms(
    device: torch.device | str, hybrid: bool, out_dtypes: tuple[torch.dtype, ...]
) -> dict[tuple, str | None]:
    """Try, once and before training, every one-call block GEMM a run can ask for: each pair
    of blocks, the formats of fprop (E4M3 x E4M3) and of dgrad and wgrad (the gradient first:
    E5M2 under HYBRID), each output dtype and float32 (a GEMM with a bias). Otherwise the
    first GEMM of a kind would try it mid-step, syncing the device there. Returns what each
    combination's probe said."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    formats = [(e4m3, e4m3)] + ([(e5m2, e4m3)] if hybrid else [])
    return {
        (pair, blocks, dtype): one_call_block_gemm_unsupported(device, pair, blocks, dtype)
        for pair in formats
        for blocks in sorted(ONE_CALL_PAIRS)
        for dtype in dict.fromkeys((*out_dtypes, torch.float32))
    }


def one_call_block_gemm_args(a: BlockQuantized, b: BlockQuantized) -> dict:
    """The arguments of ``torch.nn.functional.scaled_mm`` for ``a @ b.T``: data padded to
    whole blocks (zeros, exact), each scale grid in the layout torch reads for its block
    (module docstring). Padded rows of ``b`` are cut off the output by the caller."""
    from torch.nn.functional import ScalingType

    (m, k), n = a.data.shape, b.data.shape[0]
    k_blocks = -(-k // BLOCK)
    k_padded = k_blocks * BLOCK
    recipes, scales, rows = [], [], []
    for operand, length in ((a, m), (b, n)):
        grid = operand.scale_inv.float()  # [ceil(rows / block rows), k_blocks]
        if operand.block == (1, BLOCK):
            # Outer-dim-major: [rows, k_blocks] with stride (1, rows). M is free; N is aligned.
            padded = length if operand is a else _aligned(length)
            grid = F.pad(grid, (0, 0, 0, padded - length), value=1.0)
            scale = grid.t().contiguous().t()
            recipes.append(ScalingType.BlockWise1x128)
        else:
            # [L4, row blocks] with stride (1, L4): the K blocks padded to a multiple of 4.
            padded = -(-length // BLOCK) * BLOCK
            l4 = -(-k_blocks // 4) * 4
            scale = F.pad(grid, (0, l4 - k_blocks), value=1.0).contiguous().t()
            recipes.append(ScalingType.BlockWise128x128)
        scales.append(_on(scale, operand.data.device))
        rows.append(padded)
    a_data = _pad(a.data, rows[0], k_padded)
    b_data = _pad(b.data, rows[1], k_padded)
    return {
        "mat_a": a_data,
        "mat_b": b_data.t(),  # [K', N'] column-major: a view
        "scale_a": scales[0],
        "scale_recipe_a": recipes[0],
        "scale_b": scales[1],
        "scale_recipe_b": recipes[1],
    }


def _one_call_block_gemm(
    a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in one ``scaled_mm``: written in ``out_dtype`` when there is no
    bias, else in float32 with the bias added before the one rounding (as everywhere here)."""
    out = _one_call(a, b, torch.float32 if bias is not None else out_dtype)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _one_call(a: BlockQuantized, b: BlockQuantized, written: torch.dtype) -> torch.Tensor:
    m, n = a.data.shape[0], b.data.shape[0]
    return F.scaled_mm(**one_call_block_gemm_args(a, b), output_dtype=written)[:m, :n]


@functools.cache
def _one_call_probe(
    device_type: str,
    index: int | None,
    formats: tuple[torch.dtype, torch.dtype],
    blocks: tuple[tuple[int, int], tuple[int, int]],
    out_dtype: torch.dtype,
) -> str | None:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if blocks not in ONE_CALL_PAIRS:
        return f"torch's one-call block GEMM takes no {blocks[0]} x {blocks[1]} blocks"
    reason = scaled_mm_unsupported(device)
    if reason is not None:
        return reason
    # Two shapes: an odd M, K of two and a half blocks (a partial block; 3 K blocks, padded to
    # 4 in a 128x128 grid), N not a multiple of 128; and one K block (scales of one column).
    for m, k, n in ((129, 2 * BLOCK + 64, 144), (17, BLOCK, 48)):
        a = _probe_operand(m, k, blocks[0], formats[0], device, seed=1)
        b = _probe_operand(n, k, blocks[1], formats[1], device, seed=2)
        try:  # the comparison syncs: a kernel error on the device surfaces in it
            exact = torch.equal(
                _one_call(a, b, out_dtype).cpu(), _exact_product(a, b).to(out_dtype)
            )
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            return (
                f"torch {torch.__version__}'s one-call block-scaled GEMM fails on {device} for "
                f"{blocks[0]} x {blocks[1]} blocks ({str(exc).splitlines()[0]})"
            )
        if not exact:
            return (
                f"torch {torch.__version__}'s one-call block-scaled GEMM on {device} differs "
                f"from the blocks' exact product for {blocks[0]} x {blocks[1]} blocks "
                f"({m}x{k}x{n})"
            )
    return None


def _exact_product(a: BlockQuantized, b: BlockQuantized) -> torch.Tensor:
    """The probe's expected result, on the host: exact in float64, and in float32 too
    (``_probe_operand``)."""
    return a.dequantize().cpu().double() @ b.dequantize().cpu().double().t()


def _probe_operand(rows, k, block, fp8, device, seed) -> BlockQuantized:
    """Small integers (exact in E4M3 and E5M2) and a scale per block that differs from its
    neighbours': 1, 1.25, 1.5 or 1.75 times 2^-1, 1 or 2 (mantissa bits too, so a kernel that
    rounded scales to powers of two would not pass). Every product is a multiple of 2^-6 below
    37, so every sum of the probe's K products is exact in float32 (20 bits)."""
    i = torch.arange(rows)[:, None]
    j = torch.arange(k)[None, :]
    values = ((i * 7 + j * 3 + seed) % 7 - 3).float()
    grid_rows, grid_cols = -(-rows // block[0]), -(-k // block[1])
    r = torch.arange(grid_rows)[:, None]
    c = torch.arange(grid_cols)[None, :]
    mantissa = 1 + ((r + 3 * c + seed) % 4).float() / 4
    scale_inv = mantissa * torch.exp2(((r + 2 * c + seed) % 3 - 1).float())
    data = values.to(fp8).to(device)
    return BlockQuantized(
        data=data,
        scale_inv=scale_inv.to(device),
        block=block,
        fp8=E4M3 if fp8 == torch.float8_e4m3fn else E5M2,
        scale=torch.reciprocal(scale_inv).to(device),
        amax=torch.tensor(3.0, device=device),
    )
