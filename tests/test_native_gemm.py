"""The native FP8 GEMM (``torch._scaled_mm``) against the emulated one: the same FP8 operands give
the same products up to accumulation order and output rounding, the delayed-scaling state does not
depend on the GEMM at all, and ``precision.backend`` selects it through the real trainer. Also the
shapes and machines the backends refuse.

torch's CPU build runs ``_scaled_mm`` through oneDNN, so everything here runs on a CPU; the GPU's
own numbers come from ``ci/gpu_check.py``.
"""

import importlib.util
import math
import re

import pytest
import torch
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.summary import summary_rows
from fp8ops.precision import (
    E4M3,
    E5M2,
    DelayedScalingRecipe,
    EmulatedGemm,
    Fp8Linear,
    Fp8Scope,
    ScaledMmGemm,
    scaled_mm_unsupported,
)
from fp8ops.precision.quantize import amax_of, cast

NATIVE_UNSUPPORTED = scaled_mm_unsupported("cpu")
needs_scaled_mm = pytest.mark.skipif(
    NATIVE_UNSUPPORTED is not None, reason=f"no FP8 torch._scaled_mm here: {NATIVE_UNSUPPORTED}"
)
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs the megatron extra: pip install -e '.[megatron]'",
)
pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

# How far the two GEMMs may differ, element by element. Every product of two FP8 values is exact
# in float32 (4 x 4 significant bits at most); the backends only add them up in another order,
# and each float32 partial sum rounds by at most 2**-24 of sum|a_i * b_i|. The worst case
# compounds to K of those; measured on this machine's oneDNN it stays within 2.7 (K from 96 to
# 512): both sides sum in blocks. On top, bf16 output rounds once, so two float32 results a few
# ulps apart can land on neighbouring bf16 values: one bf16 ulp.
U32 = 2.0**-24
ACCUMULATION_SLACK = 8  # x U32 x sum|a_i * b_i| (and |bias|); measured <= 2.7
# Norm-wise, only the few elements whose float32 results straddle a bf16 rounding boundary
# differ: measured <= 6.6e-5 (bf16) and <= 2.6e-7 (float32) for the cases below.
NORMWISE = {torch.bfloat16: 2.0**-12, torch.float32: 2.0**-20}

# The linear's three GEMMs, a @ b.T with a [M, K] and b [N, K] (fp8ops.precision.linear).
GEMMS = {
    "forward": (256, 192, 320, E4M3, E4M3),  # x @ W^T: tokens x in, out
    "dgrad": (256, 320, 192, E5M2, E4M3),  # g @ W: tokens x out, in (W^T transposed copy)
    "wgrad": (320, 256, 192, E5M2, E4M3),  # g^T @ x: out x tokens, in
    "wgrad, 250 tokens": (320, 250, 192, E5M2, E4M3),  # K padded to 256 with zeros
    "e4m3 recipe dgrad": (256, 320, 192, E4M3, E4M3),
    "N unaligned": (64, 96, 40, E4M3, E4M3),  # N padded to 48, then cut
}


