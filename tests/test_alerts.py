"""Observe / Degrade / Stop alerts: every rule firing and not firing on synthetic telemetry rows,
patience, once-until-cleared, BF16 modules, NaN localisation, proposals, the JSONL files and
``fp8ops alerts``.

Rows are built from the catalogue's column indices: a healthy FP8 module everywhere, then the
cells a test is about.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from support.example_manifests import LLAMA, MINIMAL, ROOT, TINY

from fp8ops.alerts import (
    Alert,
    AlertEngine,
    Proposal,
    read_alerts,
    select_alerts,
    write_alerts,
)
from fp8ops.alerts.records import merge_rank_alerts
from fp8ops.manifest import load_manifest, parse_manifest
from fp8ops.manifest.schema import Alerts
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES, SLOTS

MODULES = (
    "decoder.layers.0.self_attention.linear_qkv",
    "decoder.layers.0.mlp.linear_fc1",
    "decoder.layers.1.self_attention.linear_qkv",
    "decoder.layers.1.mlp.linear_fc1",
)
QKV0, FC1_0, QKV1, FC1_1 = range(4)
GOOD_STEP = {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-5, "skipped": 0.0}


def healthy_row(modules: int = len(MODULES)) -> np.ndarray:
    """Sane, fully measured telemetry: nothing any rule should notice."""
    row = np.full((modules, len(MODULE_METRIC_NAMES)), np.nan, np.float32)
    for slot in SLOTS:
        for metric, value in {
            "amax": 1.0,
            "scale": 448.0,
            "scale_inv": 1 / 448,
            "window_max": 1.0,
            "window_p50": 0.8,
            "window_p90": 0.95,
            "scale_change": 1.0,
            "saturation": 0.0,
            "underflow": 1e-4,
            "nan": 0.0,
            "inf": 0.0,
        }.items():
            row[:, COLUMN[f"{slot}.{metric}"]] = value
    for metric, value in {
        "input_norm": 10.0,
        "weight_norm": 5.0,
        "grad_norm": 1.0,
        "fp8_gemms": 3.0,
        "fallback_gemms": 0.0,
        "fp8_enabled": 1.0,
    }.items():
        row[:, COLUMN[metric]] = value
    return row


def row(cells: dict[tuple[int, str], float] | None = None) -> np.ndarray:
    out = healthy_row()
    for (module, metric), value in (cells or {}).items():
        out[module, COLUMN[metric]] = value
    return out


ALL_FP8 = (True,) * len(MODULES)


def engine(fp8=ALL_FP8, **alerts) -> AlertEngine:
    return AlertEngine(Alerts.model_validate(alerts), MODULES, fp8)


def feed(eng: AlertEngine, rows, steps=None, first: int = 1) -> dict[int, list[Alert]]:
    """Observe ``rows`` at consecutive steps; the steps that raised alerts, with them."""
    steps = steps or [GOOD_STEP] * len(rows)
    found = {}
    for step, (cells, values) in enumerate(zip(rows, steps, strict=True), first):
        alerts = eng.observe(step, cells, values)
        if alerts:
            found[step] = alerts
    return found


def only(found: dict[int, list[Alert]]) -> Alert:
    (alerts,) = found.values()
    (alert,) = alerts
    return alert


# -- threshold rules: saturation, underflow, scale jitter, sampled error ----------------------


def test_saturation_fires_after_patience_with_a_sentence_naming_everything():
    over = row({(FC1_0, "input.saturation"): 0.004})  # above degrade (1e-3), below stop (1e-2)
    found = feed(engine(), [row(), over, over, over, over])
    alert = only(found)
    assert (alert.step, alert.level, alert.rule) == (4, "degrade", "saturation")
    assert (alert.module, alert.metric) == (MODULES[FC1_0], "input.saturation")
    assert (alert.value, alert.threshold) == (0.004, 0.001)
    assert alert.message == (
        f"Step 4: {MODULES[FC1_0]} input.saturation was 0.004, above the degrade level 0.001 "
        "for 3 consecutive measured steps."
    )


def test_saturation_below_every_level_or_not_sustained_does_not_fire():
    low = row({(QKV0, "weight.saturation"): 5e-6})  # below observe (1e-4)
    assert feed(engine(), [low] * 10) == {}
    spike = row({(QKV0, "weight.saturation"): 0.5})
    assert feed(engine(), [spike, spike, row(), spike, spike, row()] * 2) == {}  # never 3 in a row


def test_patience_is_the_manifests():
    over = row({(QKV1, "grad_output.saturation"): 0.004})
    assert list(feed(engine(patience_steps=1), [over])) == [1]
    assert list(feed(engine(patience_steps=5), [over] * 5)) == [5]


def test_an_alert_fires_once_and_again_only_after_it_has_cleared():
    over = row({(QKV0, "input.saturation"): 0.004})
    under = row()
    eng = engine()
    found = feed(eng, [over] * 10 + [under, over, over, over] + [under] * 3 + [over] * 3)
    # Steps 1-10 over: fires at 3 only. One calm step (11) does not clear it (patience 3), so
    # 12-14 stay quiet; three calm steps (15-17) do, and 18-20 fire again at 20.
    assert list(found) == [3, 20]
    assert all(len(alerts) == 1 and alerts[0].level == "degrade" for alerts in found.values())


def test_several_levels_reached_at_once_report_only_the_highest_and_escalation_reports_each():
    way_over = row({(FC1_1, "input.saturation"): 0.05})  # above stop (1e-2)
    found = feed(engine(), [way_over] * 6)
    assert [(s, a.level) for s, alerts in found.items() for a in alerts] == [(3, "stop")]

    rising = [row({(FC1_1, "input.saturation"): v}) for v in [2e-4] * 3 + [4e-3] * 3 + [0.05] * 3]
    found = feed(engine(), rising)
    assert [(s, a.level) for s, alerts in found.items() for a in alerts] == [
        (3, "observe"),
        (6, "degrade"),
        (9, "stop"),
    ]


def test_each_slot_and_module_is_its_own_condition():
    cells = {(QKV0, "input.saturation"): 0.004, (FC1_1, "grad_output.saturation"): 0.004}
    alerts = feed(engine(), [row(cells)] * 3)[3]
    assert [(a.module, a.metric) for a in alerts] == [
        (MODULES[QKV0], "input.saturation"),
        (MODULES[FC1_1], "grad_output.saturation"),
    ]


def test_underflow_levels_and_stop_off_by_default():
    over = row({(QKV0, "weight.underflow"): 0.5})  # above degrade (0.05); stop is null
    alert = only(feed(engine(), [over] * 8))
    assert (alert.step, alert.level, alert.rule, alert.metric) == (
        3,
        "degrade",
        "underflow",
        "weight.underflow",
    )
    assert feed(engine(), [row({(QKV0, "weight.underflow"): 0.005})] * 8) == {}  # below observe
    stop_on = engine(underflow={"stop": 0.2})
    assert only(feed(stop_on, [over] * 3)).level == "stop"


def test_a_level_set_to_null_never_fires():
    over = row({(QKV0, "input.saturation"): 0.004})
    assert feed(engine(saturation={"observe": None, "degrade": None}), [over] * 5) == {}


def test_scale_jitter():
    jitter = row({(QKV1, "input.scale_change"): 5.0})  # above observe (4)
    alert = only(feed(engine(), [jitter] * 4))
    assert (alert.step, alert.level, alert.rule, alert.metric, alert.threshold) == (
        3,
        "observe",
        "scale_jitter",
        "input.scale_change",
        4.0,
    )
    assert alert.message.endswith("for 3 consecutive steps.")  # read every step, not sampled
    assert feed(engine(), [row({(QKV1, "input.scale_change"): 1.5})] * 6) == {}


def test_sampled_error_counts_patience_in_samples_and_ignores_unsampled_steps():
    sample = row({(FC1_0, "fp8_rel_error"): 0.12})  # above degrade (0.10)
    unsampled = row()  # fp8_rel_error NaN
    rows = [sample, unsampled, unsampled, sample, unsampled, unsampled, sample, unsampled]
    alert = only(feed(engine(), rows))
    assert (alert.step, alert.level, alert.rule, alert.metric, alert.value) == (
        7,
        "degrade",
        "fp8_error",
        "fp8_rel_error",
        0.12,
    )
    assert "for 3 consecutive samples" in alert.message
    assert feed(engine(), [sample, unsampled, sample, unsampled]) == {}  # two samples
    assert feed(engine(), [row({(FC1_0, "fp8_rel_error"): 0.03})] * 6) == {}  # below observe


def test_growing_error_degrades_and_flat_noisy_or_tiny_errors_do_not():
    def samples(values):
        return [row({(QKV1, "fp8_rel_error"): v}) for v in values]

    alert = only(feed(engine(), samples([0.045, 0.048, 0.052, 0.055, 0.057])))
    assert (alert.step, alert.level, alert.rule, alert.value, alert.threshold) == (
        4,
        "degrade",
        "fp8_error_growing",
        0.055,
        0.04,
    )
    assert "0.045 -> 0.048 -> 0.052 -> 0.055" in alert.message
    assert feed(engine(), samples([0.045, 0.05, 0.048, 0.052, 0.05, 0.055])) == {}  # not monotone
    assert feed(engine(), samples([0.01, 0.015, 0.02, 0.025, 0.03])) == {}  # under the floor
    assert feed(engine(), samples([0.045, 0.048, 0.052])) == {}  # too few samples
    # Unsampled steps in between do not break the sequence.
    spaced = [r for s in samples([0.045, 0.048, 0.052, 0.055]) for r in (s, row())]
    assert only(feed(engine(), spaced)).step == 7


# -- windows: gradient spikes, rising underflow ---------------------------------------------


def test_grad_spike_against_the_window_median():
    calm = [row({(FC1_0, "grad_norm"): g}) for g in (1.0, 1.2, 0.9, 1.1) * 3]
    spike = row({(FC1_0, "grad_norm"): 8.0})  # above 5x the median (1.05)
    eng = engine(window_steps=8)
    alert = only(feed(eng, calm + [spike] * 4))
    assert (alert.step, alert.level, alert.rule, alert.module, alert.metric) == (
        15,
        "degrade",
        "grad_spike",
        MODULES[FC1_0],
        "grad_norm",
    )
    # The window (steps 7-14) holds the two spiked steps already: median 1.1, not 1.05.
    assert alert.threshold == pytest.approx(5 * 1.1, rel=1e-6)
    assert "above 5x its median 1.1 over the last 8 measured steps" in alert.message
    assert feed(engine(window_steps=8), calm + [row({(FC1_0, "grad_norm"): 3.0})] * 4) == {}


def test_grad_spike_needs_half_a_window_of_history_and_skips_unmeasured_steps():
    spike = row({(FC1_0, "grad_norm"): 50.0})
    assert feed(engine(window_steps=8), [row()] * 3 + [spike] * 3) == {}  # 3 < 4 known steps
    unmeasured = row()
    unmeasured[:, COLUMN["grad_norm"]] = np.nan
    unmeasured[:, COLUMN["weight_norm"]] = np.nan
    # Unmeasured steps fill no window slot: four measured steps, then the spike, still fires.
    rows = [row(), unmeasured] * 4 + [spike, unmeasured] * 3
    assert only(feed(engine(window_steps=8), rows)).step == 13


def test_rising_underflow_observes_and_flat_or_negligible_underflow_does_not():
    def series(values):
        return [row({(QKV0, "input.underflow"): v}) for v in values]

    alert = only(feed(engine(window_steps=8), series([0.002] * 4 + [0.005] * 4 + [0.005] * 3)))
    assert (alert.step, alert.level, alert.rule, alert.metric) == (
        8,
        "observe",
        "underflow_rising",
        "input.underflow",
    )
    assert (alert.value, alert.threshold) == (0.005, 0.004)
    assert feed(engine(window_steps=8), series([0.004] * 16)) == {}  # flat
    assert feed(engine(window_steps=8), series([1e-5] * 4 + [1e-4] * 4)) == {}  # under the floor
    assert feed(engine(window_steps=8), series([0.002] * 3 + [0.005] * 4)) == {}  # window not full


# -- early warning: amax jump -----------------------------------------------------------------


def test_amax_jump_observes_at_once():
    jump = row({(QKV1, "input.amax"): 5.0, (QKV1, "input.window_max"): 5.0})
    alert = only(feed(engine(), [row(), row(), jump]))
    assert (alert.step, alert.level, alert.rule, alert.module, alert.metric) == (
        3,
        "observe",
        "amax_jump",
        MODULES[QKV1],
        "input.amax",
    )
    assert (alert.value, alert.threshold) == (5.0, 4.0)
    assert "above 4x the previous step's window max 1" in alert.message
    small = row({(QKV1, "input.amax"): 3.0, (QKV1, "input.window_max"): 3.0})
    assert feed(engine(), [row(), small]) == {}
    assert feed(engine(), [jump]) == {}  # no previous step
    # Under most_recent the scale comes from the last amax, not the window max: a jump from a
    # last amax well below the window's top is one the scale did not cover.
    most_recent = AlertEngine(Alerts(), MODULES, ALL_FP8, amax_compute_algo="most_recent")
    low = row({(QKV1, "input.amax"): 0.5, (QKV1, "input.window_max"): 3.0})
    rise = row({(QKV1, "input.amax"): 2.5, (QKV1, "input.window_max"): 3.0})
    assert feed(engine(), [low, rise]) == {}  # 2.5 < 4 x 3
    alert = only(feed(most_recent, [low, rise]))
    assert (alert.value, alert.threshold) == (2.5, 2.0)
    assert "above 4x the previous step's amax 0.5" in alert.message


def test_amax_jump_judges_only_modules_that_scale_from_a_history():
    """Under current, block or MXFP8 scaling a cast is scaled by its own amax: a jump cannot
    make it clip, so a stateless module (here QKV1, say one under a per-module recipe) is not
    judged; the delayed ones beside it are."""
    delayed = [True, True, False, True]
    eng = AlertEngine(Alerts(), MODULES, ALL_FP8, delayed=delayed)
    stateless = {(QKV1, "input.window_max"): np.nan, (QKV1, "input.scale_change"): np.nan}
    calm = row(stateless)
    jump = row({**stateless, (QKV1, "input.amax"): 50.0, (FC1_1, "input.amax"): 5.0})
    jump[FC1_1, COLUMN["input.window_max"]] = 5.0
    alert = only(feed(eng, [calm, jump]))
    assert (alert.rule, alert.module) == ("amax_jump", MODULES[FC1_1])
    with pytest.raises(ValueError, match="delayed has 2 entries for 4 modules"):
        AlertEngine(Alerts(), MODULES, ALL_FP8, delayed=[True, False])


# -- block recipes: blocks whose scale sat at its floor ------------------------------------------


def block_row(cells: dict[tuple[int, str], float] | None = None) -> np.ndarray:
    """A healthy module under block scaling: no window, a floor share of 0 measured."""
    out = row(cells)
    for slot in SLOTS:
        for metric in ("window_max", "window_p50", "window_p90", "scale_change", "scale"):
            out[:, COLUMN[f"{slot}.{metric}"]] = np.nan
        out[:, COLUMN[f"{slot}.blocks_at_floor"]] = 0.0
    for (module, metric), value in (cells or {}).items():
        out[module, COLUMN[metric]] = value
    return out


FLOOR = {"blocks_at_floor": {"observe": 1e-3, "degrade": 1e-2}}  # the suggested levels


def test_blocks_at_floor_degrades_after_patience_and_proposes_bf16():
    floored = block_row({(FC1_0, "grad_output.blocks_at_floor"): 0.02})  # past degrade (1e-2)
    assert feed(engine(), [floored] * 5) == {}  # off by default: runs before it stay as they ran
    eng = engine(**FLOOR)
    alert = only(feed(eng, [block_row(), floored, floored, floored]))
    assert (alert.step, alert.level, alert.rule) == (4, "degrade", "blocks_at_floor")
    assert (alert.metric, alert.value, alert.threshold) == (
        "grad_output.blocks_at_floor",
        0.02,
        0.01,
    )
    assert [p.module for p in eng.proposals([alert])] == [MODULES[FC1_0]]
    watch = block_row({(QKV0, "input.blocks_at_floor"): 0.002})  # observe only
    assert only(feed(engine(**FLOOR), [watch] * 3)).level == "observe"
    assert feed(engine(**FLOOR), [block_row({(QKV0, "input.blocks_at_floor"): 5e-4})] * 5) == {}
    # Under delayed scaling the metric is NaN (not measured): never judged.
    assert np.isnan(row()[QKV0, COLUMN["input.blocks_at_floor"]])
    assert feed(engine(patience_steps=1, **FLOOR), [row()] * 3) == {}
    off = engine(blocks_at_floor={"observe": None, "degrade": None})
    assert feed(off, [floored] * 5) == {}


def test_a_checkpoint_without_a_rules_windows_resumes_with_that_rule_fresh():
    """A checkpoint saved before a threshold rule existed holds none of its latches: the rule
    starts afresh and every other window continues (a partial state of any other rule is
    still refused)."""
    eng = engine(**FLOOR)
    saturated = row({(FC1_0, "input.saturation"): 0.004})
    feed(eng, [saturated] * 3)  # degrade open
    old = {k: v for k, v in eng.state_dict().items() if not k.startswith("blocks_at_floor.")}
    again = engine(**FLOOR)
    again.load_state_dict(old)
    assert again.fresh_rules == ["blocks_at_floor"]
    assert feed(again, [saturated] * 3, first=4) == {}  # still open: not fired again
    floored = block_row({(FC1_0, "input.blocks_at_floor"): 0.02})
    assert only(feed(again, [floored] * 3, first=7)).rule == "blocks_at_floor"
    broken = {k: v for k, v in old.items() if k != "saturation.degrade.open"}
    with pytest.raises(ValueError, match="saturation.degrade.open"):
        engine(**FLOOR).load_state_dict(broken)
    # A rule that existed all along, absent whole, is damage, not an older fp8ops.
    no_saturation = {k: v for k, v in old.items() if not k.startswith("saturation.")}
    with pytest.raises(ValueError, match="saturation"):
        engine(**FLOOR).load_state_dict(no_saturation)


# -- NaN / Inf -----------------------------------------------------------------------------------


def nan_from_module(first: int) -> np.ndarray:
    """A NaN that entered module ``first``'s input: it and every later module see it in forward;
    every module's gradients are NaN."""
    out = row()
    for i in range(first, len(MODULES)):
        out[i, COLUMN["input.nan"]] = 128
    out[:, COLUMN["grad_output.nan"]] = 64
    out[:, COLUMN["grad_norm"]] = np.nan
    return out


