"""NVFP4 casts as Transformer Engine computes them: the recipe (TE's ``NVFP4BlockScaling``), the
per-tensor quantizer settings it derives for each role, and the cast itself, bit for bit with
TE's kernels wherever those are deterministic. Not yet a manifest recipe: nothing here trains.

An NVFP4 tensor is E2M1 elements (``e2m1.py``) with two levels of scale:

* per tensor (or per row, ``row_scaled_nvfp4``), a float32 encode scale
  ``S_enc = (e4m3_max * 6) / amax``: FLT_MAX where that overflows, 1 where the amax is 0 or
  inf (TE's ``compute_global_encode_scaling_factor_FP4``); ``e4m3_max`` is 448, or 256 for
  4over6 tensors that leave E4M3 room for map-to-4's larger scales;
* per block of 16 elements along a row (or per 16x16 tile, ``with_2d_quantization``), an E4M3
  decode scale ``e4m3(block_amax * (S_enc * f32(1/6)))``, saturating at 448.

Each element is cast as ``e2m1(x * min(1 / (f32(block_scale) * (1 / S_enc)), FLT_MAX))``, and
read back as ``e2m1 * (block_scale * amax * f32(1 / (6 * e4m3_max)))`` (TE's dequantize).
All of it is float32 arithmetic, one IEEE operation at a time, in TE's order; amaxes skip NaN.

A GEMM takes both operands along the reduction dimension, so a tensor has two copies, each cast
from high precision: *row-wise* (blocks along its rows) and *column-wise*, the transpose cast
the same way and stored transposed. The column-wise copy is what the wgrad GEMM multiplies;
with ``with_rht`` it is first put through the random Hadamard transform (``RHT_MATRIX``, on
blocks of 16 along its rows, bf16 in and out, as TE's kernel: exact where the float32 sum of
each 16 products is, which is where TE's own result does not depend on its summation order).

**4over6** (``nvfp4_use_4over6``) casts each block twice, with the normal scale (map-to-6) and
with 1.5 times it (map-to-4, so E2M1's 4 covers what 6 does), measures each candidate's error
against the input (MAE or MSE, summed over the block's 16 elements in order; a 16x16 tile adds
its rows' errors in the kernel's tree order) and keeps map-to-4 only if its error is strictly
lower (``quantize_4over6_nvfp4.cuh``).

TE requires both dimensions to be multiples of 16 (``NVFP4Quantizer.is_quantizable``); a
tensor that is not is refused here, never padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8ops.precision import e2m1
from fp8ops.precision.scales import FLT_MAX, tensor_amax

BLOCK = 16
E4M3_MAX = 448.0
_RCP_FP4_MAX = torch.tensor(1.0 / e2m1.E2M1_MAX, dtype=torch.float32)  # TE's f32(1/6)
ROLES = ("input", "weight", "grad_output")
SCOPES_4OVER6 = ("none", "weights", "activations", "all")
ERR_MODES = ("MAE", "MSE")

# TE's get_wgrad_sign_vector: one fixed sign per row of the 16x16 Hadamard matrix.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix of +-1 (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h


# diag(signs) @ H / sqrt(16): every entry +-0.25, exact in bf16 and float32.
RHT_MATRIX = torch.diag(torch.tensor(RHT_SIGNS, dtype=torch.float32)) @ _hadamard(BLOCK) / 4.0


@dataclass(frozen=True, kw_only=True)
class NVFP4Config:
    """How one tensor is cast: the fields of TE's ``NVFP4Quantizer``, refused where TE refuses
    them."""

    with_rht: bool = False  # column-wise copy only
    with_2d_quantization: bool = False
    stochastic_rounding: bool = False
    # one global scale per row; the column-wise copy's per row of the transpose (TE's bf16
    # kernel and reference quantizer; its float32 kernel refuses a row-scaled column-wise copy)
    row_scaled_nvfp4: bool = False
    nvfp4_use_4over6: bool = False
    nvfp4_e4m3_max: int = 448
    nvfp4_4over6_err_mode: str = "MAE"

    def __post_init__(self) -> None:
        if self.nvfp4_e4m3_max not in (448, 256):
            raise ValueError(f"nvfp4_e4m3_max must be 448 or 256, got {self.nvfp4_e4m3_max}")
        if self.nvfp4_e4m3_max == 256 and not self.nvfp4_use_4over6:
            raise ValueError("nvfp4_e4m3_max=256 applies only to 4over6 tensors (TE uses 448)")
        if self.nvfp4_4over6_err_mode not in ERR_MODES:
            raise ValueError(
                f"nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got {self.nvfp4_4over6_err_mode!r}"
            )
        if self.nvfp4_use_4over6:
            _refuse_with("4over6", rht=self.with_rht, stochastic=self.stochastic_rounding)
        if self.row_scaled_nvfp4:
            _refuse_with(
                "row-scaled",
                rht=self.with_rht,
                stochastic=self.stochastic_rounding,
                two_d=self.with_2d_quantization,
            )

    @property
    def e4m3_max(self) -> float:
        """The E4M3 bound of the global scale: 256 only for 4over6 tensors that ask for it."""
        return float(self.nvfp4_e4m3_max)


def _refuse_with(what: str, *, rht: bool, stochastic: bool, two_d: bool = False) -> None:
    for name, on in (
        ("the random Hadamard transform", rht),
        ("stochastic rounding", stochastic),
        ("2-D (16x16) quantization", two_d),
    ):
        if on:
            raise ValueError(f"NVFP4 {what} quantization does not support {name} (nor does TE)")


@dataclass(frozen=True, kw_only=True)
class NVFP4Recipe:
    """TE's ``NVFP4BlockScaling``: its fields and defaults (each switch on), and the quantizer
    each tensor role gets from them (TE's ``NVFP4BlockScalingRecipeState.make_quantizers``).

    | role | blocks | RHT (column-wise copy) | stochastic rounding |
    |---|---|---|---|
    | input | 1x16 | on | off |
    | weight | 16x16 | off | off |
    | grad_output | 1x16 | on | on |
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"

    def __post_init__(self) -> None:
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in SCOPES_4OVER6:
                raise ValueError(
                    f"{name} must be one of {', '.join(SCOPES_4OVER6)}, got {getattr(self, name)!r}"
                )
        if self.nvfp4_4over6_err_mode not in ERR_MODES:
            raise ValueError(
                f"nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got {self.nvfp4_4over6_err_mode!r}"
            )
        # TE refuses when it builds a role's quantizer; here, up front. Only the activations'
        # RHT can clash (4over6 never reaches gradients, weights take no RHT).
        for role in ROLES:
            try:
                self.config(role)
            except ValueError as e:
                raise ValueError(f"{role}: {e}: set disable_rht=True with it") from None

    def config(self, role: str) -> NVFP4Config:
        if role not in ROLES:
            raise ValueError(f"NVFP4 casts the roles {', '.join(ROLES)}, not {role!r}")
        weight, grad = role == "weight", role == "grad_output"
        use_4over6 = not grad and _in_scope(self.nvfp4_4over6, weight)
        use_256 = use_4over6 and _in_scope(self.nvfp4_4over6_e4m3_use_256, weight)
        return NVFP4Config(
            with_rht=not weight and not self.disable_rht,
            with_2d_quantization=weight and not self.disable_2d_quantization,
            stochastic_rounding=grad and not self.disable_stochastic_rounding,
            row_scaled_nvfp4=role == "input" and self.row_scaled_activation,
            nvfp4_use_4over6=use_4over6,
            nvfp4_e4m3_max=256 if use_256 else 448,
            nvfp4_4over6_err_mode=self.nvfp4_4over6_err_mode,
        )


def _in_scope(scope: str, weight: bool) -> bool:
    return scope == "all" or scope == ("weights" if weight else "activations")


@dataclass(frozen=True)
class NVFP4Tensor:
    """One copy of an NVFP4 cast of an ``[M, K]`` tensor (the column-wise copy: of its
    transpose, ``[K, M]``), in TE's compact layout."""

    data: torch.Tensor  # uint8 [M, K / 2]: two E2M1 codes a byte, the even element low
    scale_inv: torch.Tensor  # float8_e4m3fn [M, K / 16]: each block's decode scale
    amax: torch.Tensor  # float32 [1], or [M] when row-scaled: what S_enc was made from
    e4m3_max: float  # 448, or 256 (4over6): the global scale's E4M3 bound

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] * 2)

    def codes(self) -> torch.Tensor:
        """The E2M1 codes, one per element, ``[M, K]`` uint8."""
        return e2m1.unpack(self.data)

    def global_encode_scale(self) -> torch.Tensor:
        return global_encode_scale(self.amax, self.e4m3_max)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """TE's ``dequantize_fp4_kernel``: ``e2m1 * (scale * amax * f32(1 / (6 e4m3_max)))``."""
        factor = torch.tensor(1.0 / (e2m1.E2M1_MAX * self.e4m3_max), dtype=torch.float32)
        amax = self.amax.reshape(-1, 1, 1)
        rows, cols = self.shape
        per_block = (self.scale_inv.float().reshape(rows, -1, 1) * amax) * factor
        values = e2m1.decode(self.codes()).reshape(rows, -1, BLOCK) * per_block
        return values.reshape(rows, cols).to(dtype)


