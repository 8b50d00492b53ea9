"""Per-GEMM precision in the FP8 linear: each of fprop, dgrad and wgrad in FP8 or in high
precision, for delayed scaling and every stateless recipe, against a reference built from the
same casts, the same emulated FP8 GEMM and plain high-precision matmuls; which tensors are cast
and recorded; what is kept for backward; and, on Megatron's layers, that all three in high
precision is the module's base-dtype fallback."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fp8ops.precision import DelayedScalingRecipe, EmulatedGemm, Fp8Linear, Fp8Scope
from fp8ops.precision.gemms import GEMMS, cast_roles, check_gemms, in_order
from fp8ops.precision.quantize import quantize
from fp8ops.precision.scaling import BWD_GRAD_OUTPUT, FWD_INPUT, FWD_WEIGHT
from fp8ops.precision.stateless import StatelessRecipe

# Every subset of the three GEMMs that run in FP8, from none to all.
SUBSETS = [frozenset(c) for n in range(4) for c in itertools.combinations(GEMMS, n)]
STATELESS = {
    "current": StatelessRecipe.current(),
    "block": StatelessRecipe.block(),
    "mxfp8": StatelessRecipe.mxfp8(),
}
DELAYED = DelayedScalingRecipe(amax_history_len=4)
SLOT = {
    "input": (True, FWD_INPUT),
    "weight": (True, FWD_WEIGHT),
    "grad_output": (False, BWD_GRAD_OUTPUT),
}
# Megatron's own deprecation notices, raised by its local spec whatever fp8ops does.
pytestmark = pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning")


def name(subset: frozenset) -> str:
    return "+".join(in_order(subset)) or "none"


def data(seed=0, tokens=64, k=96, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.1
    grad = torch.randn(tokens, n, generator=g) * 1e-2
    return x, w, grad


def layer_with(recipe, w, fp8_gemms):
    layer = Fp8Linear(w.shape[1], w.shape[0], recipe, bias=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(torch.linspace(-1, 1, w.shape[0]))
    layer.fp8_gemms = fp8_gemms
    return layer


def step(layer, scope, x, grad):
    x = x.clone().requires_grad_(True)
    with scope():
        out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


# -- the GEMM names ------------------------------------------------------------------------------


def test_each_tensor_is_cast_for_the_fp8_gemms_that_read_it():
    assert cast_roles({"fprop"}) == ("input", "weight")
    assert cast_roles({"wgrad"}) == ("input", "grad_output")
    assert cast_roles({"dgrad"}) == ("weight", "grad_output")
    assert cast_roles({"dgrad", "wgrad"}) == ("input", "weight", "grad_output")
    assert cast_roles(()) == ()


@pytest.mark.parametrize(
    "given, words",
    [
        (["wgard"], "'wgard' is not a GEMM"),
        ([], "empty"),
        (["wgrad", "wgrad"], "'wgrad' is listed twice"),
    ],
)
def test_bad_gemm_lists_are_refused_naming_the_field(given, words):
    with pytest.raises(ValueError, match=rf"^where: .*{words}"):
        check_gemms(given, "where")


# -- delayed scaling -------------------------------------------------------------------------


def warmed(fp8_gemms, x, w, grad):
    """A layer and scope after one all-FP8 step with other data (so no scale is 1), its GEMMs
    then set to ``fp8_gemms``."""
    torch.manual_seed(0)
    layer = layer_with(DELAYED, w, frozenset(GEMMS))
    scope = Fp8Scope(DELAYED)
    step(layer, scope, x.flip(0) * 0.5, grad.flip(0) * 2)
    layer.zero_grad()
    layer.fp8_gemms = fp8_gemms
    return layer, scope


@pytest.mark.parametrize("fp8_gemms", SUBSETS, ids=name)
def test_delayed_each_gemm_multiplies_fp8_casts_or_the_high_precision_tensors(fp8_gemms):
    x, w, grad = data()
    layer, scope = warmed(fp8_gemms, x, w, grad)
    meta = layer.fp8_meta
    before = {
        role: (
            meta.direction(fwd).amax_history[:, slot].clone(),
            meta.direction(fwd).scale[slot].clone(),
        )
        for role, (fwd, slot) in SLOT.items()
    }
    # The reference: the slot's current scale, the same cast and the same emulated GEMM where a
    # GEMM runs FP8 (exactly the linear's operations, so compared exactly), and plain matmuls
    # of the float32 tensors where it does not (Megatron's local linear's, again exactly).
    b = layer.bias.detach()
    qx, qw = (
        quantize(t, before[r][1], DELAYED.fp8_format.forward, transposed=True)[0]
        for t, r in ((x, "input"), (w, "weight"))
    )
    qg = quantize(grad, before["grad_output"][1], DELAYED.fp8_format.backward, transposed=True)[0]
    gemm = EmulatedGemm()
    expected_out = gemm(qx, qw, torch.float32, b) if "fprop" in fp8_gemms else x @ w.t() + b
    expected_dx = gemm(qg, qw.transposed(), torch.float32) if "dgrad" in fp8_gemms else grad @ w
    expected_dw = (
        gemm(qg.transposed(), qx.transposed(), torch.float32)
        if "wgrad" in fp8_gemms
        else grad.t() @ x
    )

    out, dx, dw, db = step(layer, scope, x, grad)
    assert torch.equal(out, expected_out)
    assert torch.equal(dx, expected_dx)
    assert torch.equal(dw, expected_dw)
    assert torch.equal(db, grad.sum(0))

    # A tensor no FP8 GEMM reads was not cast: its slot recorded no amax, so the update neither
    # rolled its history nor changed its scale (TE's fused kernel skips a zero amax). A cast
    # slot rolled, its newest entry the tensor's amax.
    for role, (fwd, slot) in SLOT.items():
        history, scale = meta.direction(fwd).amax_history[:, slot], meta.direction(fwd).scale[slot]
        tensor = {"input": x, "weight": w, "grad_output": grad}[role]
        if role in cast_roles(fp8_gemms):
            assert history[-1] == tensor.abs().max()
            assert torch.equal(history[1:-1], before[role][0][2:])
        else:
            assert torch.equal(history, before[role][0])
            assert scale == before[role][1]


@pytest.mark.parametrize("fp8_gemms", SUBSETS, ids=name)
def test_delayed_backward_keeps_the_fp8_copies_or_the_high_precision_input(fp8_gemms):
    """What forward saves for backward: an FP8 GEMM's transposed FP8 copy, a wgrad in high
    precision the float32 input, a dgrad in high precision the weight (the parameter itself)."""
    x, w, grad = data()
    layer, scope = warmed(fp8_gemms, x, w, grad)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape), t is layer.weight))
        return t

    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), scope():
        layer(x)
    fp8 = {(s[1]) for s in saved if s[0] == torch.float8_e4m3fn}
    assert ((96, 64) in fp8) == ("wgrad" in fp8_gemms)  # x transposed, FP8
    assert ((96, 32) in fp8) == ("dgrad" in fp8_gemms)  # W transposed, FP8
    float_input = (torch.float32, (64, 96), False) in saved
    assert float_input == ("wgrad" not in fp8_gemms)
    assert any(s[2] for s in saved) == ("dgrad" not in fp8_gemms)


def test_delayed_without_fp8_gemms_registers_but_records_nothing():
    x, w, grad = data()
    layer, scope = warmed(frozenset(), x, w, grad)
    state = {k: v.clone() for k, v in layer.fp8_meta.state_dict().items()}
    step(layer, scope, x, grad)
    for key, value in layer.fp8_meta.state_dict().items():
        assert torch.equal(value, state[key]), key


# -- the stateless recipes ---------------------------------------------------------------------


@pytest.mark.parametrize("fp8_gemms", SUBSETS, ids=name)
@pytest.mark.parametrize("kind", STATELESS)
def test_stateless_each_gemm_multiplies_fp8_casts_or_the_high_precision_tensors(kind, fp8_gemms):
    recipe = STATELESS[kind]
    x, w, grad = data(seed=1, tokens=64, k=160, n=64)
    layer = layer_with(recipe, w, fp8_gemms)
    layer.track_stats = True
    b = layer.bias.detach()
    # The reference: the recipe's own casts of each tensor, row-wise and column-wise, and the
    # same emulated GEMM (exactly the linear's operations); plain matmuls elsewhere.
    gemm = EmulatedGemm()
    qx, qw, qg = (
        recipe.quantize(t, r) for t, r in ((x, "input"), (w, "weight"), (grad, "grad_output"))
    )
    expected_out = gemm(qx, qw, torch.float32, b) if "fprop" in fp8_gemms else x @ w.t() + b
    w_t = recipe.columnwise(w, "weight", qw).transposed()
    expected_dx = gemm(qg, w_t, torch.float32) if "dgrad" in fp8_gemms else grad @ w
    g_t = recipe.columnwise(grad, "grad_output", qg).transposed()
    x_t = recipe.columnwise(x, "input", qx).transposed()
    expected_dw = gemm(g_t, x_t, torch.float32) if "wgrad" in fp8_gemms else grad.t() @ x

    out, dx, dw, db = step(layer, Fp8Scope(recipe), x, grad)
    assert torch.equal(out, expected_out)
    assert torch.equal(dx, expected_dx)
    assert torch.equal(dw, expected_dw)
    assert torch.equal(db, grad.sum(0))
    # The statistics name exactly the tensors some FP8 GEMM read.
    assert sorted(layer.last_cast_stats) == sorted(cast_roles(fp8_gemms))


@pytest.mark.parametrize("kind", STATELESS)
def test_stateless_weight_is_not_cast_when_no_fp8_gemm_reads_it(kind):
    recipe = STATELESS[kind]
    x, w, _ = data(seed=1, tokens=64, k=160, n=64)
    layer = layer_with(recipe, w, frozenset({"wgrad"}))
    x = x.clone().requires_grad_(True)
    with Fp8Scope(recipe)():
        layer(x, is_first_microbatch=True)
        assert layer._weight_fp8 is None  # nothing cached: nothing cast
        layer(x, is_first_microbatch=False)


def test_all_gemms_in_high_precision_add_nothing_to_the_fp8_path():
    """With no GEMM in FP8 the linear is the float matmuls: out, dx and dW as a reference
    linear built from them (bit for bit: the same three operations)."""
    x, w, grad = data()
    for recipe in (DELAYED, *STATELESS.values()):
        torch.manual_seed(0)
        layer = layer_with(recipe, w, frozenset())
        out, dx, dw, _ = step(layer, Fp8Scope(recipe), x, grad)
        assert torch.equal(out, x @ w.t() + layer.bias.detach())
        assert torch.equal(dx, grad @ w)
        assert torch.equal(dw, grad.t() @ x)
        assert not math.isnan(out.sum().item())


# -- Megatron's layers -------------------------------------------------------------------------


def test_a_megatron_layer_with_every_gemm_in_bf16_is_its_base_dtype_fallback(megatron_tp1):
    """A bf16 GPT whose fc1 runs all three GEMMs in high precision trains its step bit for bit
    as with fc1 admitted to the base dtype (Megatron's own forward): the same matmuls, the same
    bias addition. With only wgrad in high precision it is neither: the forward is FP8's."""
    from support.example_manifests import TINY

    from fp8ops.manifest import load_manifest
    from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_modules

    manifest = load_manifest(TINY)
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    b, s = manifest.schedule.micro_batch_size, manifest.model.seq_length
    tokens = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(0))

    def run(configure):
        model = build_gpt(manifest, recipe)
        configure(fp8_modules(model)[fc1])
        scope = Fp8Scope(recipe, group=amax_reduction_group(manifest.topology))
        with scope():
            loss = model(tokens[:, :-1], torch.arange(s).expand(b, s), None, labels=tokens[:, 1:])
        loss.mean().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def fallback(m):
        m.fp8_enabled = False

    def no_fp8_gemm(m):
        m.fp8_gemms = frozenset()

    def wgrad_only(m):
        m.fp8_gemms = frozenset({"fprop", "dgrad"})

    base_loss, base_grads = run(fallback)
    loss, grads = run(no_fp8_gemm)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], base_grads[n]) for n in base_grads)
    loss, grads = run(wgrad_only)
    assert not torch.equal(loss, base_loss)


