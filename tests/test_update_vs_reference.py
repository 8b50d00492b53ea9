"""Bit-for-bit comparison of ``fp8ops.precision.scaling.update_delayed_scaling``
against the independent scalar oracle in ``tests/support/te_update_oracle.py`` (Transformer
Engine's fused ``kernel_bulk`` delayed-scaling update, reference doc 2.3/2.5/2.6).

Results are compared as int32 bit patterns; any NaN equals any NaN (payloads may
differ), everything else -- including the sign of zero -- must match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from support.te_update_oracle import FLT_MAX, reference_update  # tests/ is on sys.path under pytest
from support.test_tier import examples

from fp8ops.precision.scaling import update_delayed_scaling

F32 = np.float32
NAN = float("nan")
INF = float("inf")
FP8_MAXES = (448.0, 57344.0)
ALGOS = ("max", "most_recent")

# --------------------------------------------------------------------------- helpers


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (as a Python float)."""
    return float(F32(x))


def _hex(x) -> str:
    x = F32(x)
    return f"{float(x)!r}(0x{int(np.array(x, F32).view(np.int32)) & 0xFFFFFFFF:08x})"


def _to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32).view(np.int32)


def bitwise_equal_nan_any(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: same float32 bit pattern, or both NaN (any payload)."""
    a = np.ascontiguousarray(a, dtype=F32)
    b = np.ascontiguousarray(b, dtype=F32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (_bits(a) == _bits(b)) | (np.isnan(a) & np.isnan(b))


def assert_bitwise_equal(got: np.ndarray, want: np.ndarray, what: str, context: str = "") -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == F32, f"{what}: dtype {got.dtype}, expected float32"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    ok = bitwise_equal_nan_any(got, want)
    if not ok.all():
        bad = np.argwhere(~ok)
        lines = [f"{what}: {len(bad)} element(s) differ bit-for-bit (showing up to 10)"]
        for idx in bad[:10]:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  at {idx}: got {_hex(got[idx])}  reference {_hex(want[idx])}")
        if context:
            lines.append(context)
        raise AssertionError("\n".join(lines))


def _describe(history, scale, amax, fp8_max, margin, algo, slots=None) -> str:
    L, n = history.shape
    slots = range(n) if slots is None else slots
    out = [f"inputs: L={L} n={n} fp8_max={fp8_max} margin={margin} algo={algo!r}"]
    for k in slots:
        col = history[:, k]
        if L > 12:
            nz = np.flatnonzero(_bits(col) != 0)
            shown = ", ".join(f"[{i}]={_hex(col[i])}" for i in nz[:12])
            col_s = f"nonzero-bit rows: {shown}{' ...' if len(nz) > 12 else ''}"
        else:
            col_s = "[" + ", ".join(_hex(v) for v in col) + "]"
        out.append(f"  slot {k}: amax={_hex(amax[k])} scale={_hex(scale[k])} history={col_s}")
    return "\n".join(out)


def run_both(history, scale, amax, fp8_max, margin, algo):
    """Run the project (torch) and the oracle (numpy) on copies of the same inputs."""
    h_t = torch.from_numpy(history.copy())
    s_t = torch.from_numpy(scale.copy())
    a_t = torch.from_numpy(amax.copy())
    got_h, got_s = update_delayed_scaling(h_t, s_t, a_t, fp8_max=fp8_max, margin=margin, algo=algo)
    assert isinstance(got_h, torch.Tensor) and isinstance(got_s, torch.Tensor)
    assert got_h.dtype == torch.float32 and got_s.dtype == torch.float32
    want_h, want_s = reference_update(history, scale, amax, fp8_max, margin, algo)
    return (_to_np(got_h), _to_np(got_s)), (want_h, want_s)


def check_case(history, scale, amax, fp8_max, margin, algo) -> None:
    history = np.ascontiguousarray(history, F32)
    scale = np.ascontiguousarray(scale, F32)
    amax = np.ascontiguousarray(amax, F32)
    (got_h, got_s), (want_h, want_s) = run_both(history, scale, amax, fp8_max, margin, algo)
    bad_slots = (
        sorted(
            set(np.flatnonzero(~bitwise_equal_nan_any(got_s, want_s)).tolist())
            | set(np.argwhere(~bitwise_equal_nan_any(got_h, want_h))[:, 1].tolist())
        )
        if got_h.shape == want_h.shape and got_s.shape == want_s.shape
        else None
    )
    ctx = _describe(history, scale, amax, fp8_max, margin, algo, bad_slots)
    assert_bitwise_equal(got_s, want_s, "new_scale", ctx)
    assert_bitwise_equal(got_h, want_h, "new_history", ctx)


# ------------------------------------------------------------------------ strategies

_FLT_MAX = float(FLT_MAX)
_MIN_NORMAL = float(np.finfo(F32).tiny)  # 1.1754944e-38
_MAX_DENORMAL = float(np.nextafter(F32(_MIN_NORMAL), F32(0)))

SPECIALS = [
    0.0,
    -0.0,
    NAN,
    INF,
    _f32(1e-45),
    _f32(1e-40),
    _f32(1.17e-38),
    _MAX_DENORMAL,
    _MIN_NORMAL,
    _FLT_MAX,
    1.0,
    3.5,
    _f32(4.9626e-07),
    448.0,
    57344.0,
]

zero_st = st.sampled_from([0.0, -0.0])
special_st = st.sampled_from(SPECIALS)
denormal_st = st.floats(min_value=_f32(1e-45), max_value=_MAX_DENORMAL, width=32)
tiny_st = st.floats(min_value=_MIN_NORMAL, max_value=_f32(1e-30), width=32)
ordinary_st = st.floats(min_value=_f32(1e-8), max_value=_f32(1e8), width=32)
huge_st = st.floats(min_value=_f32(1e30), max_value=_FLT_MAX, width=32)

# one_of picks a branch roughly uniformly: repeat branches to weight them
value_st = st.one_of(
    zero_st,
    special_st,
    special_st,
    denormal_st,
    tiny_st,
    ordinary_st,
    ordinary_st,
    ordinary_st,
    huge_st,
)
scale_st = st.one_of(st.just(1.0), st.just(1.0), value_st, ordinary_st)
negative_st = st.one_of(
    st.sampled_from([-1.0, -3.5, -INF, -_FLT_MAX, -_f32(1e-45), -448.0]),
    ordinary_st.map(lambda x: -x),
)
# ~10% large margins; the selector shrinks towards the small ones
margin_st = st.integers(0, 9).flatmap(
    lambda sel: st.sampled_from([20, 127]) if sel == 9 else st.integers(0, 5)
)
fp8_max_st = st.sampled_from(FP8_MAXES)
algo_st = st.sampled_from(ALGOS)
small_L_st = st.one_of(
    st.sampled_from([1, 2, 3, 16]), st.sampled_from([1, 2, 3, 16]), st.integers(1, 24)
)
large_L_st = st.sampled_from([1000, 1023, 1024, 1025, 1100])
n_st = st.integers(1, 8)

# pool for numpy-generated large histories (too many elements to draw one by one)
_POOL = np.array(SPECIALS, dtype=F32)


def _np_values(
    rng: np.random.Generator, shape, zero_frac: float, special_frac: float
) -> np.ndarray:
    size = int(np.prod(shape))
    out = np.empty(size, F32)
    u = rng.random(size)
    cat = np.select(
        [u < zero_frac, u < zero_frac + special_frac],
        [0, 1],
        default=2 + rng.integers(0, 4, size),
    )
    out[cat == 0] = 0.0
    m = cat == 1
    out[m] = rng.choice(_POOL, int(m.sum()))
    m = cat == 2  # ordinary, log-uniform 1e-8..1e8
    out[m] = (10.0 ** rng.uniform(-8, 8, int(m.sum()))).astype(F32)
    m = cat == 3
    out[m] = (10.0 ** rng.uniform(-8, 8, int(m.sum()))).astype(F32)
    m = cat == 4  # huge
    out[m] = (10.0 ** rng.uniform(30, 38.53, int(m.sum()))).astype(F32)  # <= FLT_MAX
    m = cat == 5  # denormal bit patterns
    out[m] = rng.integers(1, 0x00800000, int(m.sum())).astype(np.int32).view(F32)
    return out.reshape(shape)


@st.composite
def update_cases(draw, allow_negative: bool = False):
    n = draw(n_st)
    large = draw(st.integers(0, 9)) == 9  # ~10% of cases use a 1024-ish history (shrinks to small)
    vals = st.one_of(value_st, negative_st) if allow_negative else value_st
    if large:
        L = draw(large_L_st)
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        history = _np_values(
            rng, (L, n), zero_frac=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])), special_frac=0.05
        )
        if allow_negative:
            neg = rng.random((L, n)) < 0.1
            history[neg] = -history[neg]
        # the last few rows and row 0 from hypothesis, so they shrink and print nicely
        k = min(L, 3)
        tail = draw(st.lists(st.lists(vals, min_size=n, max_size=n), min_size=k, max_size=k))
        history[L - k :] = np.array(tail, F32)
        history[0] = np.array(draw(st.lists(vals, min_size=n, max_size=n)), F32)
    else:
        L = draw(small_L_st)
        history = np.array(
            draw(st.lists(st.lists(vals, min_size=n, max_size=n), min_size=L, max_size=L)), F32
        )
    scale = np.array(draw(st.lists(scale_st, min_size=n, max_size=n)), F32)
    amax = np.array(draw(st.lists(vals, min_size=n, max_size=n)), F32)
    # sometimes mimic TE exactly: the reduced amax is (a max over ranks of) row 0
    if draw(st.integers(0, 3)) == 0:
        history[0] = amax
    return {
        "history": history,
        "scale": scale,
        "amax": amax,
        "fp8_max": draw(fp8_max_st),
        "margin": draw(margin_st),
        "algo": draw(algo_st),
    }


_COMMON = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

# ----------------------------------------------------------------- property tests


@settings(max_examples=examples(1200), **_COMMON)
@given(case=update_cases())
def test_single_update_matches_reference(case):
    note(
        _describe(
            case["history"],
            case["scale"],
            case["amax"],
            case["fp8_max"],
            case["margin"],
            case["algo"],
        )
    )
    check_case(**case)


@settings(max_examples=examples(300), **_COMMON)
@given(case=update_cases(allow_negative=True))
def test_single_update_matches_reference_with_negative_values(case):
    """Negative amaxes never come out of a cast (fabsf), but the pseudocode is total:
    fmaxf from 0.0 ignores them, and a negative ``most_recent`` amax keeps the scale."""
    note(
        _describe(
            case["history"],
            case["scale"],
            case["amax"],
            case["fp8_max"],
            case["margin"],
            case["algo"],
        )
    )
    check_case(**case)


@settings(max_examples=examples(80), **_COMMON)
@given(
    L=st.one_of(st.sampled_from([1, 2, 3, 4, 16]), st.sampled_from([1, 2, 3, 4, 16, 1024])),
    n=n_st,
    fp8_max=fp8_max_st,
    margin=margin_st,
    algo=algo_st,
    seed=st.integers(0, 2**32 - 1),
    regime=st.sampled_from(["realistic", "sparse", "wild"]),
    fresh_state=st.booleans(),
)
def test_sequence_of_50_updates_stays_identical(
    L, n, fp8_max, margin, algo, seed, regime, fresh_state
):
    rng = np.random.default_rng(seed)
    zero_frac, special_frac = {"realistic": (0.05, 0.0), "sparse": (0.6, 0.02), "wild": (0.2, 0.3)}[
        regime
    ]
    if fresh_state:  # TE's initial state: zeros / ones
        history = np.zeros((L, n), F32)
        scale = np.ones(n, F32)
    else:
        history = _np_values(rng, (L, n), zero_frac=0.5, special_frac=special_frac)
        scale = _np_values(rng, (n,), zero_frac=0.0, special_frac=special_frac)
    h_t = torch.from_numpy(history.copy())
    s_t = torch.from_numpy(scale.copy())
    for step in range(50):
        amax = _np_values(rng, (n,), zero_frac=zero_frac, special_frac=special_frac)
        row0_mode = rng.integers(0, 3)
        if row0_mode == 0:  # TE: the casts accumulated into row 0, reduced = row 0
            history[0] = amax
            h_t[0] = torch.from_numpy(amax.copy())
        ctx = f"step {step}\n" + _describe(history, scale, amax, fp8_max, margin, algo)
        h_t, s_t = update_delayed_scaling(
            h_t, s_t, torch.from_numpy(amax.copy()), fp8_max=fp8_max, margin=margin, algo=algo
        )
        history, scale = reference_update(history, scale, amax, fp8_max, margin, algo)
        assert_bitwise_equal(_to_np(s_t), scale, f"new_scale (step {step})", ctx)
        assert_bitwise_equal(_to_np(h_t), history, f"new_history (step {step})", ctx)


@settings(max_examples=examples(100), **_COMMON)
@given(case=update_cases(allow_negative=True))
def test_inputs_are_not_modified(case):
    h_t = torch.from_numpy(case["history"].copy())
    s_t = torch.from_numpy(case["scale"].copy())
    a_t = torch.from_numpy(case["amax"].copy())
    h0, s0, a0 = h_t.clone(), s_t.clone(), a_t.clone()
    update_delayed_scaling(
        h_t, s_t, a_t, fp8_max=case["fp8_max"], margin=case["margin"], algo=case["algo"]
    )
    # strict: exact bits, NaN payloads included
    assert torch.equal(h_t.view(torch.int32), h0.view(torch.int32)), "amax_history was modified"
    assert torch.equal(s_t.view(torch.int32), s0.view(torch.int32)), "scale was modified"
    assert torch.equal(a_t.view(torch.int32), a0.view(torch.int32)), "amax was modified"
    # the reference must not modify its inputs either
    h_np, s_np, a_np = case["history"].copy(), case["scale"].copy(), case["amax"].copy()
    reference_update(h_np, s_np, a_np, case["fp8_max"], case["margin"], case["algo"])
    assert (_bits(h_np) == _bits(case["history"])).all()
    assert (_bits(s_np) == _bits(case["scale"])).all()
    assert (_bits(a_np) == _bits(case["amax"])).all()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(
    "amax_vals",
    [
        [0.0, 0.0, 0.0],  # nothing rolls, no scale changes: the tempting case to return inputs
        [3.5, 0.0, NAN],
        [1.0, 2.0, 4.0],
    ],
)
def test_outputs_do_not_alias_inputs(algo, amax_vals):
    h_t = torch.zeros(4, 3)
    s_t = torch.ones(3)
    a_t = torch.tensor(amax_vals, dtype=torch.float32)
    new_h, new_s = update_delayed_scaling(h_t, s_t, a_t, fp8_max=448.0, margin=0, algo=algo)
    inputs = (h_t, s_t, a_t)
    for out in (new_h, new_s):
        for inp in inputs:
            assert _storage_ptr(out) != _storage_ptr(inp), "output shares storage with an input"
    # behavioural check too: scribbling on the outputs must not touch the inputs
    h0, s0, a0 = h_t.clone(), s_t.clone(), a_t.clone()
    new_h.fill_(123.0)
    new_s.fill_(-7.0)
    assert torch.equal(h_t, h0) and torch.equal(s_t, s0)
    assert torch.equal(a_t.view(torch.int32), a0.view(torch.int32))


# ------------------------------------------------------------ hand-computed cases


def _call(history, scale, amax, *, fp8_max=448.0, margin=0, algo="max"):
    h = torch.tensor(history, dtype=torch.float32)
    if h.ndim == 1:
        h = h.reshape(-1, 1)
    s = torch.tensor(scale, dtype=torch.float32).reshape(-1)
    a = torch.tensor(amax, dtype=torch.float32).reshape(-1)
    new_h, new_s = update_delayed_scaling(h, s, a, fp8_max=fp8_max, margin=margin, algo=algo)
    ref_h, ref_s = reference_update(_to_np(h), _to_np(s), _to_np(a), fp8_max, margin, algo)
    return _to_np(new_h), _to_np(new_s), ref_h, ref_s


def _bits_of(values) -> np.ndarray:
    return _bits(np.asarray(values, dtype=F32))


def _assert_exact(got, expected, what):
    assert_bitwise_equal(np.asarray(got), np.asarray(expected, dtype=F32), what)


def test_reference_division_is_ieee_float32():
    # spec 2.6: IEEE div gives 902752640; reciprocal*448 would give 902752576
    q = F32(448.0) / F32(4.9626e-07)
    assert q.dtype == F32 and float(q) == 902752640.0
    # ...whereas reciprocal-then-multiply (two roundings) lands 1 ulp lower
    assert float(F32(448.0) * (F32(1.0) / F32(4.9626e-07))) == 902752576.0


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("L", [1, 2, 1024])
def test_division_rounding_case_902752640(algo, L):
    _, s, _, rs = _call(np.zeros((L, 1)), [1.0], [4.9626e-07], algo=algo)
    _assert_exact(rs, [902752640.0], "reference scale")
    _assert_exact(s, [902752640.0], "scale")
    assert float(s[0]) != 902752576.0


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("L", [1, 2, 3, 1024])
def test_first_step(algo, L):
    # spec 2.5: zero history, scale 1, amax 3.5 -> scale 448/3.5 = 128, hist[-1] = 3.5
    # slot 1 never saw a non-zero amax: stays scale 1 with a zero history
    h, s, rh, rs = _call(np.zeros((L, 2)), [1.0, 1.0], [3.5, 0.0], algo=algo)
    expected_h = np.zeros((L, 2), F32)
    if L > 1:
        expected_h[-1, 0] = 3.5
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [128.0, 1.0], f"{who} scale")
        _assert_exact(got_h, expected_h, f"{who} history")


@pytest.mark.parametrize("reduced", [0.0, -0.0])
def test_nan_in_history_with_zero_reduced(reduced):
    # reduced == 0 -> last = history[0] = NaN; NaN != 0 -> roll.
    # window = [1, 2, NaN] -> fmaxf ignores NaN -> amax 2 -> scale 224 (spec 2.6 example)
    # history -> [0] ++ history[2:3] ++ [last] = [0, 2, NaN]
    h, s, rh, rs = _call([NAN, 1.0, 2.0], [1.0], [reduced], algo="max")
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [224.0], f"{who} scale")
        _assert_exact(got_h, [[0.0], [2.0], [NAN]], f"{who} history")
    # most_recent: amax = last = NaN -> not finite -> old scale kept, same roll
    h, s, rh, rs = _call([NAN, 1.0, 2.0], [5.0], [reduced], algo="most_recent")
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [5.0], f"{who} scale")
        _assert_exact(got_h, [[0.0], [2.0], [NAN]], f"{who} history")


@pytest.mark.parametrize("algo", ALGOS)
def test_nan_reduced_amax_rolls_and_keeps_history_nan(algo):
    # r = NaN != 0 -> last = NaN; window [3, 7, NaN] -> 7; history [0, 7, NaN]
    h, s, rh, rs = _call([1.0, 3.0, 7.0], [2.0], [NAN], algo=algo)
    exp_s = [64.0] if algo == "max" else [2.0]
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, exp_s, f"{who} scale")
        _assert_exact(got_h, [[0.0], [7.0], [NAN]], f"{who} history")


@pytest.mark.parametrize("algo", ALGOS)
def test_zero_amax_no_roll_bits_preserved(algo):
    # reduced == 0 and history[0] == -0.0 -> last == 0 -> no roll, nothing changes (not even -0.0)
    hist = [[-0.0], [5.0], [NAN], [7.0]]
    h, s, rh, rs = _call(hist, [3.0], [0.0], algo=algo)
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [3.0], f"{who} scale")
        _assert_exact(got_h, hist, f"{who} history")
        assert np.signbit(got_h[0, 0]), f"{who}: -0.0 in row 0 was not preserved"


@pytest.mark.parametrize("algo", ALGOS)
def test_zero_reduced_uses_row0(algo):
    # reduced 0 but row 0 holds 2 -> last = 2; window [1, 8, 2] -> 8 (max) / 2 (most_recent)
    h, s, rh, rs = _call([2.0, 1.0, 8.0], [1.0], [0.0], algo=algo)
    exp_s = [56.0] if algo == "max" else [224.0]
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, exp_s, f"{who} scale")
        _assert_exact(got_h, [[0.0], [8.0], [2.0]], f"{who} history")


def test_reduced_overrides_row0_when_nonzero():
    # r != 0 -> last = r even if row 0 holds something larger
    h, s, rh, rs = _call([100.0, 1.0, 2.0], [1.0], [4.0], algo="max")
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [112.0], f"{who} scale")
        _assert_exact(got_h, [[0.0], [2.0], [4.0]], f"{who} history")


@pytest.mark.parametrize("fp8_max", FP8_MAXES)
def test_denormal_amax_gives_flt_max(fp8_max):
    h, s, rh, rs = _call([0.0, 0.0], [1.0], [1e-45], fp8_max=fp8_max)
    for got_h, got_s, who in ((h, s, "project"), (rh, rs, "reference")):
        _assert_exact(got_s, [float(FLT_MAX)], f"{who} scale")
        _assert_exact(got_h, [[0.0], [1e-45]], f"{who} history")


def test_inf_old_scale_is_clamped_even_without_update():
    # amax 0 -> keep old scale = +inf -> isinf -> FLT_MAX
    _, s, _, rs = _call([0.0, 0.0], [INF], [0.0])
    for got_s, who in ((s, "project"), (rs, "reference")):
        _assert_exact(got_s, [float(FLT_MAX)], f"{who} scale")


def test_margin_and_e5m2():
    # 57344 * 2**-3 / 7 = 1024
    _, s, _, rs = _call([0.0, 0.0], [1.0], [7.0], fp8_max=57344.0, margin=3)
    for got_s, who in ((s, "project"), (rs, "reference")):
        _assert_exact(got_s, [1024.0], f"{who} scale")


@pytest.mark.parametrize("L", [1, 3, 5])
def test_inf_amax_freezes_scale_until_it_ages_out(L):
    # spec 2.6: with "max" the scale is frozen until the inf leaves the window (L updates);
    # with "most_recent" it is frozen for one update only
    for algo in ALGOS:
        h_t = torch.zeros(L, 1)
        s_t = torch.tensor([2.0])
        h_r, s_r = np.zeros((L, 1), F32), np.array([2.0], F32)
        scales = []
        for step, a in enumerate([INF] + [1.0] * (L + 1)):
            a_t = torch.tensor([a], dtype=torch.float32)
            h_t, s_t = update_delayed_scaling(h_t, s_t, a_t, fp8_max=448.0, margin=0, algo=algo)
            h_r, s_r = reference_update(h_r, s_r, _to_np(a_t), 448.0, 0, algo)
            assert_bitwise_equal(_to_np(s_t), s_r, f"scale ({algo}, step {step})")
            assert_bitwise_equal(_to_np(h_t), h_r, f"history ({algo}, step {step})")
            scales.append(float(s_r[0]))
        frozen = L if algo == "max" else 1
        assert scales[:frozen] == [2.0] * frozen, (algo, scales)
        assert scales[frozen] == 448.0, (algo, scales)
