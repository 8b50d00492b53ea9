"""The delayed-scaling update on the cases of the TE reference (§2.5-§2.6), by hand,
plus invariants checked with hypothesis. tests/test_update_vs_reference.py compares it with an
independent scalar implementation on random inputs."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.test_tier import examples

from fp8ops.precision.formats import E4M3, Fp8Format
from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.scaling import FLT_MAX, parse_amax_algo, update_delayed_scaling
from fp8ops.precision.state import Fp8Meta, ScalingState, carry_scales, scale_factor

INF, NAN = math.inf, math.nan


def update(history, scale, amax, *, fp8_max=448.0, margin=0, algo="max"):
    return update_delayed_scaling(
        torch.tensor(history, dtype=torch.float32).reshape(len(history), -1),
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(amax, dtype=torch.float32),
        fp8_max=fp8_max,
        margin=margin,
        algo=algo,
    )


def f32(x):
    return float(np.float32(x))


# ---- the listed cases ------------------------------------------------------------------


def test_first_step_scale_is_448_over_amax():
    history, scale = update([[0.0]] * 4, [1.0], [3.5])
    assert scale.item() == 128.0
    assert history[:, 0].tolist() == [0.0, 0.0, 0.0, 3.5]


def test_zero_amax_neither_rolls_nor_rescales():
    old = [[0.0, 0.0], [1.0, 5.0], [2.0, 6.0]]
    history, scale = update(old, [7.0, 9.0], [0.0, 3.0])
    assert history[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert scale[0].item() == 7.0
    # the other slot did run: rolled, window max over [5, 6, 3]
    assert history[:, 1].tolist() == [0.0, 6.0, 3.0]
    assert scale[1].item() == f32(np.float32(448) / np.float32(6.0))


def test_nan_in_window_is_ignored_by_the_max():
    # history [NaN, 1, 2] as window values (rows 1..L-1) plus a current amax of 1.
    history, scale = update([[0.0], [NAN], [1.0], [2.0]], [1.0], [1.0])
    assert scale.item() == 224.0  # 448 / 2: the NaN is skipped
    assert history[1:, 0].tolist() == [1.0, 2.0, 1.0]


def test_nan_current_amax_keeps_scale_under_most_recent():
    history, scale = update([[0.0], [4.0]], [3.0], [NAN], algo="most_recent")
    assert scale.item() == 3.0
    assert math.isnan(history[1, 0])


@pytest.mark.parametrize("length", [1, 3, 16])
def test_inf_freezes_scale_for_L_updates_under_max(length):
    # The inf sits in the window for the update it arrives in and the L - 1 after it.
    history, scale = torch.zeros(length, 1), torch.tensor([5.0])
    scales = []
    for a in [INF] + [2.0] * (length + 2):
        history, scale = update_delayed_scaling(
            history, scale, torch.tensor([a]), fp8_max=448.0, margin=0, algo="max"
        )
        scales.append(scale.item())
    assert scales == [5.0] * length + [224.0] * 3


def test_inf_freezes_scale_for_one_update_under_most_recent():
    history, scale = update([[0.0]] * 8, [5.0], [INF], algo="most_recent")
    assert scale.item() == 5.0
    _, scale = update_delayed_scaling(
        history, scale, torch.tensor([2.0]), fp8_max=448.0, margin=0, algo="most_recent"
    )
    assert scale.item() == 224.0


@pytest.mark.parametrize("amax", [1e-45, 1e-40, 1.1754942e-38 / 4])
def test_denormal_amax_gives_flt_max(amax):
    _, scale = update([[0.0], [0.0]], [1.0], [amax])
    assert scale.item() == FLT_MAX


def test_tiny_normal_amax_is_one_ieee_division():
    # PyTorch's `448 / tensor` is reciprocal-then-multiply and gives 902752576 here.
    _, scale = update([[0.0]], [1.0], [4.9626e-07])
    assert scale.item() == 902752640.0


@pytest.mark.parametrize("margin, expected", [(0, 128.0), (1, 64.0), (3, 16.0)])
def test_margin_divides_by_a_power_of_two(margin, expected):
    _, scale = update([[0.0]] * 2, [1.0], [3.5], margin=margin)
    assert scale.item() == expected


def test_e5m2_max_for_gradients():
    _, scale = update([[0.0]] * 2, [1.0], [7.0], fp8_max=57344.0)
    assert scale.item() == 8192.0


def test_history_length_one():
    history, scale = update([[0.0]], [1.0], [2.0])
    assert history.tolist() == [[0.0]] and scale.item() == 224.0
    history, scale = update_delayed_scaling(
        history, scale, torch.tensor([7.0]), fp8_max=448.0, margin=0, algo="max"
    )
    assert scale.item() == 64.0  # no memory of the earlier 2.0 with L = 1


def test_history_length_1024_keeps_the_window_max_for_1023_updates():
    history, scale = torch.zeros(1024, 1), torch.ones(1)
    amaxes = [8.0] + [1.0] * 1100
    scales = []
    for a in amaxes:
        history, scale = update_delayed_scaling(
            history, scale, torch.tensor([a]), fp8_max=448.0, margin=0, algo="max"
        )
        scales.append(scale.item())
    assert scales[0] == 56.0 and scales[1023] == 56.0  # 8.0 still inside the window
    assert scales[1024] == 448.0  # ... and gone after L updates
    assert history[-1, 0] == 1.0 and history[0, 0] == 0.0


def test_reduced_amax_zero_falls_back_to_local_row_zero():
    # last = reduced if reduced != 0 else amax_history[0]
    history, scale = update([[2.0], [0.0]], [1.0], [0.0])
    assert scale.item() == 224.0
    assert history[:, 0].tolist() == [0.0, 2.0]


def test_inputs_are_not_modified():
    history = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    scale, amax = torch.tensor([1.0, 2.0]), torch.tensor([4.0, 0.0])
    copies = history.clone(), scale.clone(), amax.clone()
    new_history, new_scale = update_delayed_scaling(
        history, scale, amax, fp8_max=448.0, margin=0, algo="max"
    )
    for original, copy in zip((history, scale, amax), copies):
        assert torch.equal(original, copy)
    assert new_history.data_ptr() != history.data_ptr()
    assert new_scale.data_ptr() != scale.data_ptr()


def test_shape_and_dtype_errors():
    with pytest.raises(TypeError, match="float32"):
        update_delayed_scaling(
            torch.zeros(2, 1, dtype=torch.float64),
            torch.ones(1),
            torch.ones(1),
            fp8_max=448.0,
            margin=0,
            algo="max",
        )
    with pytest.raises(ValueError, match="scale and amax must be"):
        update_delayed_scaling(
            torch.zeros(2, 3), torch.ones(2), torch.ones(3), fp8_max=448.0, margin=0, algo="max"
        )


# ---- window statistics on TE's callable path ----------------------------------------


def test_callable_path_always_rolls_even_for_zero_amax():
    history, scale = update([[0.0], [5.0], [6.0]], [2.0], [0.0], algo="quantile:1.0")
    assert history[:, 0].tolist() == [0.0, 6.0, 0.0]  # rolled: 5 aged out
    assert scale.item() == (448.0 / torch.tensor([6.0])).item()


def test_callable_path_uses_te_two_step_division():
    # TE's _default_sf_compute: (fp8_max / amax) / 2**margin, evaluated by torch.
    amax = torch.tensor([4.9626e-07])
    expected = (448.0 / amax) / 1.0
    _, scale = update([[0.0]], [1.0], [4.9626e-07], algo="quantile:1.0")
    assert scale.item() == expected.item() == 902752576.0


def test_trimmed_max_drops_the_k_largest():
    history = [[0.0], [100.0], [3.0], [2.0], [1.0]]
    _, scale = update(history, [1.0], [4.0], algo="trimmed_max:1")
    assert scale.item() == 112.0  # 448 / 4: the outlier 100 is dropped
    _, scale = update(history, [1.0], [4.0], algo="trimmed_max:2")
    assert scale.item() == (448.0 / torch.tensor([3.0])).item()


@settings(max_examples=examples(300), deadline=None)
@given(
    length=st.integers(1, 300),
    columns=st.integers(1, 5),
    q=st.one_of(st.floats(1e-6, 1.0), st.sampled_from([0.5, 0.9, 0.99, 0.999, 1.0, 1 / 3])),
    k=st.integers(1, 400),
    seed=st.integers(0, 2**31),
)
def test_window_statistics_are_torchs_quantile_and_the_trimmed_max(length, columns, q, k, seed):
    """The order statistic the update selects (a top-k, or kthvalue) is exactly torch.quantile's
    "higher" value and the (k+1)-th largest, whatever the window: ties, zeros, NaN (as 0) and
    inf included, every length on both sides of the top-k threshold."""
    from fp8ops.precision.scaling import window_amax

    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 6, (length, columns), generator=g).float()  # ties
    history *= torch.exp2(torch.randint(-30, 30, (length, columns), generator=g).float())
    special = torch.rand(length, columns, generator=g)
    history[special < 0.05] = math.inf
    history[(special >= 0.05) & (special < 0.1)] = NAN
    clean = history.nan_to_num(nan=0.0, posinf=math.inf)
    expected = torch.quantile(clean, q, dim=0, interpolation="higher")
    got = window_amax(parse_amax_algo(f"quantile:{q!r}"), history)
    assert torch.equal(got, expected), (got, expected)
    largest = clean.sort(dim=0, descending=True).values[min(k, length - 1)]
    assert torch.equal(window_amax(parse_amax_algo(f"trimmed_max:{k}"), history), largest)


def test_quantile_ignores_nan_as_zero():
    _, scale = update([[0.0], [NAN], [8.0], [8.0]], [1.0], [8.0], algo="quantile:0.5")
    assert scale.item() == 56.0


@pytest.mark.parametrize(
    "name, message",
    [
        ("mean", "unknown amax_compute_algo"),
        ("quantile:0", "quantile must be in"),
        ("quantile:1.5", "quantile must be in"),
        ("trimmed_max:0", "K >= 1"),
        ("trimmed_max:x", "unknown amax_compute_algo"),
        ("MAX", "unknown amax_compute_algo"),
    ],
)
def test_bad_algorithm_names(name, message):
    with pytest.raises(ValueError, match=message):
        parse_amax_algo(name)


# ---- invariants ----------------------------------------------------------------------

amax_values = st.one_of(
    st.just(0.0),
    st.just(INF),
    st.just(NAN),
    st.floats(min_value=1e-45, max_value=1e-37),
    st.floats(min_value=1e-8, max_value=1e8),
    st.floats(min_value=1e30, max_value=3.4e38),
)


@st.composite
def states(draw):
    length = draw(st.sampled_from([1, 2, 3, 16]))
    width = draw(st.integers(1, 6))
    values = st.lists(amax_values, min_size=width, max_size=width)
    history = torch.tensor([draw(values) for _ in range(length)], dtype=torch.float32)
    scale = torch.tensor(
        draw(st.lists(st.floats(1e-3, 1e6), min_size=width, max_size=width)), dtype=torch.float32
    )
    amax = torch.tensor(draw(values), dtype=torch.float32)
    return history, scale, amax


@settings(max_examples=examples(300), deadline=None)
@given(states(), st.sampled_from(["max", "most_recent"]), st.integers(0, 4))
def test_invariants_of_the_fused_update(state, algo, margin):
    history, scale, amax = state
    new_history, new_scale = update_delayed_scaling(
        history, scale, amax, fp8_max=448.0, margin=margin, algo=algo
    )
    last = torch.where(amax != 0, amax, history[0])
    for k in range(history.shape[1]):
        if last[k] == 0:  # untouched
            same = torch.allclose(new_history[:, k], history[:, k], rtol=0, atol=0, equal_nan=True)
            assert same
            assert new_scale[k] == scale[k]
            continue
        assert new_history[0, k] == 0
        if history.shape[0] > 1:  # the newest amax lands in the last row
            newest = new_history[-1, k]
            assert newest.isnan() if last[k].isnan() else newest == last[k]
        # the scale comes from the window max (NaN skipped) or the newest amax, else is kept
        window = torch.cat([history[1:, k], last[k : k + 1]])
        window = window[~window.isnan()]
        chosen = last[k].item() if algo == "most_recent" else max(window.tolist(), default=0.0)
        if math.isfinite(chosen) and chosen > 0:
            with np.errstate(over="ignore"):
                expected = np.float32(448.0 * 2.0**-margin) / np.float32(chosen)
            assert new_scale[k].item() == min(float(expected), FLT_MAX)
        else:
            assert new_scale[k] == scale[k]
    assert new_history.shape == history.shape and new_scale.dtype == torch.float32


def test_a_kept_infinite_scale_is_clamped_like_a_new_one():
    # The kernel's `isinf(scale) -> FLT_MAX` runs after it chose between new and old scale.
    _, scale = update([[0.0, 0.0], [0.0, 0.0]], [math.inf, -math.inf], [0.0, math.nan])
    assert scale.tolist() == [FLT_MAX, FLT_MAX]


# ---- carrying scales to a changed recipe (a resume with another format or margin) ---------


def _recipe(fmt: str, margin: int, algo: str = "max") -> DelayedScalingRecipe:
    return DelayedScalingRecipe(
        fp8_format=Fp8Format.parse(fmt),
        amax_history_len=4,
        amax_compute_algo=parse_amax_algo(algo),
        margin=margin,
    )


def test_scale_factors_are_the_ratio_of_the_scaled_maxima():
    hybrid, e4m3 = _recipe("hybrid", 0), _recipe("e4m3", 0)
    assert scale_factor(hybrid, e4m3, forward=False) == 2.0**-7  # 448 / 57344
    assert scale_factor(e4m3, hybrid, forward=False) == 2.0**7
    assert scale_factor(hybrid, e4m3, forward=True) == 1.0  # forward is E4M3 in both
    assert scale_factor(hybrid, _recipe("hybrid", 3), forward=True) == 2.0**-3
    assert scale_factor(_recipe("hybrid", 2), _recipe("e4m3", 0), forward=False) == 2.0**-5


def test_carrying_leaves_initial_scales_and_clamps_like_the_update():
    state = ScalingState(
        amax_history=torch.zeros(4, 3), fp8=E4M3, scale=torch.tensor([1.0, FLT_MAX, 3.0])
    )
    state.carry_scales(2.0**7)
    assert state.scale.tolist() == [1.0, FLT_MAX, 384.0]  # never set; inf -> FLT_MAX; exact
    state.carry_scales(2.0**-7)
    assert state.scale.tolist() == [1.0, f32(FLT_MAX / 128), 3.0]
    with pytest.raises(ValueError, match="power of two"):
        state.carry_scales(3.0)


def test_a_scale_an_update_set_to_exactly_one_is_carried():
    """amax 448 under E4M3 and margin 0 gives scale 1: set, so a margin of 1 makes it 0.5."""
    meta = Fp8Meta.fresh(_recipe("hybrid", 0))
    state = meta.forward
    state.amax_history[0] = torch.tensor([448.0, 3.0, 0.0])
    history, scale = update_delayed_scaling(
        state.amax_history, state.scale, state.amax_history[0], fp8_max=448.0, margin=0, algo="max"
    )
    state.amax_history.copy_(history)
    state.scale.copy_(scale)
    assert state.scale[0] == 1.0
    carry_scales([meta], _recipe("hybrid", 0), _recipe("hybrid", 1))
    assert state.scale.tolist() == [0.5, f32(448 / 3 / 2), 1.0]  # the output slot never ran


# Amaxes whose scale is exactly 1 under some recipe of the test: once rolled out of the history,
# the carry cannot tell such a scale from one no update set (ScalingState.carry_scales).
SCALE_ONE = {math.ldexp(top, -m) for top in (448.0, 57344.0) for m in range(5)}


@settings(max_examples=examples(60), deadline=None)
@given(
    amaxes=st.lists(
        st.lists(
            st.one_of(
                st.floats(1e-6, 1e6).filter(lambda x: x not in SCALE_ONE),
                st.sampled_from([0.0, NAN]),
            ),
            min_size=2,
            max_size=2,
        ),
        min_size=1,
        max_size=7,
    ),
    old=st.tuples(st.sampled_from(["hybrid", "e4m3"]), st.integers(0, 4)),
    new=st.tuples(st.sampled_from(["hybrid", "e4m3"]), st.integers(0, 4)),
    algo=st.sampled_from(["max", "most_recent", "quantile:0.9"]),
)
def test_carried_scales_are_the_new_recipes_bit_for_bit(amaxes, old, new, algo):
    """Updates under the old recipe, then the carry, give the scales the same updates give under
    the new recipe: the resumed first step casts with the new recipe's scales."""
    old, new = _recipe(*old, algo), _recipe(*new, algo)
    runs = {}
    for recipe in (old, new):
        meta = Fp8Meta.fresh(recipe)
        for amax, state in ((a, s) for a in amaxes for s in (meta.forward, meta.backward)):
            state.amax_history[0, :2] = torch.tensor(amax, dtype=torch.float32)  # output slot: 0
            history, scale = update_delayed_scaling(
                state.amax_history,
                state.scale,
                state.amax_history[0],
                algo=algo,
                fp8_max=state.fp8.max,
                margin=recipe.margin,
            )
            state.amax_history.copy_(history)
            state.scale.copy_(scale)
        runs[recipe] = meta
    carried, wanted = runs[old], runs[new]
    factors = carry_scales([carried], old, new)
    assert 1.0 not in factors.values()
    for forward in (True, False):
        got, expected = carried.direction(forward).scale, wanted.direction(forward).scale
        # Never-set slots included: the new recipe leaves them at 1, and so must the carry.
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (got, expected)
        assert torch.equal(
            carried.direction(forward).amax_history.nan_to_num(-1),
            wanted.direction(forward).amax_history.nan_to_num(-1),
        )