NAN_STEP = {"loss": math.nan, "grad_norm": math.nan}


def test_nan_stops_at_once_naming_the_module_where_it_entered():
    found = feed(engine(), [row()] * 4 + [nan_from_module(QKV1)], [GOOD_STEP] * 4 + [NAN_STEP])
    alert = only(found)
    assert (alert.step, alert.level, alert.rule) == (5, "stop", "nonfinite")
    assert (alert.module, alert.metric, alert.value, alert.threshold) == (
        MODULES[QKV1],
        "input.nan",
        128.0,
        0.0,
    )
    assert alert.message.startswith(
        f"Step 5: {MODULES[QKV1]} input.nan was 128, above 0: the first non-finite value of the "
        "step in forward order (4 of 4 modules affected; the step's loss is nan"
    )


def test_nan_in_the_backward_pass_names_the_first_module_the_backward_reached():
    out = row()
    out[[QKV0, FC1_0], COLUMN["grad_output.inf"]] = 3  # entered at QKV1's backward
    alert = only(feed(engine(), [out], [{"loss": 2.0, "grad_norm": math.inf}]))
    assert (alert.module, alert.metric) == (MODULES[FC1_0], "grad_output.inf")
    assert "in backward order" in alert.message


def test_infinite_module_grad_norm_and_infinite_scale_stop():
    alert = only(feed(engine(), [row({(FC1_1, "grad_norm"): math.inf})]))
    assert (alert.level, alert.module, alert.metric) == ("stop", MODULES[FC1_1], "grad_norm")
    alert = only(feed(engine(), [row({(QKV0, "weight.scale"): math.inf})]))
    assert (alert.level, alert.module, alert.metric, alert.threshold) == (
        "stop",
        MODULES[QKV0],
        "weight.scale",
        None,
    )


