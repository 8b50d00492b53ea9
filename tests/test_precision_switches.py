"""A run's precision switches as the console's timeline and ``fp8ops inspect --layers`` read them
(``fp8ops.run.switches``), on hand-written records: the schedule's from ``layers.json``'s history
with each module's GEMMs from its ``precision_phase`` event, the policy's from its
``auto_degraded`` events, a resume's rewound ones dropped, a damaged event named. Training that
writes these records: test_auto_degrade.py and test_precision_schedule_resume.py."""

from __future__ import annotations

import json

import pytest

from fp8ops.run.records import (
    LayersDocument,
    RecipeRecord,
    RunRecordError,
    TableChange,
    table_hash,
)
from fp8ops.run.switches import Switch, read_switches

FC1, FC2 = "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2"
QKV = "decoder.layers.0.self_attention.linear_qkv"
HASH = "ab" * 32


def write_layers(run_dir, *history: TableChange) -> None:
    """A layers.json with no rows (the switches read only its history)."""
    recipe = RecipeRecord(fp8_format="hybrid")
    document = LayersDocument(
        schema_version=1,
        manifest_hash="0" * 64,
        tensor_parallel=1,
        table_hash=table_hash((), recipe),
        recipe=recipe,
        rows=(),
        history=history,
    )
    (run_dir / "layers.json").write_text(document.model_dump_json(by_alias=True))


def write_events(run_dir, *events: dict) -> None:
    lines = [json.dumps({"time": "2026-12-07T00:00:00Z", **e}) for e in events]
    (run_dir / "events.jsonl").write_text("".join(line + "\n" for line in lines))


def started(from_step: int) -> dict:
    return {"event": "train_started", "steps": 10, "from_step": from_step}


def degraded(step: int, modules: list[str], **more) -> dict:
    policy = {"policy": "c" * 64, "revision": "d" * 64, "rules": ["saturation"]}
    return {"event": "auto_degraded", "step": step, "modules": modules, **policy, **more}


def phase(step: int, base_gemms: dict[str, list[str]], started=(0,), ended=()) -> dict:
    return {
        "event": "precision_phase",
        "step": step,
        "started": list(started),
        "ended": list(ended),
        "modules": list(base_gemms),
        "base_gemms": base_gemms,
        "to": "bf16",
    }


def test_the_schedules_and_the_policys_switches_in_the_order_made(tmp_path):
    write_layers(
        tmp_path,
        TableChange(
            step=5, cause="precision.schedule[0] starts", modules=(QKV, FC2), table_hash=HASH
        ),
        TableChange(
            step=8, cause="precision.schedule[0] ended with step 7", modules=(QKV,), table_hash=HASH
        ),
    )
    write_events(
        tmp_path,
        started(0),
        degraded(4, [FC1]),
        phase(5, {QKV: ["fprop"], FC2: ["fprop", "dgrad", "wgrad"]}),
        degraded(6, [FC2], gemms={FC2: ["wgrad", "dgrad"]}),
        phase(8, {QKV: []}, started=(), ended=(0,)),
    )
    switches = read_switches(tmp_path)
    policy = "by the policy of revision " + "c" * 12
    assert switches == [
        # The policy's switch after step 4 and the phase starting at 5 share step 5: the
        # policy's first, as the trainer made them.
        Switch(
            5,
            "auto-degrade",
            f"auto-degrade after step 4's saturation alert, {policy}",
            {FC1: "bf16"},
        ),
        Switch(
            5,
            "schedule",
            "precision.schedule[0] starts",
            {QKV: "dgrad, wgrad fp8; fprop bf16", FC2: "bf16"},
        ),
        Switch(
            7,
            "auto-degrade",
            f"auto-degrade after step 6's saturation alert, {policy}",
            {FC2: "fprop fp8; dgrad, wgrad bf16"},
        ),
        Switch(8, "schedule", "precision.schedule[0] ended with step 7", {QKV: "fp8"}),
    ]
    assert switches[1].grouped() == [("dgrad, wgrad fp8; fprop bf16", [QKV]), ("bf16", [FC2])]


