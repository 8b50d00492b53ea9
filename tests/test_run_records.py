"""The run directory's records (``fp8ops.run``): every reader names the file and what is wrong,
never returns "nothing recorded" for a record that is missing or malformed; ``RunDir`` writes
them on rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8ops.manifest import load_manifest, manifest_hash
from fp8ops.manifest.schema import Bf16Override
from fp8ops.run import (
    MetricsRow,
    RunDir,
    RunLayout,
    RunRecordError,
    find_status,
    read_events,
    read_fallbacks,
    read_metrics,
    read_run_record,
    read_status,
)

TINY = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"


def _row(step: int, **changes) -> dict:
    row = MetricsRow(step=step, loss=2.0, tokens=64, grad_norm=1.0, lr=1e-3, skipped=False)
    return {**row.model_dump(mode="json"), **changes}


def test_a_missing_record_is_named_not_read_as_nothing(tmp_path):
    with pytest.raises(RunRecordError, match=rf"{tmp_path / 'run.json'}: no such file"):
        read_run_record(tmp_path)
    with pytest.raises(RunRecordError, match=rf"{tmp_path / 'status.json'}: no such file"):
        read_status(tmp_path)
    assert find_status(tmp_path) is None  # "is there a run here?" may be asked
    assert read_metrics(tmp_path) == [] and read_events(tmp_path) == []  # no line yet


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"state": "running", "step": "5"}', "step: Input should be a valid integer"),
        ('{"state": "resting"}', "state: Input should be"),
        ('{"step": 5}', "no 'state' field"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"state": ', "cannot be read: not valid JSON"),
    ],
)
def test_a_malformed_status_names_the_file_and_the_field(tmp_path, content, said):
    (tmp_path / "status.json").write_text(content)
    with pytest.raises(RunRecordError) as refused:
        read_status(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'status.json'}: ") and said in message, message
    assert "damaged" in message


def test_a_run_record_keeps_fields_it_does_not_know_and_checks_those_it_reads(tmp_path):
    record = {"manifest": "a" * 64, "from_a_later_version": {"x": 1}, "seeds": {"data": 7}}
    (tmp_path / "run.json").write_text(json.dumps(record))
    read = read_run_record(tmp_path)
    assert read.seeds == {"data": 7} and read.model_dump()["from_a_later_version"] == {"x": 1}
    (tmp_path / "run.json").write_text(json.dumps({**record, "seeds": {"data": "seven"}}))
    with pytest.raises(RunRecordError, match=r"seeds\.data: Input should be a valid integer"):
        read_run_record(tmp_path)


def test_metrics_keep_the_latest_line_per_step_and_name_a_bad_line(tmp_path):
    lines = [_row(1), _row(2, loss=3.0), _row(2, loss=2.5), _row(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [(m.step, m.loss) for m in read_metrics(tmp_path)] == [(1, 2.0), (2, 2.5), (3, 2.0)]
    broken = [*lines[:2], {k: v for k, v in _row(3).items() if k != "loss"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in broken))
    with pytest.raises(RunRecordError, match=r"metrics\.jsonl: record 3: no 'loss' field"):
        read_metrics(tmp_path)


def test_only_the_writing_rank_writes(tmp_path):
    RunDir(tmp_path, writer=False).set_status("running", step=3)
    RunDir(tmp_path, writer=False).event("evaluated", step=3)
    assert list(tmp_path.iterdir()) == []


def test_a_status_update_merges_and_is_checked_before_it_is_written(tmp_path):
    run = RunDir(tmp_path)
    run.set_status("running", step=0, manifest="b" * 64)
    run.set_status("paused", step=4, checkpoint="step_00000004", reason="stop-at")
    status = read_status(tmp_path)
    assert (status.state, status.step, status.manifest) == ("paused", 4, "b" * 64)
    with pytest.raises(ValueError, match="state"):
        run.set_status("sleeping")
    assert read_status(tmp_path).state == "paused"  # nothing written


def test_fallbacks_keep_their_first_step_for_the_same_approval(tmp_path):
    run = RunDir(tmp_path)
    fc1 = Bf16Override(
        module="decoder.layers.0.mlp.linear_fc1", reason="saturates", approval="1" * 64
    )
    run.write_fallbacks([fc1], from_step=11, revision="c" * 64)
    qkv = Bf16Override(module="decoder.layers.1.self_attention.linear_qkv", reason="r")
    run.write_fallbacks([fc1, qkv], from_step=21, revision="d" * 64)
    table = read_fallbacks(tmp_path)
    assert table[fc1.module].from_step == 11 and table[fc1.module].revision == "c" * 64
    assert table[qkv.module].from_step == 21
    again = fc1.model_copy(update={"approval": "2" * 64})  # approved anew: a new entry
    run.write_fallbacks([again], from_step=31, revision="e" * 64)
    assert {m: e.from_step for m, e in read_fallbacks(tmp_path).items()} == {fc1.module: 31}


def test_a_fallback_of_some_gemms_names_them_and_one_of_all_three_reads_as_before(tmp_path):
    run = RunDir(tmp_path)
    fc2 = Bf16Override(module="m.fc2", reason="grads", approval="1" * 64, gemms=["wgrad", "dgrad"])
    fc1 = Bf16Override(module="m.fc1", reason="all of it", approval="2" * 64)
    run.write_fallbacks([fc2, fc1], from_step=5, revision="c" * 64)
    written = json.loads((tmp_path / "fallbacks.json").read_text())
    assert written["m.fc2"]["gemms"] == ["dgrad", "wgrad"]
    assert "gemms" not in written["m.fc1"]  # as every file before per-GEMM overrides
    table = read_fallbacks(tmp_path)
    assert (table["m.fc2"].gemms, table["m.fc1"].gemms) == (["dgrad", "wgrad"], None)


def test_a_claimed_run_is_a_run_and_holds_its_locked_manifest(tmp_path):
    manifest = load_manifest(TINY)
    run = RunDir.claim(tmp_path / "run", manifest, [manifest])
    try:
        layout = RunLayout(tmp_path / "run")
        assert layout.is_run() and layout.manifest.is_file()
        assert read_status(layout.root).manifest == manifest_hash(manifest)
        assert (layout.manifests / f"{manifest_hash(manifest)}.yaml").is_file()
    finally:
        run.release()


def test_a_recipe_record_says_only_the_fields_its_recipe_has():
    from fp8ops.run.records import RecipeRecord

    mxfp8 = RecipeRecord(scaling="mxfp8", fp8_format="hybrid")
    assert mxfp8.summary == "MXFP8 scaling, hybrid, 1x32 blocks, E8M0 scales"
    block = RecipeRecord(
        scaling="block",
        fp8_format="e4m3",
        power_2_scale=True,
        x_block_scaling_dim=1,
        w_block_scaling_dim=2,
        grad_block_scaling_dim=1,
    )
    assert block.summary == (
        "block scaling, e4m3, power-of-2 scales on, blocks: input 1x128, weight 128x128, grad 1x128"
    )
    current = RecipeRecord(scaling="current", fp8_format="hybrid", power_2_scale=False)
    assert "None" not in current.summary + mxfp8.summary + block.summary