def test_unmeasured_module_grad_norms_are_not_nan():
    unmeasured = row()
    unmeasured[:, COLUMN["grad_norm"]] = np.nan  # every_steps > 1: not measured this step
    assert feed(engine(), [unmeasured] * 5) == {}
    # With a non-finite global norm, a measured module's NaN norm is the culprit.
    measured_nan = row({(FC1_0, "grad_norm"): math.nan})
    alert = only(feed(engine(), [measured_nan], [{"loss": 2.0, "grad_norm": math.nan}]))
    assert (alert.module, alert.metric) == (MODULES[FC1_0], "grad_norm")


def test_a_nonfinite_loss_without_module_evidence_is_a_run_level_stop():
    alert = only(feed(engine(), [row(), row()], [GOOD_STEP, {"loss": math.inf, "grad_norm": 1.0}]))
    assert (alert.step, alert.level, alert.module, alert.metric, alert.value) == (
        2,
        "stop",
        None,
        "loss",
        math.inf,
    )
    assert alert.message.startswith("Step 2: the run's loss was inf, not finite")


def unmeasured_casts(cells: dict[tuple[int, str], float] | None = None) -> np.ndarray:
    """A row of a step whose cast statistics were not measured (``telemetry.every_steps`` >
    1): NaN and Inf counts unknown, amaxes and scales recorded as on every step."""
    out = row(cells)
    for slot in SLOTS:
        out[:, COLUMN[f"{slot}.nan"]] = out[:, COLUMN[f"{slot}.inf"]] = np.nan
    return out