def test_on_scaled_mm_the_fp8_gemms_are_its_and_the_others_plain_matmuls():
    """The backend only changes the FP8 GEMM: with wgrad in high precision, fprop and dgrad
    are torch._scaled_mm's of the same casts (compared exactly with the same GEMM called on
    them), wgrad the float32 matmul."""
    from fp8ops.precision import ScaledMmGemm, scaled_mm_unsupported

    reason = scaled_mm_unsupported("cpu")
    if reason is not None:
        pytest.skip(f"no torch._scaled_mm here: {reason}")
    recipe = STATELESS["current"]
    x, w, grad = data(seed=2, tokens=64, k=96, n=32)
    gemm = ScaledMmGemm()
    layer = layer_with(recipe, w, frozenset({"fprop", "dgrad"}))
    layer.gemm = gemm
    qx, qw, qg = (
        recipe.quantize(t, r) for t, r in ((x, "input"), (w, "weight"), (grad, "grad_output"))
    )
    out, dx, dw, _ = step(layer, Fp8Scope(recipe), x, grad)
    assert torch.equal(out, gemm(qx, qw, torch.float32, layer.bias.detach()))
    assert torch.equal(dx, gemm(qg, qw.transposed(), torch.float32))
    assert torch.equal(dw, grad.t() @ x)
