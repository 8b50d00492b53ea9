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

    def __init__(self, *, use_fast_accum: bool = False):
        self.use_fast_accum = use_fast_accum

    def __call__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if a.data.dtype == b.data.dtype == torch.float8_e5m2:
            raise ValueError(
                "torch._scaled_mm has no E5M2 x E5M2 GEMM (cuBLASLt offers none); one operand "
                "must be E4M3, as under the 'hybrid' and 'e4m3' recipes"
            )
        if a.data.shape[1] != b.data.shape[1]:
            raise ValueError(
                f"FP8 GEMM operands {tuple(a.data.shape)} and {tuple(b.data.shape)} do not share K"
            )
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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _probe(device.type, device.index)