def test_a_nonfinite_loss_names_the_first_module_whose_amax_jumped():
    """Issue 49, 10: at lr 1e30 step 1 blew every weight up to 1e30 (finite); step 2's loss is
    NaN with no cast counting it (not a measuring step). The Stop names where the values left
    their range: the first module whose amax jumped against the step before."""
    blown = unmeasured_casts()
    blown[:, COLUMN["weight.amax"]] = 1e30
    blown[QKV0, COLUMN["input.amax"]] = np.nan  # a NaN amax is recorded as "not measured"
    (alert, *jumps) = feed(engine(), [unmeasured_casts(), blown], [GOOD_STEP, NAN_STEP])[2]
    assert (alert.step, alert.level, alert.rule) == (2, "stop", "nonfinite")
    assert {(a.level, a.rule) for a in jumps} == {("observe", "amax_jump")}  # one per module
    assert (alert.module, alert.metric, alert.value, alert.threshold) == (
        MODULES[QKV0],
        "weight.amax",
        1e30,
        4.0,  # amax_jump_factor x the step before's amax, 1
    )
    assert alert.message == (
        "Step 2: the run's loss was nan, not finite (the step's grad_norm is nan); no cast "
        f"counted it, but amaxes jumped first in {MODULES[QKV0]}: weight.amax 1 -> 1e+30 "
        "(1e+30x, above amax_jump_factor 4) since the step before, the first jump in module "
        "order (4 of 4 modules jumped; all at once, as when an optimizer step blows up the "
        "weights)."
    )
    # One module whose input jumped (a bad batch reaching it), the others calm: that one.
    spike = unmeasured_casts({(QKV1, "input.amax"): 64.0, (FC1_1, "input.amax"): 3.0})
    alert = feed(engine(), [unmeasured_casts(), spike], [GOOD_STEP, NAN_STEP])[2][0]
    assert (alert.module, alert.metric, alert.value) == (MODULES[QKV1], "input.amax", 64.0)
    assert "(1 of 4 modules jumped)." in alert.message
    # The amax a jump is measured against is carried across a resume (a checkpoint).
    eng = engine()
    feed(eng, [unmeasured_casts()])
    alert = feed(resumed(eng), [blown], [NAN_STEP], first=2)[2][0]
    assert (alert.module, alert.metric) == (MODULES[QKV0], "weight.amax")
    # A checkpoint saved before it was kept resumes without it: nothing to compare with yet.
    older = {k: v for k, v in eng.state_dict().items() if k != "previous_amax"}
    again = engine()
    again.load_state_dict(older)
    alert = feed(again, [blown], [NAN_STEP], first=2)[2][0]
    assert alert.module is None and "no module's telemetry shows where it started" in alert.message