def quantized(shape, fp8, magnitude, seed):
    """A random tensor cast with the scale delayed scaling would give it (fp8 max / amax)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * magnitude
    return cast(x, torch.tensor(fp8.max) / amax_of(x), fp8)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def assert_gemms_agree(native, emulated, a, b, bias, out_dtype):
    native, emulated = native.double(), emulated.double()
    scale = a.scale_inv.double() * b.scale_inv.double()
    magnitude = (a.data.double().abs() @ b.data.double().abs().t()) * scale  # sum |a_i b_i|
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    allowed = ACCUMULATION_SLACK * U32 * magnitude
    if out_dtype is torch.bfloat16:
        allowed = allowed + bf16_ulp(torch.maximum(native.abs(), emulated.abs()))
    excess = (native - emulated).abs() - allowed
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements beyond the bound"
    normwise = ((native - emulated).norm() / emulated.norm()).item()
    assert normwise <= NORMWISE[out_dtype], normwise


# -- the GEMM ------------------------------------------------------------------------------------


@needs_scaled_mm
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("case", GEMMS)
def test_native_gemm_agrees_with_the_emulation_on_the_same_operands(case, with_bias, out_dtype):
    m, k, n, fmt_a, fmt_b = GEMMS[case]
    a = quantized((m, k), fmt_a, 3.0 if fmt_a is E4M3 else 1e-3, seed=1)
    b = quantized((n, k), fmt_b, 0.02, seed=2)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.1).to(out_dtype)
    bias = bias if with_bias else None

    native = ScaledMmGemm()(a, b, out_dtype, bias)
    emulated = EmulatedGemm()(a, b, out_dtype, bias)
    assert native.shape == emulated.shape == (m, n)
    assert native.dtype == out_dtype
    assert_gemms_agree(native, emulated, a, b, bias, out_dtype)


@needs_scaled_mm
def test_a_bias_of_another_dtype_is_added_in_float32_as_the_emulation_does():
    a, b = quantized((64, 64), E4M3, 3.0, seed=1), quantized((32, 64), E4M3, 0.02, seed=2)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(3))  # float32, bf16 output
    native = ScaledMmGemm()(a, b, torch.bfloat16, bias)
    assert native.dtype is torch.bfloat16
    assert_gemms_agree(
        native, EmulatedGemm()(a, b, torch.bfloat16, bias), a, b, bias, torch.bfloat16
    )


@needs_scaled_mm
def test_two_e5m2_operands_are_refused():
    a, b = quantized((32, 32), E5M2, 1.0, seed=1), quantized((32, 32), E5M2, 1.0, seed=2)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        ScaledMmGemm()(a, b, torch.bfloat16)


# Block-scaled operands a @ b.T: (M, K, N), a's block, b's block, a's format. Rows spread over
# four decades (every row block its own scale) and each K block has its own power-of-2 level,
# a's inverse to b's, so every K block weighs the same in the sums: a scale applied to the
# wrong block or the wrong rows shows. K = 300 ends in a partial block, M = 250 in partial rows.
BLOCK_GEMMS = {
    "block: 1x128 x 128x128, K partial": ((256, 300, 320), (1, 128), (128, 128), E4M3),
    "block: E5M2 1x128 x 1x128, odd M, N unaligned": ((250, 256, 40), (1, 128), (1, 128), E5M2),
    "block: 128x128 x 1x128, rows partial": ((200, 384, 192), (128, 128), (1, 128), E4M3),
    "block: E5M2 1x128 x 128x128 (dgrad)": ((96, 256, 384), (1, 128), (128, 128), E5M2),
    "mxfp8: 1x32 x 1x32": ((64, 96, 32), (1, 32), (1, 32), E4M3),
}


def block_quantized(shape, block, seed, fp8=E4M3, level=1):
    """A random [rows, K] tensor as the module comment above describes, cast with block
    scaling's power-of-2 scales (or MXFP8's); ``level`` +1 or -1: the K blocks' levels."""
    from fp8ops.precision.blocks import quantize_mxfp8, quantize_scaled

    rows, k = shape
    g = torch.Generator().manual_seed(seed)
    k_level = 2.0 ** (level * (torch.arange(k) // block[1] % 4))
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows)[:, None] * k_level
    if block[1] == 32:
        return quantize_mxfp8(x, fp8)
    return quantize_scaled(x, block, fp8, power_2_scale=True)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", BLOCK_GEMMS)
def test_block_scaled_gemm_agrees_with_the_emulation_element_by_element(case, out_dtype):
    from fp8ops.precision import block_scaled_mm_unsupported

    if block_scaled_mm_unsupported("cpu") is not None:
        pytest.skip(f"no block-scaled torch._scaled_mm GEMM here: {block_scaled_mm_unsupported()}")
    (m, k, n), block_a, block_b, fp8_a = BLOCK_GEMMS[case]
    a = block_quantized((m, k), block_a, 1, fp8_a, level=1)
    b = block_quantized((n, k), block_b, 2, level=-1)
    magnitude = a.dequantize().double().abs() @ b.dequantize().double().abs().t()  # sum |a_i b_i|
    # A bias as large as the products, so that it counts.
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) * magnitude.mean().item()
    bias = bias.to(out_dtype)
    native = ScaledMmGemm()(a, b, out_dtype, bias)
    emulated = EmulatedGemm()(a, b, out_dtype, bias)
    assert native.shape == (m, n) and native.dtype == out_dtype
    # The bound of assert_gemms_agree on the dequantized operands (their scales are powers of
    # two, so every product is still exact): the sums differ in order only, per K block here.
    allowed = ACCUMULATION_SLACK * U32 * (magnitude + bias.double().abs())
    native, emulated = native.double(), emulated.double()
    if out_dtype is torch.bfloat16:
        allowed = allowed + bf16_ulp(torch.maximum(native.abs(), emulated.abs()))
    assert ((native - emulated).abs() <= allowed).all()
    assert ((native - emulated).norm() / emulated.norm()).item() <= NORMWISE[out_dtype]


