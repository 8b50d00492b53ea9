"""The emulated FP8 linear and the FP8 scope: numerics against float64, amax bookkeeping
and the timing of forward/backward updates."""

import pytest
import torch

from fp8ops.precision import (
    E4M3,
    E5M2,
    DelayedScalingRecipe,
    Fp8Linear,
    Fp8Scope,
    quantize,
)

RECIPE = DelayedScalingRecipe(amax_history_len=4)


def make(in_features=32, out_features=16, seed=0, recipe=RECIPE):
    torch.manual_seed(seed)
    return Fp8Linear(in_features, out_features, recipe), Fp8Scope(recipe)


def warm_up(layer, scope, x):
    """One training step so that scales are no longer 1."""
    with scope():
        out = layer(x)
    out.square().sum().backward()
    layer.zero_grad()


def q64(t, scale, fp8):
    """Quantize-dequantize in float64: the exact operand values an FP8 GEMM sees."""
    q, _ = quantize(t, scale, fp8)
    return q.data.double() * q.scale_inv.double()


def test_forward_and_gradients_match_float64_on_the_fp8_operands():
    layer, scope = make()
    x = torch.randn(8, 32)
    warm_up(layer, scope, x)
    meta = layer.fp8_meta
    s_in, s_w = meta.forward.scale[0].clone(), meta.forward.scale[1].clone()
    s_grad = meta.backward.scale[0].clone()

    x = torch.randn(8, 32).requires_grad_()
    with scope():
        out = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    xq, wq, gq = (
        q64(x.detach(), s_in, E4M3),
        q64(layer.weight.detach(), s_w, E4M3),
        q64(grad_out, s_grad, E5M2),
    )
    expected_out = xq @ wq.T + layer.bias.double()
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gq.T @ xq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad.double(), grad_out.double().sum(0))


def test_fp8_error_against_the_unquantized_float64_product_is_small_but_not_zero():
    layer, scope = make(in_features=256, out_features=64)
    x = torch.randn(64, 256)
    warm_up(layer, scope, x)
    with scope():
        out = layer(x)
    exact = x.double() @ layer.weight.double().T + layer.bias.double()
    relative = ((out.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < relative < 0.05  # E4M3 operands: a few percent at most, never exact


def test_first_step_casts_use_scale_one_and_the_update_is_delayed():
    layer, scope = make()
    x = torch.randn(4, 32) * 3
    with scope():
        layer(x).sum().backward()  # (backward inside is fine: update order is what matters)
    a_in = x.abs().max()
    assert layer.fp8_meta.forward.scale[0] == torch.tensor(448.0) / a_in
    assert layer.fp8_meta.forward.amax_history[-1, 0] == a_in
    assert layer.fp8_meta.forward.amax_history[0].tolist() == [0.0, 0.0, 0.0]


def test_amaxes_accumulate_over_micro_batches_and_the_weight_is_cast_once():
    layer, scope = make()
    xs = [torch.randn(4, 32) * k for k in (1.0, 5.0, 2.0)]
    history = layer.fp8_meta.forward.amax_history
    with scope():
        for i, x in enumerate(xs):
            layer(x, is_first_microbatch=(i == 0))
        # inside the scope, before the update: row 0 is the running max
        assert history[0, 0] == max(x.abs().max() for x in xs)
        assert history[0, 1] == layer.weight.detach().abs().max()
        weight_fp8 = layer._weight_fp8
        layer.weight.data.mul_(10)  # a later micro-batch must not recast the weight
        layer(xs[0], is_first_microbatch=False)
        assert layer._weight_fp8 is weight_fp8
        assert history[0, 1] == layer.weight.detach().abs().max() / 10
    assert history[0].tolist() == [0.0, 0.0, 0.0]


def test_weight_is_recast_every_call_without_micro_batching():
    layer, scope = make()
    with scope():
        layer(torch.randn(2, 32))
        layer.weight.data.mul_(10)
        layer(torch.randn(2, 32))  # is_first_microbatch=None: always cast
        assert layer.fp8_meta.forward.amax_history[0, 1] == layer.weight.abs().max()


def test_update_runs_only_at_outermost_exit_in_grad_mode():
    layer, scope = make()
    meta = layer.fp8_meta
    with torch.no_grad(), scope():
        layer(torch.full((2, 32), 2.0))
    assert meta.forward.scale[0] == 1.0  # eval: no update...
    assert meta.forward.amax_history[0, 0] == 2.0  # ...the amax waits for the next one
    with scope():
        with scope():
            layer(torch.full((2, 32), 1.0))
        assert meta.forward.scale[0] == 1.0  # inner exit: nothing yet
    assert meta.forward.scale[0] == 224.0  # 448 / max(2, 1)


def test_backward_update_once_per_backward_pass():
    first, scope = make()
    second = Fp8Linear(16, 16, RECIPE)
    x = torch.randn(4, 32)
    with scope():
        out = second(first(x))
    grad = torch.randn_like(out) * 100
    out.backward(grad)
    # `second` runs its backward first; `first` ran first forward and triggers the update
    assert second.fp8_meta.backward.scale[0] == torch.tensor(57344.0) / grad.abs().max()
    assert second.fp8_meta.backward.amax_history[0, 0] == 0  # consumed by the update
    assert first.fp8_meta.backward.amax_history[-1, 0] > 0
    assert first.fp8_meta.backward.scale[0] != 1.0


def test_registered_module_that_did_not_run_keeps_its_state():
    used, scope = make()
    idle = Fp8Linear(32, 16, RECIPE)
    x = torch.randn(4, 32)
    with scope():
        idle(x).sum().backward()
        used(x).sum().backward()
    idle_state = {k: v.clone() for k, v in idle.fp8_meta.state_dict().items()}
    for _ in range(3):
        with scope():
            out = used(x)
        out.sum().backward()
    for key, value in idle.fp8_meta.state_dict().items():
        assert torch.equal(value, idle_state[key]), key


def test_outside_or_disabled_scope_runs_high_precision():
    layer, scope = make()
    x = torch.randn(4, 32)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), plain)
    with scope(), scope(enabled=False):
        assert torch.equal(layer(x), plain)
    assert layer.fp8_meta.forward.amax_history.abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_follows_input(dtype):
    torch.manual_seed(0)
    layer = Fp8Linear(32, 8, RECIPE, dtype=dtype)
    scope = Fp8Scope(RECIPE)
    x = torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)
    with scope():
        out = layer(x)
    out.float().sum().backward()
    assert out.dtype == dtype and out.shape == (3, 5, 8)
    assert x.grad.dtype == dtype and layer.weight.grad.dtype == dtype