def test_an_update_orders_of_magnitude_above_the_weights_stops_at_once():
    """Issue 49, 10: step 1 at lr 1e30 moved weights of norm 20 by 9.1e32 and nothing fired;
    the next step's NaN was the first alert. The update's size against the weights it changed
    is a Stop before the next step trains on them."""
    healthy = {**GOOD_STEP, "update_norm": 1.2, "weight_norm": 20.0}
    blown = {**GOOD_STEP, "update_norm": 9.1e32, "weight_norm": 20.0}
    found = feed(engine(), [row()] * 3, [healthy, blown, blown])
    assert sorted(found) == [2, 3]  # each step it holds: a blown-up update is never routine
    alert = found[2][0]
    assert (alert.level, alert.rule, alert.module, alert.metric) == (
        "stop",
        "update_blowup",
        None,
        "update_norm",
    )
    assert (alert.value, alert.threshold) == (9.1e32, 2000.0)
    assert alert.message.startswith(
        "Step 2: the optimizer's update had norm 9.1e+32, 4.55e+31x the norm of the weights it "
        "changed (20), above update_blowup_factor 100: the step replaced the weights"
    )
    # At the factor, on a skipped step (no update), or with the rule off: nothing.
    at_factor = {**GOOD_STEP, "update_norm": 2000.0, "weight_norm": 20.0}
    skipped = {**GOOD_STEP, "update_norm": math.nan, "weight_norm": math.nan, "skipped": 1.0}
    assert feed(engine(), [row()] * 3, [at_factor, skipped, GOOD_STEP]) == {}
    assert feed(engine(update_blowup_factor=None), [row()], [blown]) == {}
    loose = engine(update_blowup_factor=1e33)  # the manifest's level
    assert feed(loose, [row()], [blown]) == {}
    assert only(feed(loose, [row()], [{**blown, "update_norm": 3e34}])).rule == "update_blowup"


def test_a_non_finite_update_from_finite_gradients_stops_at_once():
    """The update made the weights non-finite while the step's loss and gradients were finite:
    nothing fired until the next step's NaN, and at the last step never."""
    overflowed = {**GOOD_STEP, "update_norm": math.inf, "weight_norm": 20.0}
    alert = only(feed(engine(), [row()] * 2, [GOOD_STEP, overflowed]))
    assert (alert.step, alert.level, alert.rule, alert.module, alert.metric) == (
        2,
        "stop",
        "nonfinite",
        None,
        "update_norm",
    )
    assert alert.value == math.inf
    assert alert.message.startswith(
        "Step 2: the optimizer's update had norm inf, not finite, from finite gradients"
    )
    nan_update = {**GOOD_STEP, "update_norm": math.nan, "weight_norm": 20.0}
    assert only(feed(engine(), [row()], [nan_update])).metric == "update_norm"
    # A skipped step made no update (its norm is NaN): nothing; nor without an update measured.
    skipped = {**GOOD_STEP, "update_norm": math.nan, "weight_norm": math.nan, "skipped": 1.0}
    assert feed(engine(), [row()] * 2, [skipped, GOOD_STEP]) == {}
    # A non-finite loss is named first, as before.
    both = {**overflowed, "loss": math.nan}
    assert only(feed(engine(), [row()], [both])).metric == "loss"


def test_nonfinite_stop_off_reports_observe_once():
    found = feed(engine(nonfinite_stop=False), [nan_from_module(FC1_0)] * 3, [NAN_STEP] * 3)
    alert = only(found)
    assert (alert.step, alert.level, alert.module) == (1, "observe", MODULES[FC1_0])


def test_finite_steps_raise_nothing():
    assert feed(engine(), [row()] * 30) == {}


# -- divergence ---------------------------------------------------------------------------------


def losses(values):
    return [{"loss": v, "grad_norm": 1.0} for v in values]


