"""FP8 formats, roles and the saturating cast."""

import math

import pytest
import torch

from fp8ops.precision import E4M3, E5M2, Fp8Format, saturating_cast

ONE = torch.tensor(1.0)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_overflow_and_infinity_saturate_to_max(fp8):
    x = torch.tensor([fp8.max * 1.01, -fp8.max * 4, math.inf, -math.inf, 1e30])
    out = saturating_cast(x, ONE, fp8).float()
    assert out.tolist() == [fp8.max, -fp8.max, fp8.max, -fp8.max, fp8.max]


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_nan_stays_nan(fp8):
    out = saturating_cast(torch.tensor([math.nan, 1.0]), ONE, fp8).float()
    assert math.isnan(out[0]) and out[1] == 1.0


def test_torch_cast_alone_does_not_saturate_e5m2():
    # Why the clamp exists: torch's own cast sends out-of-range E5M2 to inf (and its E4M3
    # behaviour differs across versions); TE's SATFINITE cast gives +-max.
    assert torch.isinf(torch.tensor([1e30]).to(torch.float8_e5m2).float()).all()
    assert saturating_cast(torch.tensor([1e30]), ONE, E5M2).float().item() == 57344.0


def test_round_to_nearest_even_e4m3():
    # Between 1 and 2 E4M3 steps by 1/8. 1 + 1/16 is a tie: goes to the even 1.0;
    # 1 + 3/16 is a tie between 1.125 (odd mantissa) and 1.25 (even): goes to 1.25.
    x = torch.tensor([1.0625, 1.1875, 1.07, -1.1875])
    assert saturating_cast(x, ONE, E4M3).float().tolist() == [1.0, 1.25, 1.125, -1.25]


def test_scale_is_applied_before_the_cast():
    out = saturating_cast(torch.tensor([3.5]), torch.tensor(128.0), E4M3).float()
    assert out.item() == 448.0


def test_hybrid_gives_e4m3_forward_and_e5m2_backward():
    assert Fp8Format.HYBRID.forward is E4M3 and Fp8Format.HYBRID.backward is E5M2
    assert Fp8Format.E4M3.forward is E4M3 and Fp8Format.E4M3.backward is E4M3
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)


def test_pure_e5m2_is_refused_with_an_explanation():
    with pytest.raises(ValueError, match="pure E5M2 training is not supported.*hybrid"):
        Fp8Format.parse("e5m2")
    assert Fp8Format.parse("HYBRID") is Fp8Format.HYBRID
