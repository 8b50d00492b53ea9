"""quantize(): FP8 data, scale_inv and the statistics of the cast, on crafted tensors."""

import math

import numpy as np
import torch

from fp8ops.precision import E4M3, E5M2, quantize

E4M3_MIN_SUBNORMAL = 2.0**-9


def test_statistics_on_a_crafted_tensor():
    x = torch.tensor(
        [0.0, 1.0, -2.0, 500.0, -1000.0, math.inf, math.nan, math.nan, 1e-4, -1e-5, 3.0]
    )
    q, stats = quantize(x, torch.tensor(1.0), E4M3)
    assert stats.amax.item() == math.inf  # inf propagates, NaN is ignored
    assert stats.as_dict() == {
        "amax": math.inf,
        "saturated": 3,  # 500, -1000, inf
        "underflow": 2,  # 1e-4 and -1e-5 become 0; the exact 0 does not count
        "nan": 2,
        "inf": 1,
        "numel": 11,
    }
    assert q.data.dtype == torch.float8_e4m3fn


def test_amax_ignores_nan_only():
    _, stats = quantize(torch.tensor([math.nan, -7.5, 2.0]), torch.tensor(1.0), E4M3)
    assert stats.amax.item() == 7.5


def test_scale_moves_values_into_and_out_of_range():
    x = torch.tensor([3.5, 0.001])
    _, stats = quantize(x, torch.tensor(128.0), E4M3)  # 3.5 * 128 = 448: exactly max
    assert stats.as_dict()["saturated"] == 0 and stats.as_dict()["underflow"] == 0
    _, stats = quantize(x, torch.tensor(129.0), E4M3)
    assert stats.as_dict()["saturated"] == 1
    _, stats = quantize(x, torch.tensor(0.1), E4M3)  # 1e-4 < half the smallest subnormal
    assert stats.as_dict()["underflow"] == 1


def test_values_at_the_subnormal_edge():
    half = E4M3_MIN_SUBNORMAL / 2
    x = torch.tensor([half * 0.99, half * 1.01, E4M3_MIN_SUBNORMAL])
    q, stats = quantize(x, torch.tensor(1.0), E4M3)
    assert q.data.float().tolist() == [0.0, E4M3_MIN_SUBNORMAL, E4M3_MIN_SUBNORMAL]
    assert stats.as_dict()["underflow"] == 1


def test_scale_inv_is_the_correctly_rounded_reciprocal():
    for s in [3.0, 7.0, 448.0 / 3.3, 1e-3, 3.4028235e38]:
        q, _ = quantize(torch.tensor([1.0]), torch.tensor(s), E5M2)
        assert q.scale_inv.item() == float(np.float32(1) / np.float32(s))


def test_dequantize_round_trip_within_fp8_precision():
    torch.manual_seed(0)
    x = torch.randn(4096)
    scale = torch.tensor(448.0) / x.abs().max()
    q, stats = quantize(x, scale, E4M3)
    back = q.dequantize()
    relative = ((back - x).abs() / x.abs().clamp_min(1e-2)).max().item()
    assert relative <= 2.0**-4 + 1e-6  # 3 mantissa bits: half an ulp is 1/16
    assert stats.as_dict()["saturated"] == 0


def test_bf16_input_is_scaled_in_float32():
    x = torch.tensor([1.5, 300.0], dtype=torch.bfloat16)
    q, stats = quantize(x, torch.tensor(2.0), E4M3)
    assert q.data.float().tolist() == [3.0, 448.0]
    assert stats.as_dict()["saturated"] == 1 and stats.amax.dtype == torch.float32


def test_empty_tensor():
    q, stats = quantize(torch.empty(0), torch.tensor(1.0), E4M3)
    assert stats.as_dict()["amax"] == 0.0 and stats.numel == 0 and q.data.numel() == 0