def test_divergence_stops_after_patience_against_the_lowest_loss_after_warmup():
    # Compared: the mean of the last 3 (patience) losses. After the 2 warm-up steps the means
    # are 1.0 (the lowest), 1.67, 2.33, 3.0, 3.0: above 2 x 1.0 from the seventh step, for the
    # third time at the ninth.
    values = [9.0, 9.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    found = feed(engine(divergence_warmup_steps=2), [row()] * len(values), losses(values))
    alert = only(found)
    assert (alert.step, alert.level, alert.rule, alert.module, alert.metric) == (
        9,
        "stop",
        "divergence",
        None,
        "loss",
    )
    assert (alert.value, alert.threshold) == (3.0, 2.0)
    assert "above 2x its lowest 1" in alert.message


def test_divergence_is_not_fooled_by_one_easy_batch():
    # One batch at 0.4 among batches near 1.0: the lowest single loss would put the threshold
    # at 0.8, below every ordinary batch; the smoothed loss never drops that low.
    values = [1.0, 1.0, 1.0, 0.4, 1.0, 1.1, 1.0, 1.1, 1.0, 1.1]
    assert feed(engine(divergence_warmup_steps=2), [row()] * 10, losses(values)) == {}


def test_divergence_ignores_warmup_and_noise_below_the_factor():
    # The first two losses are warm-up: 0.5 there sets no baseline.
    values = [0.5, 0.5, 2.0, 1.8, 1.9, 3.0, 3.2, 1.9, 3.4]
    assert feed(engine(divergence_warmup_steps=2), [row()] * 9, losses(values)) == {}


# -- BF16 modules --------------------------------------------------------------------------------


def test_bf16_modules_are_skipped_by_the_fp8_rules():
    bf16 = (True, False, True, True)
    cells = {
        (FC1_0, "input.saturation"): 0.5,
        (FC1_0, "input.underflow"): 0.5,
        (FC1_0, "input.scale_change"): 2000.0,
        (FC1_0, "fp8_rel_error"): 0.9,
        (FC1_0, "input.amax"): 100.0,
        (FC1_0, "input.nan"): 7.0,
    }
    assert feed(engine(fp8=bf16), [row(cells)] * 6) == {}
    # ... but not by the gradient rules, which hold for any module.
    spike = row({(FC1_0, "grad_norm"): 50.0})
    alert = only(feed(engine(fp8=bf16, window_steps=6), [row()] * 4 + [spike] * 3))
    assert (alert.rule, alert.module) == ("grad_spike", MODULES[FC1_0])


def test_engine_checks_its_inputs():
    with pytest.raises(ValueError, match="fp8_enabled has 2 entries for 4 modules"):
        AlertEngine(Alerts(), MODULES, [True, True])
    with pytest.raises(ValueError, match=r"shape \(4, 3\); expected \(4, "):
        engine().observe(1, np.zeros((4, 3)), GOOD_STEP)


def test_report_makes_a_trainer_detected_alert():
    alert = engine().report(7, "ranks_disagree", "stop", "Step 7: scales differ across ranks.")
    assert alert == Alert(
        7, "stop", "ranks_disagree", None, None, None, None, "Step 7: scales differ across ranks."
    )
    with pytest.raises(ValueError, match="alert level 'fatal'"):
        engine().report(7, "x", "fatal", "m")


def test_alerts_of_one_step_come_stop_first():
    cells = {(QKV0, "input.saturation"): 0.004, (QKV1, "input.amax"): 9.0}
    rows = [row(), row({(QKV0, "input.saturation"): 0.004}), row(cells)]
    steps = [GOOD_STEP, GOOD_STEP, {"loss": math.nan, "grad_norm": 1.0}]
    alerts = feed(engine(patience_steps=2), rows, steps)[3]
    assert [(a.level, a.rule) for a in alerts] == [
        ("stop", "nonfinite"),
        ("degrade", "saturation"),
        ("observe", "amax_jump"),
    ]


# -- proposals -----------------------------------------------------------------------------------


def test_degrade_proposes_one_override_per_module():
    eng = engine()
    both = row({(FC1_0, "input.saturation"): 0.004, (FC1_0, "weight.underflow"): 0.06})
    alerts = feed(eng, [both] * 3)[3]
    assert len(alerts) == 2
    (proposal,) = eng.proposals(alerts)
    assert proposal == Proposal(
        3,
        MODULES[FC1_0],
        alerts[0].message,
        {"input.saturation": 0.004, "weight.underflow": 0.06},
        rule=alerts[0].rule,  # the rule an auto-degrade policy acts by
    )
    assert proposal.rule == "saturation"
    # Cleared and fired again: proposed again (the ledger, not the engine, refuses a second
    # open override for a module, and takes one after the first was rejected or revoked).
    again = feed(eng, [row()] * 3 + [both] * 3, first=4)
    assert [p.module for p in eng.proposals(again[9])] == [MODULES[FC1_0]]


def test_which_alerts_propose():
    eng = engine(fp8=(True, True, False, True))
    observe = eng.report(1, "scale_jitter", "observe", "m", module=MODULES[QKV0])
    nonfinite = eng.report(1, "nonfinite", "stop", "m", module=MODULES[QKV0], metric="input.nan")
    bf16 = eng.report(1, "grad_spike", "degrade", "m", module=MODULES[QKV1], metric="grad_norm")
    run_level = eng.report(1, "divergence", "stop", "m", metric="loss")
    assert eng.proposals([observe, nonfinite, bf16, run_level]) == []
    stop = eng.report(
        2, "saturation", "stop", "s", module=MODULES[FC1_1], metric="input.saturation"
    )
    assert [p.module for p in eng.proposals([stop])] == [MODULES[FC1_1]]
    # Gathered JSON records (with the trainer's rank) work as well.
    record = dict(stop.to_json(), module=MODULES[FC1_0], rank=1)
    assert [p.module for p in eng.proposals([record])] == [MODULES[FC1_0]]


def test_under_pipelining_every_stage_proposes_alike_for_another_stages_modules():
    # Two stages: this engine's modules, and the other stage's, one of them held in BF16.
    other = {"decoder.layers.9.mlp.linear_fc1": True, "decoder.layers.9.mlp.linear_fc2": False}
    eng = AlertEngine(Alerts(), list(MODULES), ALL_FP8, other_stages=other)
    fp8, bf16 = (
        eng.report(1, "grad_spike", "degrade", "m", module=name, metric="grad_norm")
        for name in other
    )
    assert [p.module for p in eng.proposals([fp8, bf16])] == ["decoder.layers.9.mlp.linear_fc1"]
    eng.hold(["decoder.layers.9.mlp.linear_fc1"])  # a switch that every rank makes
    assert eng.proposals([fp8]) == []


# -- resume ---------------------------------------------------------------------------------------


def resumed(eng: AlertEngine, fp8=ALL_FP8) -> AlertEngine:
    """A new engine with ``eng``'s checkpointed state, as a resume at the same world size."""
    again = engine(fp8)
    again.load_state_dict(eng.state_dict())
    return again


def test_a_resume_continues_open_alerts_but_a_stop_that_holds_on_stops_again():
    eng = engine()
    saturated = row({(FC1_0, "input.saturation"): 0.05})  # past observe, degrade and stop
    nan = row({(QKV0, "input.nan"): 3.0})
    assert [a.level for a in feed(eng, [saturated] * 3)[3]] == ["stop"]
    # The Stop's checkpoint holds its alerts open; resumed, the same saturation stops again
    # after its patience, and a NaN that holds on stops at once each time.
    again = resumed(eng)
    found = feed(again, [saturated] * 3, first=4)
    assert [(step, a.level, a.rule) for step, alerts in found.items() for a in alerts] == [
        (6, "stop", "saturation")
    ]
    assert only(feed(again, [nan], first=7)).rule == "nonfinite"
    assert only(feed(resumed(again), [nan], first=8)).rule == "nonfinite"
    # Below Stop, a resume continues the straight run: an open Observe does not fire again.
    eng = engine()
    hovering = row({(FC1_0, "input.saturation"): 5e-4})  # past observe only
    assert only(feed(eng, [hovering] * 3)).level == "observe"
    assert feed(resumed(eng), [hovering] * 5, first=4) == {}


def test_a_module_held_in_bf16_and_lifted_back_starts_its_alerts_afresh():
    eng = engine()
    saturated = row({(FC1_0, "input.saturation"): 5e-4})  # past observe: its alert stays open
    assert only(feed(eng, [saturated] * 3)).level == "observe"
    bf16 = tuple(i != FC1_0 for i in range(len(MODULES)))
    held = resumed(eng, bf16)  # an override runs it in BF16: its FP8 alerts are forgotten
    assert feed(held, [row()] * 2, first=4) == {}
    lifted = resumed(held)  # revoked and lifted: saturating again is reported again
    assert only(feed(lifted, [saturated] * 3, first=6)).level == "observe"


def test_a_run_level_alert_every_rank_raises_is_recorded_once():
    eng = engine()
    divergence = eng.report(9, "divergence", "stop", "loss 4 > 2 x 1.9", metric="loss").to_json()
    saturation = eng.report(
        9, "saturation", "degrade", "m", module=MODULES[FC1_0], metric="input.saturation"
    ).to_json()
    merged = merge_rank_alerts([[divergence, saturation], [divergence, saturation]])
    assert [(a["rule"], a["rank"]) for a in merged] == [
        ("divergence", 0),
        ("saturation", 0),
        ("saturation", 1),
    ]


# -- files ---------------------------------------------------------------------------------------


def test_alerts_and_proposals_round_trip_through_append_only_files(tmp_path):
    first = feed(engine(), [nan_from_module(QKV0)], [NAN_STEP])[1]
    second = engine().report(9, "ranks_disagree", "stop", "Step 9: differ.")
    write_alerts(tmp_path, first)
    write_alerts(tmp_path, [dict(second.to_json(), rank=1)])
    write_alerts(tmp_path, [])
    back = read_alerts(tmp_path)
    assert back[0] == first[0] and back[1].rank == 1 and back[1].message == "Step 9: differ."
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)  # strict JSON

    proposal = Proposal(3, MODULES[QKV0], "why", {"input.saturation": 0.004, "x": math.inf})
    assert Proposal.from_json(json.loads(json.dumps(proposal.to_json()))) == proposal
    assert read_alerts(tmp_path / "nowhere") == []