def test_a_phase_to_a_recipe_names_it_and_the_return_says_fp8(tmp_path):
    # Since phases may name a recipe, the event's `to` is per module: the recipe its FP8 GEMMs
    # run (the run's own, delayed, reads "fp8"), or the base dtype (with `base_dtype` beside).
    write_layers(
        tmp_path,
        TableChange(
            step=3, cause="precision.schedule[0] starts", modules=(FC1, QKV), table_hash=HASH
        ),
        TableChange(
            step=4,
            cause="precision.schedule[1] starts (to current scaling)",
            modules=(FC1, FC2),
            table_hash=HASH,
        ),
        TableChange(
            step=6, cause="precision.schedule[1] ended with step 5", modules=(FC2,), table_hash=HASH
        ),
    )
    per_module = {"base_dtype": "fp16"}
    write_events(
        tmp_path,
        started(0),
        {
            **phase(3, {FC1: ["wgrad"], QKV: ["fprop", "dgrad", "wgrad"]}),
            "to": {FC1: "delayed", QKV: "fp16"},
            **per_module,
        },
        {**phase(4, {FC1: [], FC2: []}), "to": {FC1: "current", FC2: "current"}, **per_module},
        {**phase(6, {FC2: []}), "to": {FC2: "delayed"}, **per_module},
    )
    assert [s.modules for s in read_switches(tmp_path)] == [
        {FC1: "fprop, dgrad fp8; wgrad fp16", QKV: "fp16"},
        {FC1: "current", FC2: "current"},
        {FC2: "fp8"},  # back to the run's recipe
    ]


def test_a_resume_drops_what_it_ran_past_and_keeps_the_replay(tmp_path):
    # Paused at step 6 after both switches; resumed from the checkpoint of step 3, which runs
    # the policy's switch again at the same step; the history is cut as the resume cuts it.
    write_layers(
        tmp_path,
        TableChange(step=5, cause="precision.schedule[0] starts", modules=(QKV,), table_hash=HASH),
    )
    write_events(
        tmp_path,
        started(0),
        degraded(2, [FC2]),  # before the checkpoint: kept
        degraded(4, [FC1]),
        phase(5, {QKV: ["fprop", "dgrad"]}),
        started(3),
        degraded(4, [FC1]),
        phase(5, {QKV: ["fprop"]}),  # the latest of the step wins: the resume's
    )
    switches = read_switches(tmp_path)
    assert [(s.step, s.source, s.modules) for s in switches] == [
        (3, "auto-degrade", {FC2: "bf16"}),
        (5, "auto-degrade", {FC1: "bf16"}),
        (5, "schedule", {QKV: "dgrad, wgrad fp8; fprop bf16"}),
    ]


def test_a_history_entry_without_its_event_still_lists_its_modules(tmp_path):
    write_layers(
        tmp_path,
        TableChange(step=2, cause="precision.schedule[0] starts", modules=(FC1,), table_hash=HASH),
    )
    write_events(tmp_path, phase(2, {FC2: ["fprop"]}))  # another switch's event: not its
    (switch,) = read_switches(tmp_path)
    assert switch.modules == {FC1: "changed"}


def test_a_run_without_records_has_no_switches(tmp_path):
    assert read_switches(tmp_path) == []


def test_a_damaged_event_is_named_with_its_file_line_and_field(tmp_path):
    write_events(tmp_path, started(0), degraded("4", [FC1]))
    with pytest.raises(
        RunRecordError, match=r"events.jsonl: record 2 \(auto_degraded\): step is '4'"
    ):
        read_switches(tmp_path)
    write_events(tmp_path, degraded(4, [FC1, 7]))
    with pytest.raises(RunRecordError, match="record 1 .*modules is .* not a list of module names"):
        read_switches(tmp_path)