def test_block_scaled_operands_must_share_their_k_blocks():
    a = block_quantized((64, 256), (1, 128), 1)
    with pytest.raises(ValueError, match="blocks along K differ"):
        ScaledMmGemm()(a, block_quantized((32, 256), (1, 32), 2), torch.float32)
    with pytest.raises(ValueError, match="two block-scaled operands"):
        ScaledMmGemm()(a, quantized((32, 256), E4M3, 1.0, seed=2), torch.float32)


# -- torch's one-call block GEMM: its layouts, checked without a GPU ---------------------------------

# (M, K, N) with an odd M, a partial K block and N unaligned to 128; then one K block only.
ONE_CALL_SHAPES = [(129, 320, 144), (33, 128, 256)]
ONE_CALL_PAIRS = [((1, 128), (128, 128)), ((1, 128), (1, 128)), ((128, 128), (1, 128))]


def exact_block_operand(rows, k, block, seed, device="cpu"):
    """Small integers (exact in E4M3) and a different power-of-2 scale per block: every
    product and every float32 sum is exact, so any summation order gives the same result."""
    from fp8ops.precision.blocks import BlockQuantized

    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-3, 4, (rows, k), generator=g).float()
    grid = (-(-rows // block[0]), -(-k // block[1]))
    scale_inv = torch.exp2(torch.randint(-3, 4, grid, generator=g).float())
    return BlockQuantized(
        values.to(torch.float8_e4m3fn).to(device),
        scale_inv.to(device),
        block,
        E4M3,
        torch.reciprocal(scale_inv).to(device),
        torch.tensor(3.0, device=device),
    )


def torch_block_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b):
    """What ``torch.nn.functional.scaled_mm`` computes for 1x128 and 128x128 block scales, by
    the meaning of its scale shapes (torch's ``_meta_registrations``): a 1x128 scale is
    ``[rows, K // 128]``, one per row and K block; a 128x128 scale is ``[L4, rows // 128]``,
    one per K block and block of 128 rows. In float64, from the arguments alone."""
    from torch.nn.functional import ScalingType

    def dequantized(data, scale, recipe):  # data [rows, K]
        k = data.shape[1]
        if recipe == ScalingType.BlockWise1x128:
            per_element = scale.repeat_interleave(128, dim=1)  # [rows, K]
        else:
            per_element = scale[: k // 128].t().repeat_interleave(128, 0).repeat_interleave(128, 1)
        return data.double() * per_element.double()

    a = dequantized(mat_a, scale_a, scale_recipe_a)
    b = dequantized(mat_b.t(), scale_b, scale_recipe_b)
    return a @ b.t()


@pytest.mark.parametrize("shape", ONE_CALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("blocks", ONE_CALL_PAIRS, ids=lambda p: f"{p[0][0]}x{p[1][0]}")
def test_one_call_block_gemm_arguments_pass_torchs_own_checks(shape, blocks):
    """torch's shape and stride rules for block scales, run as torch runs them for a device it
    has no kernel on: the meta device (the same checks as CUDA's)."""
    from torch.nn.functional import scaled_mm

    from fp8ops.precision.scaled_mm import one_call_block_gemm_args

    m, k, n = shape
    a = exact_block_operand(m, k, blocks[0], 1, device="meta")
    b = exact_block_operand(n, k, blocks[1], 2, device="meta")
    args = one_call_block_gemm_args(a, b)
    out = scaled_mm(**args, output_dtype=torch.bfloat16)
    assert out.shape[0] >= m and out.shape[1] >= n
    # The checks are live: the same scales laid out row-major are refused.
    refused = {**args, "scale_a": args["scale_a"].contiguous()}
    if args["scale_a"].shape[1] > 1 and not args["scale_a"].is_contiguous():
        with pytest.raises(RuntimeError, match="blockwise scaling"):
            scaled_mm(**refused, output_dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", ONE_CALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("blocks", ONE_CALL_PAIRS, ids=lambda p: f"{p[0][0]}x{p[1][0]}")
def test_one_call_block_gemm_arguments_mean_the_emulated_product(shape, blocks):
    """Read as torch reads them, the arguments give the product the emulation computes (exact
    operands: equal, not close); a grid transposed or a padding misplaced would not."""
    from fp8ops.precision.scaled_mm import one_call_block_gemm_args

    m, k, n = shape
    a = exact_block_operand(m, k, blocks[0], 1)
    b = exact_block_operand(n, k, blocks[1], 2)
    out = torch_block_scaled_mm(**one_call_block_gemm_args(a, b))[:m, :n]
    assert torch.equal(out.float(), EmulatedGemm()(a, b, torch.float32))


def test_the_device_probe_rejects_a_wrong_layout_and_accepts_the_right_one():
    """The probe's operands and its exact comparison: torch's arithmetic on the arguments
    matches what the probe expects, and a 128x128 grid whose K blocks are not padded to 4 (a
    plausible misreading) gives another product, which the probe would refuse."""
    from fp8ops.precision import scaled_mm as module

    for blocks in ONE_CALL_PAIRS:
        a = module._probe_operand(129, 320, blocks[0], torch.float8_e4m3fn, "cpu", 1)
        b = module._probe_operand(144, 320, blocks[1], torch.float8_e5m2, "cpu", 2)
        expected = module._exact_product(a, b)
        args = module.one_call_block_gemm_args(a, b)
        assert torch.equal(torch_block_scaled_mm(**args)[:129, :144], expected)
        if blocks[1] == (128, 128):
            grid = args["scale_b"][:3].t().contiguous()  # [N blocks, 3]: K blocks unpadded
            memory = torch.cat([grid.flatten(), torch.ones(4)])[: grid.shape[0] * 4]
            misread = {**args, "scale_b": memory.reshape(grid.shape[0], 4).t()}  # stride 4
            assert not torch.equal(torch_block_scaled_mm(**misread)[:129, :144], expected)


def test_block_gemms_stay_per_k_block_where_the_device_has_no_one_call_gemm():
    from fp8ops.precision.scaled_mm import one_call_block_gemm_unsupported

    formats = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    reason = one_call_block_gemm_unsupported("cpu", formats, ONE_CALL_PAIRS[0], torch.bfloat16)
    assert reason is not None and "one-call block-scaled GEMM" in reason  # no CPU kernel
    blocks_128x128 = ((128, 128), (128, 128))
    reason = one_call_block_gemm_unsupported("cpu", formats, blocks_128x128, torch.bfloat16)
    assert "takes no (128, 128) x (128, 128) blocks" in reason
    a, b = exact_block_operand(64, 320, (1, 128), 1), exact_block_operand(48, 320, (128, 128), 2)
    assert ScaledMmGemm().block_calls(a, b, torch.bfloat16) == 3  # one GEMM per K block
    # Asked up front for every combination a HYBRID bf16 run can use: 3 block pairs x 2 format
    # pairs x (bf16, float32 for a bias), each answered (no CPU kernel: each with its reason).
    from fp8ops.precision.scaled_mm import ask_one_call_block_gemms

    answers = ask_one_call_block_gemms("cpu", hybrid=True, out_dtypes=(torch.bfloat16,))
    assert len(answers) == 12 and all(answers.values())
    assert len(ask_one_call_block_gemms("cpu", hybrid=False, out_dtypes=(torch.float32,))) == 3


# -- the FP8 linear: the GEMM never touches the delayed-scaling state ------------------------------


def train_linear(gemm, steps=6, micro_batches=2, tokens=40):
    """A bf16 Fp8Linear over a few steps; its FP8 state, outputs and gradients.

    The gradients fed to backward are fixed data, not a function of the output, and the weight
    changes the same way in both runs: every amax is then the same whatever the GEMM, and so
    must be the state. 40 tokens: wgrad's K is padded to 48.
    """
    recipe = DelayedScalingRecipe(amax_history_len=4)
    torch.manual_seed(0)
    layer = Fp8Linear(96, 64, recipe, gemm=gemm, dtype=torch.bfloat16)
    scope = Fp8Scope(recipe)
    data = torch.Generator().manual_seed(1)
    results = []
    for step in range(steps):
        with torch.no_grad():
            layer.weight.mul_(1.25)  # a new weight amax every step
        for micro in range(micro_batches):
            x = torch.randn(tokens, 96, generator=data) * (step + 1)
            x = x.bfloat16().requires_grad_()
            with scope():
                out = layer(x, is_first_microbatch=micro == 0)
            out.backward(torch.randn(tokens, 64, generator=data).bfloat16() * 10.0**-step)
            results += [out.detach(), x.grad]
        results.append(layer.weight.grad)
        layer.zero_grad(set_to_none=True)
    return layer.fp8_meta.state_dict(), results


@needs_scaled_mm
def test_linear_state_is_bit_identical_across_backends_and_outputs_close():
    native_state, native = train_linear(ScaledMmGemm())
    emulated_state, emulated = train_linear(EmulatedGemm())
    for key, value in emulated_state.items():
        assert torch.equal(native_state[key], value), key
    assert (emulated_state["amax_history_bwd"][1:, 0] > 0).all()  # full and rolled (row 0: 0)
    for ours, theirs in zip(native, emulated, strict=True):
        difference = (ours.double() - theirs.double()).norm() / theirs.double().norm()
        assert difference < 2.0**-10, difference.item()


# -- Megatron layers: the FP8 state follows the model's device -------------------------------------


@pytest.fixture
def small_manifest():
    return derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"),
        {**SMALL_MODEL, "model.init_checkpoint": None, "precision.backend": "scaled_mm"},
        "test: native GEMM",
    )


@pytest.fixture
def megatron_world(small_manifest):
    """A one-rank world with Megatron's parallel state, ended after the test (so the trainer
    tests below can start their own)."""
    from fp8ops.train.distributed import init_distributed, shutdown_distributed

    init_distributed(small_manifest.topology, source="test")
    yield
    shutdown_distributed()


def fp8_states(model):
    from fp8ops.megatron import fp8_modules

    for module in fp8_modules(model).values():
        for state in (module.fp8_meta.forward, module.fp8_meta.backward):
            yield state.amax_history
            yield state.scale


@needs_megatron
@needs_scaled_mm
def test_fp8_state_moves_with_the_model_and_stays_float32(small_manifest, megatron_world):
    from fp8ops.megatron import build_gpt
    from fp8ops.megatron.model import GEMMS

    recipe = DelayedScalingRecipe.from_precision(small_manifest.precision)
    model = build_gpt(small_manifest, recipe)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(qkv.gemm, GEMMS["scaled_mm"])
    before = list(fp8_states(model))
    model.to(torch.float16)  # a dtype change leaves the state as it is: same tensors, float32
    assert all(now is then for now, then in zip(fp8_states(model), before, strict=True))
    model.to("meta")  # a device change moves it (the GPU test below does it for real)
    assert {(t.device.type, t.dtype) for t in fp8_states(model)} == {("meta", torch.float32)}


@needs_megatron
@needs_scaled_mm
def test_only_modules_that_run_fp8_must_be_aligned(small_manifest, megatron_world):
    from fp8ops.admission import decide_admission
    from fp8ops.errors import ManifestError
    from fp8ops.megatron import build_gpt

    unaligned = derive(small_manifest, {"model.hidden_size": 72}, "72 wide")
    recipe = DelayedScalingRecipe.from_precision(unaligned.precision)
    model = build_gpt(unaligned, recipe)  # built: whether it may run FP8 is admission's to say
    with pytest.raises(ManifestError, match="multiples of 16"):
        decide_admission(model, unaligned.precision, tensor_parallel=1)
    # Kept in bf16 by admission, they never reach the FP8 GEMM: nothing to refuse.
    excluded = derive(unaligned, {"precision.exclude_modules": ["decoder.*"]}, "all in bf16")
    decide_admission(build_gpt(excluded, recipe), excluded.precision, tensor_parallel=1)


@needs_megatron
def test_scaled_mm_is_refused_where_it_cannot_run(small_manifest, megatron_world, monkeypatch):
    from fp8ops.errors import Fp8opsError
    from fp8ops.megatron import build_gpt, model

    monkeypatch.setattr(model, "scaled_mm_unsupported", lambda device: "an old GPU")
    recipe = DelayedScalingRecipe.from_precision(small_manifest.precision)
    with pytest.raises(Fp8opsError, match="cannot run here: an old GPU; use precision.backend"):
        build_gpt(small_manifest, recipe)


@needs_megatron
@pytest.mark.parametrize(
    "changes, field",
    [
        ({"precision.scaling": "block"}, "precision.scaling 'block'"),
        (
            {
                "precision.module_recipes": [
                    {"modules": ["decoder.layers.0.*"], "scaling": "block", "reason": "r"}
                ]
            },
            "precision.module_recipes[0].scaling 'block'",
        ),
    ],
)
def test_block_scaled_recipes_on_scaled_mm_are_refused_where_the_device_lacks_their_gemm(
    small_manifest, megatron_world, monkeypatch, changes, field
):
    from fp8ops.errors import Fp8opsError
    from fp8ops.megatron import build_gpt, model

    monkeypatch.setattr(model, "block_scaled_mm_unsupported", lambda device: "an old cuBLAS")
    manifest = derive(small_manifest, {"precision.amax_history_len": 1024, **changes}, "t")
    recipe = DelayedScalingRecipe.from_precision(small_manifest.precision)
    with pytest.raises(Fp8opsError, match=rf"{re.escape(field)} on .* cannot run here: an old"):
        build_gpt(manifest, recipe)
    build_gpt(small_manifest, recipe)  # delayed scaling needs no block GEMM: built


@needs_megatron
@pytest.mark.skipif(
    not torch.cuda.is_available() or scaled_mm_unsupported("cuda") is not None,
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)",
)
def test_megatron_gpt_trains_on_the_gpu_with_its_fp8_state_there(
    small_manifest, megatron_world
):  # pragma: no cover - GPU only
    from fp8ops.megatron import build_gpt, mark_first_microbatch

    recipe = DelayedScalingRecipe.from_precision(small_manifest.precision)
    model = build_gpt(small_manifest, recipe, device="cuda")
    assert {t.device.type for t in fp8_states(model)} == {"cuda"}
    scope = Fp8Scope(recipe)
    s = small_manifest.model.seq_length
    tokens = torch.randint(0, 256, (4, s), device="cuda")
    positions = torch.arange(s, device="cuda").expand(4, s)
    for _ in range(3):
        mark_first_microbatch(model)
        with scope():
            loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        assert math.isfinite(loss.item())
    scales = torch.cat([t for t in fp8_states(model) if t.dim() == 1])
    assert torch.isfinite(scales).all() and (scales != 1).any()


# -- the backend from the manifest, through the real trainer ---------------------------------------


def write_manifest(tmp_path, name, changes):
    return write_derived(
        tmp_path / f"{name}.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": None,
            "data.num_examples": 200,
            "schedule.train_steps": 4,
            "schedule.eval_interval": 4,
            "capability.enabled": False,
            **changes,
        },
    )


def losses(run_dir):
    from fp8ops.files import read_jsonl

    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory):
    """The same small fine-tuning from scratch, once per backend: run directories by backend."""
    from fp8ops.train import run_training

    tmp = tmp_path_factory.mktemp("backends")
    runs = {}
    for backend in ("emulated", "scaled_mm"):
        manifest = write_manifest(tmp, backend, {"precision.backend": backend})
        run_training(manifest, tmp / backend, progress=False)
        runs[backend] = tmp / backend
    return runs