def test_reading_skips_a_torn_last_line(tmp_path):
    alert = engine().report(1, "r", "observe", "m")
    write_alerts(tmp_path, [alert])
    with open(tmp_path / "alerts.jsonl", "a") as log:
        log.write('{"step": 2, "lev')
    assert read_alerts(tmp_path) == [alert]


def test_select_alerts_by_level_and_module_glob():
    eng = engine()
    alerts = [
        eng.report(1, "r", "observe", "m", module=MODULES[QKV0]),
        eng.report(2, "r", "degrade", "m", module=MODULES[FC1_0]),
        eng.report(3, "r", "stop", "m"),
    ]
    assert [a.step for a in select_alerts(alerts, "degrade")] == [2, 3]
    assert [a.step for a in select_alerts(alerts, module="*.linear_qkv")] == [1]
    assert [a.step for a in select_alerts(alerts, "observe", "decoder.*")] == [1, 2]


# -- fp8ops alerts ------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory whose alerts.jsonl holds an observe, a degrade and a stop alert."""
    (tmp_path / "status.json").write_text('{"state": "stopped"}\n')
    eng = engine()
    rows = [row({(QKV0, "input.scale_change"): 5.0, (FC1_0, "input.saturation"): 0.004})] * 3
    alerts = [a for found in feed(eng, rows).values() for a in found]
    alerts += feed(eng, [nan_from_module(QKV1)], [NAN_STEP], first=4)[4]
    write_alerts(tmp_path, alerts)
    return tmp_path