def test_cast_statistics_are_tracked_on_request():
    layer, scope = make()
    layer.track_stats = True
    x = torch.randn(4, 32) * 1000  # saturates at scale 1
    with scope():
        layer(x).sum().backward()
    stats = layer.last_cast_stats
    assert set(stats) == {"input", "weight", "grad_output"}
    assert stats["input"].as_dict()["saturated"] > 0


def test_a_disabled_outermost_scope_does_not_update():
    layer, scope = make()
    with scope():
        layer(torch.full((2, 32), 2.0))  # registers, then updates: scale 224
    with torch.no_grad(), scope():
        layer(torch.full((2, 32), 4.0))  # eval cast: amax 4 waits in row 0
    with scope(enabled=False):
        layer(torch.full((2, 32), 1.0))
    assert layer.fp8_meta.forward.scale[0] == 224.0
    assert layer.fp8_meta.forward.amax_history[0, 0] == 4.0


def count_updates(scope, monkeypatch):
    calls = []
    original = scope.reduce_and_update
    monkeypatch.setattr(
        scope, "reduce_and_update", lambda forward: (calls.append(forward), original(forward))
    )
    return calls


def test_exactly_one_forward_and_one_backward_update_per_step(monkeypatch):
    first, scope = make()
    second, third = Fp8Linear(16, 16, RECIPE), Fp8Linear(16, 4, RECIPE)
    calls = count_updates(scope, monkeypatch)
    for _ in range(2):
        with scope():
            out = third(second(first(torch.randn(4, 32))))
        out.sum().backward()
    assert calls == [True, False, True, False]


def test_frozen_first_module_still_gets_a_backward_update(monkeypatch):
    frozen, scope = make()
    frozen.requires_grad_(False)
    trained = Fp8Linear(16, 8, RECIPE)
    calls = count_updates(scope, monkeypatch)
    with scope():
        out = trained(frozen(torch.randn(4, 32)))
    out.sum().backward()
    assert calls == [True, False]
    assert trained.fp8_meta.backward.scale[0] != 1.0


def test_first_step_output_is_computed_with_scale_one():
    layer, scope = make()
    x = torch.randn(4, 32) * 0.01  # far below 448: scale 1 underflows much of it
    with scope():
        out = layer(x)
    one = torch.tensor(1.0)
    expected = q64(x, one, E4M3) @ q64(layer.weight.detach(), one, E4M3).T + layer.bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_three_dimensional_input_without_bias_matches_float64():
    torch.manual_seed(1)
    layer, scope = Fp8Linear(32, 8, RECIPE, bias=False), Fp8Scope(RECIPE)
    warm_up(layer, scope, torch.randn(2, 3, 32))
    meta = layer.fp8_meta
    s_in, s_w, s_g = (
        meta.forward.scale[0].clone(),
        meta.forward.scale[1].clone(),
        meta.backward.scale[0].clone(),
    )
    x = torch.randn(2, 3, 32, requires_grad=True)
    with scope():
        out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    xq, wq, gq = (
        q64(x.detach().reshape(6, 32), s_in, E4M3),
        q64(layer.weight.detach(), s_w, E4M3),
        q64(grad.reshape(6, 8), s_g, E5M2),
    )
    torch.testing.assert_close(out.double().reshape(6, 8), xq @ wq.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double().reshape(6, 32), gq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gq.T @ xq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field", [{"amax_history_len": 8}, {"margin": 1}])
def test_module_built_for_another_recipe_is_refused(field):
    _, scope = make()
    other = Fp8Linear(32, 8, DelayedScalingRecipe(**{"amax_history_len": 4, **field}))
    with pytest.raises(ValueError, match="the scope runs"), scope():
        other(torch.randn(2, 32))


def test_a_second_scope_cannot_nest_inside_the_first():
    _, scope = make()
    with (
        pytest.raises(RuntimeError, match="another Fp8Scope is active"),
        scope(),
        Fp8Scope(RECIPE)(),
    ):
        pass


def test_state_dict_round_trip():
    layer, scope = make()
    warm_up(layer, scope, torch.randn(4, 32))
    fresh = Fp8Linear(32, 16, RECIPE)
    fresh.fp8_meta.load_state_dict(layer.fp8_meta.state_dict())
    for key, value in layer.fp8_meta.state_dict().items():
        assert torch.equal(fresh.fp8_meta.state_dict()[key], value)
    with pytest.raises(ValueError, match="amax_history_fwd: shape"):
        Fp8Linear(32, 16, DelayedScalingRecipe(amax_history_len=2)).fp8_meta.load_state_dict(
            layer.fp8_meta.state_dict()
        )