@dataclass(frozen=True)
class NVFP4Quantized:
    """A tensor's row-wise and column-wise copies (either None where not asked for)."""

    rowwise: NVFP4Tensor | None
    columnwise: NVFP4Tensor | None


def global_encode_scale(amax: torch.Tensor, e4m3_max: float = E4M3_MAX) -> torch.Tensor:
    """TE's ``compute_global_encode_scaling_factor_FP4`` over a float32 amax tensor."""
    amax = amax.float()
    s = torch.tensor(e4m3_max * e2m1.E2M1_MAX, dtype=torch.float32) / amax
    s = torch.fmin(s, torch.tensor(FLT_MAX))  # fminf: an overflowed quotient becomes FLT_MAX
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """TE's RHT of a bf16 ``[R, C]`` tensor: each run of 16 along a row times ``RHT_MATRIX``,
    the products summed in float32, rounded to bf16 (TE's unfused kernel and its reference
    both round there; only ``NVTE_USE_FAST_MATH`` skips it)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(
            f"the random Hadamard transform takes bfloat16 input (as TE), not {x.dtype}"
        )
    rows, cols = x.shape
    y = x.float().reshape(-1, BLOCK) @ RHT_MATRIX.to(x.device)
    return y.reshape(rows, cols).to(torch.bfloat16)


def quantize(
    x: torch.Tensor,
    config: NVFP4Config,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    generator: torch.Generator | None = None,
) -> NVFP4Quantized:
    """The NVFP4 cast of a 2-D float32, bf16 or fp16 tensor under ``config``. Stochastic
    rounding draws from ``generator`` (seed it from the run's recorded seed), the row-wise copy
    first."""
    _check_input(x, config)
    if config.stochastic_rounding and generator is None:
        raise ValueError(
            "stochastic_rounding draws its random bits from a torch.Generator: pass generator= "
            "seeded from a recorded seed, so the cast can be replayed"
        )
    x = x.detach()
    row = _quantize_rows(x.float(), config, generator) if rowwise else None
    col = None
    if columnwise:
        t = x.t().contiguous()
        t = random_hadamard_transform(t) if config.with_rht else t
        col = _quantize_rows(t.float(), config, generator)
    return NVFP4Quantized(row, col)


def _check_input(x: torch.Tensor, config: NVFP4Config) -> None:
    if x.dim() != 2:
        raise ValueError(f"NVFP4 quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"NVFP4 quantizes float32, bfloat16 or float16 input, not {x.dtype}")
    if any(side % BLOCK for side in x.shape):
        raise ValueError(
            f"NVFP4 needs both dimensions divisible by {BLOCK} (as TE's is_quantizable), got "
            f"shape {tuple(x.shape)}: pad the tensor, or keep this layer in high precision"
        )
    if config.with_rht and x.dtype != torch.bfloat16:
        raise ValueError(
            f"with_rht: TE applies the random Hadamard transform to bfloat16 input only, got "
            f"{x.dtype}; cast to bfloat16 or turn the transform off (disable_rht)"
        )


def _quantize_rows(
    x: torch.Tensor, config: NVFP4Config, generator: torch.Generator | None
) -> NVFP4Tensor:
    """Blocks along the rows of float32 ``x`` ``[R, C]`` (16x16 tiles with 2-D quantization)."""
    rows, cols = x.shape
    amax = tensor_amax(x, dims=(1,)) if config.row_scaled_nvfp4 else tensor_amax(x).reshape(1)
    s_enc = global_encode_scale(amax, config.e4m3_max).reshape(-1, 1)  # [R or 1, 1]
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    block_amax = _block_amax(blocks, config.with_2d_quantization)
    if config.nvfp4_use_4over6:
        codes, scale = _four_over_six(blocks, block_amax, amax.reshape(-1, 1), s_enc, config)
    else:
        scale = _to_e4m3(torch.fmin(block_amax * (s_enc * _RCP_FP4_MAX), torch.tensor(FLT_MAX)))
        scaled = blocks * _encode_multiplier(scale, s_enc).unsqueeze(-1)
        if config.stochastic_rounding:
            random_bytes = torch.randint(
                0, 256, scaled.shape, generator=generator, dtype=torch.int16, device=x.device
            )
            codes = e2m1.encode_sr(scaled, random_bytes)
        else:
            codes = e2m1.encode_rn(scaled)
    return NVFP4Tensor(e2m1.pack(codes.reshape(rows, cols)), scale, amax, config.e4m3_max)


def _block_amax(blocks: torch.Tensor, two_d: bool) -> torch.Tensor:
    """Each block's NaN-skipping amax, ``[R, C / 16]``; a 16x16 tile's repeated on its rows."""
    if not two_d:
        return tensor_amax(blocks, dims=(2,))
    rows, n, _ = blocks.shape
    tiles = tensor_amax(blocks.reshape(rows // BLOCK, BLOCK, n, BLOCK), dims=(1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 to E4M3, nearest even, saturating at 448 (``__NV_SATFINITE``)."""
    return v.clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)


