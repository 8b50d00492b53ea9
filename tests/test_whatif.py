"""The what-if replay, vectorised over steps, against one TE-exact update call per step."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ops.console.whatif import Window, replay, replay_stepwise


def series(rng: np.random.Generator, steps: int, columns: int) -> np.ndarray:
    """amax series with what a run records: spans of many magnitudes, steps that did not run
    (NaN, 0), overflowing casts (inf), denormal and huge amaxes whose quotient overflows."""
    x = np.exp2(rng.uniform(-20, 20, (1, columns)) + rng.standard_normal((steps, columns)) * 4)
    x = x.astype(np.float32)
    roll = rng.random((steps, columns))
    x[roll < 0.05] = np.nan
    x[(roll >= 0.05) & (roll < 0.1)] = 0.0
    x[(roll >= 0.1) & (roll < 0.12)] = np.inf
    x[(roll >= 0.12) & (roll < 0.14)] = 1e-42
    x[(roll >= 0.14) & (roll < 0.15)] = 3e38
    return x


@pytest.mark.parametrize(
    "window",
    [
        Window(1, "max", 0),
        Window(2, "max", 0),
        Window(16, "max", 3),
        Window(1024, "max", 0),
        Window(7, "most_recent", 1),
        Window(5, "quantile:0.9", 0),
        Window(64, "trimmed_max:2", 2),
        Window(3, "max", 200),  # a margin that makes fp8_max * 2**-margin 0: no usable scale
    ],
    ids=str,
)
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_vectorised_replay_equals_the_update_step_by_step(window, fp8_max):
    rng = np.random.default_rng(window.history_len * 31 + window.margin)
    amax = series(rng, 1500, 3)
    r = replay(amax, window, fp8_max)
    expected = replay_stepwise(amax, window, fp8_max)
    assert r.scale.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    used = np.concatenate([np.ones((1, 3), np.float32), expected[:-1]])
    assert r.scale_used.view(np.uint32).tolist() == used.view(np.uint32).tolist()


def test_replay_of_a_run_that_never_cast_keeps_scale_one():
    r = replay(np.full((5, 2), np.nan, np.float32), Window(4, "max", 0), 448.0)
    assert (r.scale == 1).all() and (r.scale_used == 1).all()


def test_an_inf_keeps_the_old_scale_while_it_is_in_the_window():
    amax = np.array([2.0, np.inf, 4.0, 4.0, 4.0], np.float32)
    r = replay(amax, Window(2, "max", 0), 448.0)
    assert r.scale[:, 0].tolist() == [224.0, 224.0, 224.0, 112.0, 112.0]