@needs_megatron
@needs_scaled_mm
@pytest.mark.slow
def test_training_with_scaled_mm_tracks_the_emulated_run(backend_runs):
    native, emulated = losses(backend_runs["scaled_mm"]), losses(backend_runs["emulated"])
    assert len(native) == len(emulated) == 4
    assert all(math.isfinite(loss) for loss in native)
    # The backends differ by one bf16 rounding here and there (oneDNN's FP8 GEMM accumulates in
    # another order than the emulation's float32 matmul; 4e-5 apart at step 1 here), which the
    # next steps carry on: observed 3e-4 on the CPU from one initialisation, 1.5e-3 from
    # another (the weights drawn by global name), and 1.01e-3 on an H200, whose FP8 tensor cores
    # keep fewer accumulator bits than float32 (ci/gpu_check measured 1.3e-4 normwise on a
    # float32-output GEMM). How far they drift is not a property of the GEMM but of the
    # trajectory, so the bound is the one FP8 against bf16 is allowed (test_megatron_layers.py),
    # which bounds both: 2e-3 relative to losses near 5.4 would be a wrong GEMM's 1e-2 and more.
    assert max(abs(a - b) for a, b in zip(native, emulated, strict=True)) < 2e-3


@needs_megatron
@needs_scaled_mm
def test_a_module_scaled_mm_cannot_take_is_refused_by_name_before_the_run_starts(tmp_path):
    from fp8ops.errors import ManifestError
    from fp8ops.train import run_training

    # Hidden 72: QKV is 72 x 216 and the MLP 72 x 256, 256 x 72 per rank; none a multiple of 16.
    manifest = write_manifest(
        tmp_path,
        "unaligned",
        {
            "model.hidden_size": 72,
            "precision.backend": "scaled_mm",
        },
    )
    with pytest.raises(ManifestError) as refused:
        run_training(manifest, tmp_path / "run", progress=False)
    message = str(refused.value)
    assert "decoder.layers.0.self_attention.linear_qkv (K x N = 72 x 216 per rank)" in message
    assert "multiples of 16" in message and "and 4 more" in message
    assert "precision.exclude_modules" in message and "'emulated'" in message
    assert not (tmp_path / "run").exists()

    # Modules of two recipes: each recipe's are named, not only the first's.
    mixed = write_manifest(
        tmp_path,
        "unaligned-mixed",
        {
            "model.hidden_size": 72,
            "precision.backend": "scaled_mm",
            "precision.module_recipes": [
                {"modules": ["decoder.layers.0.*"], "scaling": "current", "reason": "r"}
            ],
        },
    )
    with pytest.raises(ManifestError) as refused:
        run_training(mixed, tmp_path / "run", progress=False)
    lines = str(refused.value).splitlines()
    (current,) = [line for line in lines if "the current-scaling modules" in line]
    (delayed,) = [line for line in lines if "the delayed-scaling modules" in line]
    assert "decoder.layers.0.self_attention.linear_qkv (K x N = 72 x 216" in current
    assert "decoder.layers.1." not in current
    assert "decoder.layers.1.mlp.linear_fc2 (K x N = 256 x 72" in delayed