def _encode_multiplier(scale: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """What a block's elements are multiplied by: ``min(1 / (scale * (1 / S_enc)), FLT_MAX)``
    (a zero scale makes it FLT_MAX)."""
    s_dec = 1.0 / s_enc
    return torch.fmin(1.0 / (scale.float() * s_dec), torch.tensor(FLT_MAX))


def _four_over_six(
    blocks: torch.Tensor,
    block_amax: torch.Tensor,
    amax: torch.Tensor,
    s_enc: torch.Tensor,
    config: NVFP4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6's codes and scales (``quantize_4over6_nvfp4.cuh``): map-to-4 where its error
    is strictly below map-to-6's. The kernel's base scale divides by 6 where the standard path
    multiplies by f32(1/6): the two can differ by an ulp, so each path keeps its own."""
    base = block_amax / e2m1.E2M1_MAX * s_enc
    candidates = []
    for expand in (1.5, 1.0):  # map-to-4, map-to-6
        scale = _to_e4m3(torch.fmin(base * expand, torch.tensor(E4M3_MAX)))
        codes = e2m1.encode_rn(blocks * _encode_multiplier(scale, s_enc).unsqueeze(-1))
        error = _candidate_error(blocks, codes, scale, amax, config)
        candidates.append((codes, scale, error))
    (codes4, scale4, error4), (codes6, scale6, error6) = candidates
    pick4 = error4 < error6  # a tie, or a NaN error, keeps map-to-6
    codes = torch.where(pick4.unsqueeze(-1), codes4, codes6)
    bits = torch.where(pick4, scale4.view(torch.uint8), scale6.view(torch.uint8))
    return codes, bits.view(torch.float8_e4m3fn)


def _candidate_error(
    blocks: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    config: NVFP4Config,
) -> torch.Tensor:
    """The kernel's error of one candidate, per block: element by element in order,
    ``((e2m1 * scale) * amax) / (6 e4m3_max) - x``, its absolute value or square added to a
    float32 sum; a 16x16 tile's per-row sums then added in the warp's tree order."""
    denominator = torch.tensor(e2m1.E2M1_MAX * config.e4m3_max, dtype=torch.float32)
    values, sf = e2m1.decode(codes), scale.float()
    error = torch.zeros(blocks.shape[:2], dtype=torch.float32, device=blocks.device)
    for i in range(BLOCK):
        diff = ((values[..., i] * sf) * amax) / denominator - blocks[..., i]
        error = error + (diff * diff if config.nvfp4_4over6_err_mode == "MSE" else diff.abs())
    if not config.with_2d_quantization:
        return error
    rows, n = error.shape
    tree = error.reshape(rows // BLOCK, BLOCK, n)
    while tree.shape[1] > 1:  # shfl_down by 8, 4, 2, 1: lane i adds lane i + half
        half = tree.shape[1] // 2
        tree = tree[:, :half] + tree[:, half:]
    return tree[:, 0].repeat_interleave(BLOCK, dim=0)