def test_cli_lists_alerts_with_counts(cli, run_dir):
    result = cli("alerts", run_dir)
    assert result.code == 0, result.err
    header = result.out.splitlines()[0].split()
    assert header == ["step", "level", "module", "metric", "value", "threshold", "message"]
    for text in (
        MODULES[QKV0],
        "input.scale_change",
        MODULES[FC1_0],
        "input.saturation",
        MODULES[QKV1],
        "input.nan",
        "0.004",
        "0.001",
        "above the degrade level",
    ):
        assert text in result.out
    assert result.out.splitlines()[-1] == f"{run_dir}: 3 alert(s): 1 observe, 1 degrade, 1 stop"


def test_cli_filters_by_level_and_module(cli, run_dir):
    result = cli("alerts", run_dir, "--level", "degrade")
    assert result.code == 0 and "input.scale_change" not in result.out
    assert result.out.splitlines()[-1] == (
        f"{run_dir}: 2 alert(s) (level degrade or above; 3 in all): 0 observe, 1 degrade, 1 stop"
    )
    result = cli("alerts", run_dir, "--module", "*.linear_qkv")
    assert result.out.splitlines()[-1].endswith(
        "2 alert(s) (module *.linear_qkv; 3 in all): 1 observe, 0 degrade, 1 stop"
    )
    result = cli("alerts", run_dir, "--module", "*.linear_proj")
    assert (result.code, result.out) == (
        0,
        f"{run_dir}: no alerts (module *.linear_proj; 3 in all)\n",
    )


def test_cli_shows_ranks_when_recorded(cli, tmp_path):
    alert = engine().report(5, "ranks_disagree", "stop", "Step 5: scales differ.")
    write_alerts(tmp_path, [dict(alert.to_json(), rank=0)])
    result = cli("alerts", tmp_path)
    assert result.out.splitlines()[0].split()[:3] == ["step", "level", "rank"]
    assert "(run)" in result.out and "Step 5: scales differ." in result.out


def test_cli_run_without_alerts(cli, tmp_path):
    (tmp_path / "status.json").write_text('{"state": "completed"}\n')
    assert (cli("alerts", tmp_path).code, cli("alerts", tmp_path).out) == (
        0,
        f"{tmp_path}: no alerts\n",
    )


def test_cli_errors(cli, tmp_path):
    missing = cli("alerts", tmp_path / "nowhere")
    assert (missing.code, missing.out) == (2, "")
    assert missing.err.strip() == f"{tmp_path / 'nowhere'}: no such run directory"

    (tmp_path / "file").write_text("x")
    assert (
        cli("alerts", tmp_path / "file")
        .err.strip()
        .endswith("not a directory; give a run directory")
    )

    foreign = cli("alerts", tmp_path)
    assert foreign.code == 2 and "not an fp8ops run directory" in foreign.err

    (tmp_path / "alerts.jsonl").write_text('{"broken\n{"step": 1}\n')
    corrupt = cli("alerts", tmp_path)
    assert corrupt.code == 2 and "alerts.jsonl:1: not valid JSON" in corrupt.err

    (tmp_path / "alerts.jsonl").write_text('{"step": 1, "level": "fatal", "rule": "r"}\n')
    invalid = cli("alerts", tmp_path)
    assert invalid.code == 2 and "record 1 is not valid (alert level 'fatal'" in invalid.err
    (tmp_path / "alerts.jsonl").write_text('{"level": "stop"}\n')
    assert "record 1 is not valid (missing 'step')" in cli("alerts", tmp_path).err

    bad_level = cli("alerts", tmp_path, "--level", "fatal")
    assert bad_level.code == 2 and "choose observe, degrade, stop" in bad_level.err


# -- manifest ------------------------------------------------------------------------------------


def test_new_alert_fields_have_defaults_and_validate():
    defaults = Alerts()
    assert (defaults.window_steps, defaults.grad_spike_factor, defaults.amax_jump_factor) == (
        20,
        5.0,
        4.0,
    )
    assert (defaults.divergence_factor, defaults.divergence_warmup_steps) == (2.0, 10)
    assert defaults.update_blowup_factor == 100.0
    assert (defaults.underflow_rise_factor, defaults.underflow_rise_floor) == (2.0, 1e-3)
    assert (defaults.error_growth_samples, defaults.error_growth_floor) == (4, 0.04)
    for name, field in Alerts.model_fields.items():
        assert field.description, name
    for bad in (
        {"window_steps": 3},
        {"grad_spike_factor": 1.0},
        {"amax_jump_factor": 0.5},
        {"divergence_factor": 1},
        {"update_blowup_factor": 1.0},
        {"divergence_warmup_steps": -1},
        {"underflow_rise_floor": 2.0},
        {"error_growth_samples": 2},
        {"error_growth_floor": -0.1},
        {"window_steps": "20"},
        {"blocks_at_floor": {"observe": 1.5}},  # a fraction
        {"blocks_at_floor": {"observe": 0.1, "degrade": 0.01}},  # levels out of order
    ):
        with pytest.raises(ValidationError):
            Alerts.model_validate(bad)
    with pytest.raises(ValidationError, match="blocks_at_floor"):
        Alerts.model_validate({"blocks_at_floor": {"observe": 0.1, "degrade": 0.01}})


def test_the_window_must_hold_twice_the_patience():
    with pytest.raises(ValidationError, match="must be >= 2 \\* patience_steps \\(6\\)"):
        Alerts.model_validate({"window_steps": 5})
    with pytest.raises(ValidationError, match="patience_steps\n.*must be <= window_steps / 2 "):
        Alerts.model_validate({"patience_steps": 11})
    Alerts.model_validate({"window_steps": 6, "patience_steps": 3})


def test_new_fields_in_a_manifest_and_the_shipped_manifests_still_load():
    m = parse_manifest(MINIMAL + "alerts: {window_steps: 32, divergence_factor: 3}\n", "m.yaml")
    assert (m.alerts.window_steps, m.alerts.divergence_factor) == (32, 3.0)
    for path in (TINY, LLAMA, ROOT / "manifests" / "tiny-gpt-cpu-base.yaml"):
        AlertEngine(load_manifest(path).alerts, MODULES, [True] * 4)