@needs_megatron
def test_the_te_backend_is_refused_where_transformer_engine_cannot_run(tmp_path):
    from fp8ops.errors import Fp8opsError
    from fp8ops.megatron.te_backend import te_available
    from fp8ops.train import run_training

    if te_available():
        pytest.skip("Transformer Engine runs here")
    manifest = write_manifest(tmp_path, "te", {"precision.backend": "te"})
    with pytest.raises(Fp8opsError, match="needs a CUDA GPU and transformer_engine.pytorch"):
        run_training(manifest, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# -- the manifest field ------------------------------------------------------------------------


def test_a_backend_change_is_drift_a_resume_can_accept():
    from fp8ops.start.checks import _unloadable
    from fp8ops.start.drift import Drift, manifest_drift

    emulated = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    assert emulated.precision.backend == "emulated"  # the default
    native = derive(emulated, {"precision.backend": "scaled_mm"}, "tensor cores")
    drift = Drift(manifest_drift(emulated, native))
    assert [(c.path, c.old, c.new) for c in drift.changes] == [
        ("precision.backend", "emulated", "scaled_mm")
    ]
    # Same FP8 state layout under both GEMMs: accepted with a reason, never "unloadable".
    assert _unloadable(drift) is None
    assert dict(summary_rows(native))["FP8 GEMM"].startswith("scaled_mm (torch._scaled_mm")
