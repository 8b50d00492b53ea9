"""The optimizer step: learning-rate schedule, float32 main weights, clipping."""

import itertools
import math

import pytest
import torch
from support.example_manifests import TINY
from torch import nn

from fp8ops.manifest import derive, load_manifest
from fp8ops.train.optimizer import MainParamsOptimizer, learning_rate


@pytest.fixture(scope="module", autouse=True)
def _one_rank(gloo_world_of_one):
    """The optimizer's collectives need a process group (tests/conftest.py)."""


def _manifest(**changes):
    return derive(load_manifest(TINY), changes, "optimizer test")


def test_schedule_warms_up_then_decays_to_min_lr():
    m = _manifest(**{"schedule.train_steps": 11, "schedule.warmup_steps": 2})
    lrs = [learning_rate(step, m.optimizer, m.schedule) for step in range(11)]
    peak, floor = m.optimizer.lr, m.optimizer.min_lr
    assert lrs[:2] == [peak / 2, peak]
    assert lrs[2] == pytest.approx(peak)  # decay starts from the peak ...
    assert lrs[-1] == pytest.approx(floor)  # ... and ends at min_lr on the last step
    assert lrs[6] == pytest.approx(floor + (peak - floor) * 0.5)  # cosine midpoint
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    linear = _manifest(
        **{"schedule.train_steps": 12, "schedule.warmup_steps": 1, "schedule.lr_decay": "linear"}
    )
    assert learning_rate(6, linear.optimizer, linear.schedule) == pytest.approx((peak + floor) / 2)


def _bf16_layer() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    return layer


def test_updates_below_bf16_resolution_accumulate_in_float32_main_weights():
    # bf16 has 8 significant bits: 1 + 1e-3 rounds back to 1. SGD steps of 1e-3 each vanish in a
    # bf16 weight but add up in the float32 main copy, and reach the model once they exceed
    # half a bf16 ulp of 1 (2**-8).
    cfg = _manifest(
        **{
            "optimizer.name": "sgd",
            "optimizer.beta1": 0.0,
            "optimizer.weight_decay": 0.0,
            "optimizer.clip_grad": None,
        }
    ).optimizer
    layer = _bf16_layer()
    optimizer = MainParamsOptimizer(layer, cfg, tp_group=None, dp_group=None)
    update_norms = []
    for _ in range(10):
        layer.weight.grad = torch.full_like(layer.weight, -1.0)
        optimizer.step(lr=1e-3)
        update_norms.append(optimizer.last_update_norm)
    # The update norm is what reached the bf16 weights: one bf16 ulp (2**-7) per element, once,
    # when the float32 sum crossed half an ulp; every other step rounded away.
    assert sorted(update_norms) == [0.0] * 9 + [2**-7 * 8]
    assert optimizer.main_params[0].dtype == torch.float32
    assert optimizer.main_params[0][0, 0].item() == pytest.approx(1.01, abs=1e-6)
    assert layer.weight[0, 0].item() == 1.0078125  # bf16 rounding of 1.01
    plain = _bf16_layer()
    sgd = torch.optim.SGD(plain.parameters(), lr=1e-3)
    for _ in range(10):
        plain.weight.grad = torch.full_like(plain.weight, -1.0)
        sgd.step()
    assert plain.weight[0, 0].item() == 1.0  # every update rounded away


def test_clipping_uses_the_global_norm_and_skips_non_finite_steps():
    cfg = _manifest(
        **{
            "optimizer.name": "sgd",
            "optimizer.beta1": 0.0,
            "optimizer.weight_decay": 0.0,
            "optimizer.clip_grad": 1.0,
        }
    ).optimizer
    layer = _bf16_layer()
    optimizer = MainParamsOptimizer(layer, cfg, tp_group=None, dp_group=None)
    layer.weight.grad = torch.full_like(layer.weight, 0.5)  # norm 0.5 * 8 = 4
    norm, skipped = optimizer.step(lr=1.0)
    assert (norm, skipped) == (4.0, False)
    # Clipped to norm 1: each element moved by 0.5 / 4 (within torch's 1e-6 epsilon).
    assert optimizer.main_params[0][0, 0].item() == pytest.approx(1 - 0.125, rel=1e-5)
    # 64 elements each moved by 0.125 (exact in bf16): the update's norm is 0.125 * 8.
    assert optimizer.last_update_norm == pytest.approx(1.0, rel=1e-5)
    before = optimizer.main_params[0].clone()
    layer.weight.grad = torch.full_like(layer.weight, math.inf)
    norm, skipped = optimizer.step(lr=1.0)
    assert skipped and not math.isfinite(norm)
    assert torch.equal(optimizer.main_params[0], before)  # weights untouched
    assert optimizer.last_update_norm is None  # a skipped step made no update
    assert layer.weight.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_weight_norm_is_of_the_weights_before_the_step(dtype):
    """Measured in the update norm's pass (no pass or collectives of its own): the weights as
    they were before the update, in their own dtype, which update_blowup compares it with."""
    cfg = _manifest(**{"optimizer.name": "adamw", "optimizer.clip_grad": None}).optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).to(dtype)
    optimizer = MainParamsOptimizer(model, cfg, tp_group=None, dp_group=None)
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step(lr=0.1)
        weights = math.sqrt(sum(float(w.double().pow(2).sum()) for w in before))
        # The change as the model holds it (float32 for either dtype), squared in float64.
        changes = [(p.float() - w.float()).double() for p, w in zip(model.parameters(), before)]
        update = math.sqrt(sum(float(c.pow(2).sum()) for c in changes))
        # Both sums in float64 of exact squares, in other orders: within float64 rounding
        # (measured 2e-16 relative).
        assert optimizer.last_weight_norm == pytest.approx(weights, rel=1e-12), step
        assert optimizer.last_update_norm == pytest.approx(update, rel=1e-12), step
        assert optimizer.last_update_norm > 0.01 * optimizer.last_weight_norm  # a real step
