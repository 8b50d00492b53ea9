"""``fp8ops compare`` (``fp8ops.compare``): every gate passing and failing with its cause, the
worst bucket and layer, bad and non-comparable inputs, the dual-track form, verdict.json,
report.html and a real PNG export.

The run directories are synthetic: the files the trainer writes (metrics, eval, events,
status, run.json, layers.json), capability files through ``fp8ops.evaluate.records`` and
telemetry through the real ``TelemetryWriter``, so a test states exactly what a run did. The
end-to-end comparison of three real training tracks lives with ``fp8ops dualtrack``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp8ops.alerts import Alert, write_alerts
from fp8ops.compare.comparison import compare
from fp8ops.compare.gates import judge, one_bar
from fp8ops.compare.runs import check_comparable, load_run, resolve_tracks
from fp8ops.evaluate.records import write_capability
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.run.records import AdmissionRow, LayersDocument, RecipeRecord, table_hash
from fp8ops.telemetry import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, TelemetryWriter

ROOT = Path(__file__).resolve().parents[1]
BASE_MANIFEST = ROOT / "manifests" / "tiny-gpt-cpu.yaml"
STEPS, EVAL_EVERY, CAPABILITY_EVERY, TOKENS = 40, 10, 20, 512
MODULES = [
    f"decoder.layers.{layer}.{name}"
    for layer in (0, 1)
    for name in (
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    )
]
WORST = "decoder.layers.1.mlp.linear_fc2"
EARLY_WORST = "decoder.layers.0.self_attention.linear_qkv"  # bad early, fine in the last quarter
COLUMN = {name: i for i, name in enumerate(MODULE_METRIC_NAMES)}
ITEMS = 66  # task=add/reverse/sort: 22 each (gated); format=odd: 6 (under min_bucket_items)
GATE_NAMES = [
    "reference",
    "completed",
    "loss_gap",
    "bucket_accuracy_gap",
    "finite",
    "skipped_steps",
    "resume_continuity",
]


# --------------------------------------------------------------------------------------
# Synthetic run directories
# --------------------------------------------------------------------------------------

_manifests: dict[tuple, object] = {}


def run_manifest(fp8: bool, changes: dict):
    """The tiny CPU manifest at this test's schedule (derived once per distinct change set)."""
    key = (fp8, tuple(sorted(changes.items())))
    if key not in _manifests:
        all_changes = {
            "schedule.train_steps": STEPS,
            "schedule.eval_interval": EVAL_EVERY,
            "precision.enabled": fp8,
            "capability.interval": CAPABILITY_EVERY,
            "gates.loss_gap": 0.01,
            **changes,
        }
        _manifests[key] = derive(load_manifest(BASE_MANIFEST), all_changes, "test: compare")
    return _manifests[key]


def item_buckets(index: int) -> dict[str, str]:
    return {
        "task": ("add", "reverse", "sort")[index % 3],
        "format": "odd" if index < 6 else "plain",
    }


def make_run(
    path: Path,
    *,
    fp8: bool = True,
    changes: dict | None = None,
    eval_shift: float = 0.0,
    state: str = "completed",
    last_step: int = STEPS,
    edits: dict[int, dict] | None = None,
    wrong: set[int] = frozenset({9}),
    capability: bool = True,
    telemetry: bool | None = None,
    nan_at: int | None = None,
    kept_bf16: tuple[str, ...] = (),
    resume_at: int | None = None,
    resume_event: bool = True,
    loss_jump: float = 0.0,
    alerts: list[Alert] | None = None,
    fingerprint: str = "c8" * 32,
    data_seed: int = 1234,
    initial_weights: str = "1e" * 32,
) -> Path:
    """A run directory as the trainer leaves it (``state`` at ``last_step``)."""
    path.mkdir(parents=True)
    manifest = run_manifest(fp8, changes or {})
    digest = manifest_hash(manifest)
    write_manifest(manifest, path / "manifest.yaml")
    ManifestStore(path / "manifests").put(manifest)
    write_json(
        path / "run.json",
        {
            "manifest": digest,
            "seeds": {"data": data_seed, "model": 1234},
            "data": {"fingerprint": fingerprint, "kind": "tasks", "objective": "sft"},
            "model": {"initial_weights_fingerprint": initial_weights},
            "topology": {"world_size": 1},
        },
    )
    status = {"state": state, "step": last_step, "manifest": digest, "updated": "now"}
    if state == "stopped":
        status["alert"] = {"message": f"step {last_step}: {WORST} weight.saturation 0.02 > 0.01"}
    if state == "failed":
        status["error"] = "RuntimeError: CUDA error: an illegal memory access"
    write_json(path / "status.json", status)

    metrics = []
    for step in range(1, last_step + 1):
        loss = 3.0 - 0.02 * step + (loss_jump if resume_at and step > resume_at else 0.0)
        metrics.append(
            {
                "step": step,
                "loss": loss,
                "grad_norm": 1.0 + 0.01 * step,
                "update_norm": 0.01 + 0.0001 * step,
                "lr": 1e-4,
                "skipped": False,
                "tokens": TOKENS,
                "loss_tokens": 50,
                "seconds": 0.05,
                "tokens_per_s": 10240.0 + step,
                "peak_memory_mib": 400.0 + (50 if fp8 else 0),
                **(edits or {}).get(step, {}),
            }
        )
    write_jsonl(path / "metrics.jsonl", metrics)
    evals = [
        {"step": s, "loss": 2.9 - 0.02 * s + eval_shift, "tokens": 76, "buckets": {}}
        for s in range(EVAL_EVERY, last_step + 1, EVAL_EVERY)
    ]
    write_jsonl(path / "eval.jsonl", evals)

    events = [{"event": "run_started"}, {"event": "train_started", "from_step": 0}]
    if resume_at:
        events.append({"event": "paused", "step": resume_at, "checkpoint": ckpt(resume_at)})
        if resume_event:
            events.append({"event": "resumed", "step": resume_at, "checkpoint": ckpt(resume_at)})
        events.append({"event": "train_started", "from_step": resume_at})
    if state == "completed":
        events.append({"event": "train_completed"})
    write_jsonl(path / "events.jsonl", events)
    write_layers(path, digest, fp8, kept_bf16)

    if capability:
        for step in range(CAPABILITY_EVERY, last_step + 1, CAPABILITY_EVERY):
            predictions = [
                {
                    "index": i,
                    "key": f"item-{i}",
                    "prompt": f"q{i}",
                    "answer": "a",
                    "generated": "b" if i in wrong else "a",
                    "correct": i not in wrong,
                    "buckets": item_buckets(i),
                }
                for i in range(ITEMS)
            ]
            write_capability(path, step, predictions, seconds=1.0)
    if telemetry if telemetry is not None else fp8:
        write_telemetry(path, last_step, kept_bf16, nan_at, digest)
    if alerts:
        write_alerts(path, alerts)
    return path


def ckpt(step: int) -> str:
    return f"step_{step:08d}"


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2))


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_layers(path: Path, digest: str, fp8: bool, kept_bf16: tuple[str, ...]) -> None:
    rows = []
    for fqn in MODULES:
        on = fp8 and fqn not in kept_bf16
        rows.append(
            AdmissionRow.model_validate(
                {
                    "fqn": fqn,
                    "kind": fqn.rsplit("_", 1)[-1],
                    "parallel": "column",
                    "global_shape": {"in": 64, "out": 64},
                    "rank_shape": {"in": 64, "out": 64},
                    "params_dtype": "bf16",
                    "precision": "fp8" if on else "bf16",
                    "formats": {"forward": "E4M3", "backward": "E5M2"} if on else None,
                    "reason": {"code": "fp8" if on else "fp8_disabled", "text": "test"},
                }
            )
        )
    recipe = RecipeRecord(
        fp8_format="hybrid",
        amax_history_len=16,
        amax_compute_algo="max",
        margin=0,
        reduce_amax=True,
    )
    document = LayersDocument(
        schema_version=1,
        manifest_hash=digest,
        tensor_parallel=1,
        table_hash=table_hash(tuple(rows), recipe),
        recipe=recipe,
        rows=tuple(rows),
    )
    (path / "layers.json").write_text(document.model_dump_json(by_alias=True, indent=2))


def write_telemetry(path, last_step, kept_bf16, nan_at, digest) -> None:
    """Errors sampled every 5 steps: WORST is worst over the last quarter (0.3), EARLY_WORST
    only before it (0.5); a BF16-kept module reports a large "error" it never ran with."""
    with TelemetryWriter(
        path / "telemetry.zarr",
        rank=0,
        modules=MODULES,
        flush_every=8,
        steps_per_shard=16,
        attrs={"manifest": digest},
    ) as writer:
        for step in range(1, last_step + 1):
            row = np.full((len(MODULES), len(MODULE_METRIC_NAMES)), np.nan, np.float32)
            for m, module in enumerate(MODULES):
                on = module not in kept_bf16
                row[m, COLUMN["fp8_enabled"]] = float(on)
                for slot in ("input", "weight", "grad_output"):
                    row[m, COLUMN[f"{slot}.saturation"]] = 0.001 if on else np.nan
                    row[m, COLUMN[f"{slot}.underflow"]] = 0.01 if on else np.nan
                    row[m, COLUMN[f"{slot}.nan"]] = row[m, COLUMN[f"{slot}.inf"]] = 0
                if step % 5 == 0:
                    error = 0.02 + 0.01 * m
                    if module == WORST and step > 30:
                        error = 0.3
                    if module == EARLY_WORST and step <= 20:
                        error = 0.5
                    row[m, COLUMN["fp8_rel_error"]] = error if on else 0.9
            row[MODULES.index(WORST), COLUMN["weight.underflow"]] = 0.63
            if step == nan_at:
                row[MODULES.index(WORST), COLUMN["grad_output.nan"]] = 12
            writer.append(step, row, np.zeros(len(STEP_METRIC_NAMES), np.float32))


def underflow_alert(step: int = 35) -> Alert:
    return Alert(
        step,
        "degrade",
        "underflow",
        WORST,
        "weight.underflow",
        0.63,
        0.05,
        f"{WORST} weight.underflow 0.63 above degrade 0.05",
    )


def pair(tmp_path: Path, **candidate) -> tuple[Path, Path]:
    """A BF16 reference and an FP8 candidate that passes unless ``candidate`` says otherwise.
    Changed gates are the reference's too: every candidate is judged by one bar."""
    gates = {k: v for k, v in candidate.get("changes", {}).items() if k.startswith("gates.")}
    reference = make_run(tmp_path / "bf16", fp8=False, changes=gates)
    return reference, make_run(tmp_path / "fp8", **candidate)


def verdict_of(reference: Path, candidate: Path, gates_from: Path | None = None):
    """The candidate's verdict without writing a report (the gates alone), by the runs' one bar
    or, as ``--gates`` gives it, by the gates of the run ``gates_from``."""
    tracks, _ = resolve_tracks([reference, candidate])
    ref, cand = (load_run(track) for track in tracks)
    check_comparable(ref, [cand])
    bar = (
        one_bar([ref, cand])
        if gates_from is None
        else load_manifest(gates_from / "manifest.yaml").gates
    )
    return judge(ref, cand, bar)


def gate(verdict, name: str):
    return next(g for g in verdict.gates if g.name == name)


# --------------------------------------------------------------------------------------
# Passing, the command, verdict.json and the report
# --------------------------------------------------------------------------------------


def test_matching_runs_pass_every_gate_through_the_command(tmp_path, cli):
    reference, candidate = pair(tmp_path, alerts=[underflow_alert()])
    result = cli("compare", reference, candidate, "--no-png")
    assert result.code == 0, result.out + result.err
    assert "verdict: PASS (0 of 1 candidates failed)" in result.out
    assert all(name in result.out for name in GATE_NAMES)
    out = tmp_path / "compare-bf16-vs-fp8"  # beside the reference run, named for the runs
    assert f"verdict.json: {out / 'verdict.json'}" in result.out

    document = json.loads((out / "verdict.json").read_text())
    assert set(document) == {"verdict", "reference", "candidates", "gates", "created"}
    assert document["verdict"] == "pass"
    assert document["gates"] == {
        "source": "the runs' manifests",
        **run_manifest(True, {}).gates.model_dump(),
    }
    assert "gates: the runs' manifests" in result.out
    assert document["reference"] == {
        "label": "bf16",
        "run_dir": str(reference),
        "status": "completed",
        "step": STEPS,
        "clean": True,
        "problems": [],
        "manifest": manifest_hash(run_manifest(False, {})),
        "fp8_modules": 0,
    }
    [entry] = document["candidates"]
    assert {
        "label",
        "run_dir",
        "manifest",
        "verdict",
        "cause",
        "gates",
        "worst_bucket",
        "worst_layer",
    } <= set(entry)
    assert entry["label"] == "fp8" and entry["verdict"] == "pass" and entry["cause"] is None
    assert entry["fp8_modules"] == len(MODULES)
    assert [g["name"] for g in entry["gates"]] == GATE_NAMES
    for g in entry["gates"]:
        assert set(g) == {"name", "passed", "value", "threshold", "detail"} and g["passed"]
    loss = entry["gates"][2]
    assert loss["value"] == pytest.approx(0.0) and loss["threshold"] == 0.01
    assert loss["detail"] == f"loss gap 0 <= 0.01 at step {STEPS} (tokens {STEPS * TOKENS})"
    assert [e["step"] for e in entry["evaluations"]] == [10, 20, 30, 40]
    assert entry["evaluations"][0]["tokens"] == 10 * TOKENS
    assert entry["capability"]["step"] == 40
    assert entry["worst_layer"]["module"] == WORST
    assert entry["worst_layer"]["alerts"][0]["rule"] == "underflow"

    page = (out / "report.html").read_text()
    for section in ("verdict", "loss", "norms", "throughput", "buckets", "layers", "resumes"):
        assert f'<section id="{section}">' in page
    assert page.count("plotly.js v") == 1  # the library inline once: opens offline
    assert "no run was resumed" in page and "Capability accuracy per bucket at step 40" in page
    assert not (out / "png").exists()


def test_verdict_json_is_strict_json_even_with_nan_losses(tmp_path):
    reference, candidate = pair(tmp_path, edits={40: {"loss": math.nan}})
    evals = [json.loads(line) for line in (candidate / "eval.jsonl").read_text().splitlines()]
    evals[-1]["loss"] = math.nan  # json writes NaN, as the trainer's log would
    write_jsonl(candidate / "eval.jsonl", evals)
    result = compare([reference, candidate], tmp_path / "out", png=False)
    text = result.verdict_path.read_text()
    document = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in verdict.json"))
    entry = document["candidates"][0]
    assert entry["evaluations"][-1]["gap"] == "nan"
    assert "loss gap not finite at step 40" in entry["cause"]
    assert "non-finite: loss or grad_norm at step 40" in entry["cause"]


# --------------------------------------------------------------------------------------
# Each gate failing, with its cause
# --------------------------------------------------------------------------------------


def test_loss_gap_fails_with_cause_and_worst_layer(tmp_path, cli):
    reference, candidate = pair(tmp_path, eval_shift=0.034, alerts=[underflow_alert()])
    result = cli("compare", reference, candidate, "--no-png", "--out", tmp_path / "out")
    assert result.code == 1, result.out + result.err
    cause = (
        f"loss gap 0.034 > 0.01 at step 40 (tokens {40 * TOKENS}); worst layer {WORST}: "
        "fp8 error 0.3, weight underflow 0.63, input saturation 0.001, 1 alerts (degrade)"
    )
    assert f"fp8: FAIL: {cause}" in result.out
    entry = json.loads((tmp_path / "out" / "verdict.json").read_text())["candidates"][0]
    assert entry["cause"] == cause
    assert [round(e["gap"], 6) for e in entry["evaluations"]] == [0.034] * 4


def test_bucket_gap_fails_naming_the_worst_bucket_with_paired_counts(tmp_path):
    # The reference misses item 9 (task=add); the candidate gets it and misses 3 others.
    # The drop alone decides here (bucket_significance null); the next test asks for evidence.
    reference, candidate = pair(
        tmp_path, wrong={0, 3, 6, 10}, changes={"gates.bucket_significance": None}
    )
    verdict = verdict_of(reference, candidate)
    bucket = gate(verdict, "bucket_accuracy_gap")
    assert not bucket.passed and bucket.threshold == 0.02
    worst = verdict.worst_bucket
    assert worst["bucket"] == "task=add" and worst["items"] == 22 and worst["gated"]
    assert (worst["lost"], worst["gained"]) == (3, 1)  # 0, 3, 6 lost; 9 gained
    assert worst["drop"] == pytest.approx(2 / 22)
    assert bucket.value == pytest.approx(2 / 22)
    assert bucket.detail == (
        "accuracy drop 0.0909 in task=add (0.955 -> 0.864; 3 right only in the reference, "
        "1 only in the candidate, of 22; sign test p 0.31) > 0.02 at step 40; 2 more over the gap"
    )
    overall = verdict.capability["overall"]
    assert (overall["lost"], overall["gained"], overall["items"]) == (4, 1, ITEMS)
    assert verdict.cause.startswith("accuracy drop 0.0909 in task=add")


def test_a_drop_the_paired_items_explain_as_noise_passes_and_a_real_one_fails(tmp_path):
    # 3 items lost against 1 gained: as likely as not from coin flips (p 0.31 >= 0.05).
    reference, candidate = pair(tmp_path / "noise", wrong={0, 3, 6, 10})
    noise = gate(verdict_of(reference, candidate), "bucket_accuracy_gap")
    assert noise.passed and noise.value == pytest.approx(2 / 22)
    assert "> 0.02 but not significant (Holm over 5 gated rows at 0.05)" in noise.detail
    # 7 lost, 1 gained: p = 9 / 256 = 0.035, significant alone but not as the smallest of 5
    # p-values tested at once (Holm: 0.05 / 5 = 0.01 first).
    reference, candidate = pair(tmp_path / "family", wrong={0, 3, 6, 12, 15, 18, 21})
    family = gate(verdict_of(reference, candidate), "bucket_accuracy_gap")
    assert family.passed and "sign test p 0.035" in family.detail
    # 21 add items lost, 1 gained (item 9, which the reference misses): p = 23 / 2**22.
    adds = {i for i in range(0, ITEMS, 3) if i != 9}
    reference, candidate = pair(tmp_path / "real", wrong=adds)
    verdict = verdict_of(reference, candidate)
    real = gate(verdict, "bucket_accuracy_gap")
    assert not real.passed and "task=add" in real.detail and "sign test p 5.5e-06" in real.detail
    assert verdict.worst_bucket["p_value"] == pytest.approx(23 / 2**22)


def test_a_reference_that_answered_nothing_right_measures_no_accuracy_drop(tmp_path):
    everything = set(range(ITEMS))
    reference = make_run(tmp_path / "bf16", fp8=False, wrong=everything)
    verdict = verdict_of(reference, make_run(tmp_path / "fp8", wrong=everything))
    bucket = gate(verdict, "bucket_accuracy_gap")
    assert bucket.passed and bucket.value is None  # not gated: nothing was measured
    assert bucket.detail.startswith(
        f"not measured: the reference answered none of its {ITEMS} items right at step "
    )
    assert verdict.capability["overall"]["reference_accuracy"] == 0  # still reported
    # One item right is a measurement: losing it is a drop (1/ITEMS overall, more in its bucket).
    one = make_run(tmp_path / "bf16-one", fp8=False, wrong=everything - {4})
    bucket = gate(
        verdict_of(one, make_run(tmp_path / "fp8-one", wrong=everything)), "bucket_accuracy_gap"
    )
    assert bucket.value > 0 and "accuracy drop" in bucket.detail


def test_small_buckets_are_reported_but_not_gated(tmp_path):
    # Item 0 is the only format=odd item the candidate misses: a 1/6 drop, under 20 items.
    reference, candidate = pair(tmp_path, wrong={0}, changes={"gates.bucket_accuracy_gap": 0.05})
    verdict = verdict_of(reference, candidate)
    bucket = gate(verdict, "bucket_accuracy_gap")
    assert bucket.passed, bucket.detail
    assert "1 buckets under 20 items not gated" in bucket.detail
    odd = next(b for b in verdict.capability["buckets"] if b["bucket"] == "format=odd")
    assert not odd["gated"] and odd["drop"] == pytest.approx(1 / 6) and odd["lost"] == 1
    assert verdict.worst_bucket["bucket"] == "task=add"  # the largest *gated* drop


def test_missing_capability_fails_only_when_capability_is_enabled(tmp_path):
    reference = make_run(tmp_path / "bf16", fp8=False, capability=False)
    enabled = make_run(tmp_path / "fp8", capability=False)
    bucket = gate(verdict_of(reference, enabled), "bucket_accuracy_gap")
    assert not bucket.passed
    assert bucket.detail == (
        f"no capability records in bf16 ({reference}/capability.jsonl), though "
        "capability.enabled is true"
    )
    disabled = make_run(tmp_path / "off", capability=False, changes={"capability.enabled": False})
    verdict = verdict_of(reference, disabled)
    bucket = gate(verdict, "bucket_accuracy_gap")
    assert bucket.passed and bucket.detail == "not gated: capability.enabled is false"
    assert verdict.passed and verdict.worst_bucket is None


def test_nonfinite_metrics_fail_unless_allowed(tmp_path):
    reference, candidate = pair(tmp_path, edits={17: {"grad_norm": None}})
    finite = gate(verdict_of(reference, candidate), "finite")
    assert not finite.passed and finite.value == 1 and finite.threshold is False
    assert finite.detail == "fp8 non-finite: loss or grad_norm at step 17"
    allowed = make_run(
        tmp_path / "allowed",
        edits={17: {"grad_norm": None}},
        changes={"gates.allow_nonfinite": True},
    )
    finite = gate(verdict_of(reference, allowed, gates_from=allowed), "finite")
    assert finite.passed and "(allowed by gates.allow_nonfinite)" in finite.detail


def test_nonfinite_casts_in_telemetry_and_alerts_fail(tmp_path):
    alert = Alert(33, "stop", "nonfinite", WORST, "grad_output.nan", 12.0, None, "NaN in casts")
    reference, candidate = pair(tmp_path, nan_at=33, alerts=[alert])
    finite = gate(verdict_of(reference, candidate), "finite")
    assert not finite.passed and finite.value == 1
    assert finite.detail == (
        f"fp8 non-finite: 12 NaN/Inf cast elements at step 33 (most in {WORST}); "
        "1 nonfinite alerts (first: NaN in casts)"
    )


def test_skipped_steps_fail_unless_allowed(tmp_path):
    reference, candidate = pair(tmp_path, edits={5: {"skipped": True}, 6: {"skipped": True}})
    skipped = gate(verdict_of(reference, candidate), "skipped_steps")
    assert not skipped.passed and skipped.value == 2
    assert skipped.detail == "2 optimizer steps skipped (steps 5, 6)"
    # As the trainer writes a skipped step: its gradient norm was not finite (JSON null). That is
    # the skipped_steps gate's to judge, so allowing skipped steps passes the run.
    allowed = make_run(
        tmp_path / "allowed",
        edits={5: {"skipped": True, "grad_norm": None}},
        changes={"gates.allow_skipped_steps": True},
    )
    verdict = verdict_of(reference, allowed, gates_from=allowed)
    assert gate(verdict, "skipped_steps").passed and gate(verdict, "finite").passed
    assert verdict.passed


def test_a_stopped_candidate_fails_naming_its_status_and_alert(tmp_path):
    reference, candidate = pair(tmp_path, state="stopped", last_step=25)
    verdict = verdict_of(reference, candidate)
    completed = gate(verdict, "completed")
    assert not completed.passed and (completed.value, completed.threshold) == (25, STEPS)
    assert completed.detail == (
        f"fp8 status stopped at step 25 of {STEPS}: step 25: {WORST} weight.saturation 0.02 > 0.01"
    )
    # Its losses are still compared where both evaluated (step 20 of the reference's 40).
    assert gate(verdict, "loss_gap").detail.endswith(f"at step 20 (tokens {20 * TOKENS})")
    assert "at step 20;" in gate(verdict, "bucket_accuracy_gap").detail


def test_a_paused_candidate_fails_as_unfinished(tmp_path):
    reference, candidate = pair(tmp_path, state="paused", last_step=30)
    completed = gate(verdict_of(reference, candidate), "completed")
    assert completed.detail == (
        f"fp8 status paused at step 30 of {STEPS} (resume it to the end, then compare)"
    )


def test_a_missing_metrics_step_fails_instead_of_judging_an_earlier_evaluation(tmp_path):
    """Tokens stop matching after a missing line, so only earlier evaluations pair up: the
    candidate's last one (step 40) must be the one judged, and the gap in the log is named."""
    reference, candidate = pair(tmp_path)
    lines = (candidate / "metrics.jsonl").read_text().splitlines()
    (candidate / "metrics.jsonl").write_text("\n".join(lines[:34] + lines[35:]) + "\n")
    verdict = verdict_of(reference, candidate)
    assert (
        gate(verdict, "completed").detail == "fp8 metrics.jsonl lacks step 35; the log is damaged"
    )
    loss = gate(verdict, "loss_gap")
    assert not loss.passed and loss.detail == (
        "the candidate's last evaluation (step 40) has no reference evaluation after equal "
        "tokens; the last matched one is at step 30"
    )
    assert not verdict.passed


def answer_other_items(run: Path, shift: int) -> None:
    """Re-record the run's capability at step 40 with the held-out items' indices shifted."""
    predictions = [
        {
            "index": i + shift,
            "key": f"item-{i}",
            "prompt": f"q{i}",
            "answer": "a",
            "generated": "b" if i < 30 else "a",
            "correct": i >= 30,
            "buckets": item_buckets(i),
        }
        for i in range(ITEMS)
    ]
    write_capability(run, STEPS, predictions, seconds=1.0)


def test_capability_items_that_do_not_pair_up_fail_the_bucket_gate(tmp_path):
    reference, candidate = pair(tmp_path)
    answer_other_items(candidate, shift=1000)  # 30 of 66 wrong, but on other items
    bucket = gate(verdict_of(reference, candidate), "bucket_accuracy_gap")
    assert not bucket.passed and bucket.detail == (
        "the runs answered different held-out items at step 40 (0 of 132 in both): evaluate "
        "the same items (capability.items, the data's eval split)"
    )


def test_an_unknown_accuracy_fails_the_bucket_gate_without_a_traceback(tmp_path):
    reference, candidate = pair(tmp_path)
    log = candidate / "capability.jsonl"
    lines = log.read_text().splitlines()
    last = json.loads(lines[-1])
    lines[-1] = json.dumps({**last, "accuracy": None})
    log.write_text("\n".join(lines) + "\n")
    bucket = gate(verdict_of(reference, candidate), "bucket_accuracy_gap")
    assert not bucket.passed and "unknown in overall" in bucket.detail


def test_a_reference_whose_held_out_loss_is_not_finite_is_not_clean(tmp_path):
    reference = make_run(tmp_path / "bf16", fp8=False)
    lines = (reference / "eval.jsonl").read_text().splitlines()
    lines[-1] = json.dumps({**json.loads(lines[-1]), "loss": math.nan})
    (reference / "eval.jsonl").write_text("\n".join(lines) + "\n")
    verdict = verdict_of(reference, make_run(tmp_path / "fp8"))
    ref = gate(verdict, "reference")
    assert not ref.passed and "held-out loss not finite at step 40 (eval.jsonl)" in ref.detail


def test_resume_continuity(tmp_path):
    reference = make_run(tmp_path / "bf16", fp8=False)
    smooth = gate(
        verdict_of(reference, make_run(tmp_path / "a", resume_at=20)), "resume_continuity"
    )
    # The loss keeps falling across the resume (-0.2 over the windows), as the reference's does.
    assert smooth.passed and smooth.value == pytest.approx(0.0, abs=1e-9)
    assert smooth.detail == "resumed at step 20, steps contiguous; largest loss change 0 <= 0.1"

    # The whole jump counts, not the jump less the fall the loss would have made anyway (0.3).
    jump = gate(
        verdict_of(reference, make_run(tmp_path / "b", resume_at=20, loss_jump=0.5)),
        "resume_continuity",
    )
    assert not jump.passed and jump.value == pytest.approx(0.5) and jump.threshold == 0.1
    assert jump.detail == (
        "resume: mean loss rose 0.5 > 0.1 more than the reference's over the 10 steps after the "
        "resume at step 20 (step_00000020)"
    )
    small = gate(
        verdict_of(reference, make_run(tmp_path / "s", resume_at=20, loss_jump=0.25)),
        "resume_continuity",
    )
    assert not small.passed  # under the fall of the loss (0.2 over the windows), once hidden

    unrecorded = make_run(tmp_path / "c", resume_at=20, resume_event=False)
    detail = gate(verdict_of(reference, unrecorded), "resume_continuity").detail
    assert detail == "resume: training continued after step 20 with no resumed event"

    holes = make_run(tmp_path / "d", resume_at=20)
    lines = (holes / "metrics.jsonl").read_text().splitlines()
    (holes / "metrics.jsonl").write_text("\n".join(lines[:20] + lines[23:]) + "\n")
    detail = gate(verdict_of(reference, holes), "resume_continuity").detail
    assert detail == "resume: metrics.jsonl lacks steps 21, 22, 23"

    off = make_run(
        tmp_path / "e",
        resume_at=20,
        loss_jump=0.5,
        changes={"gates.require_resume_continuity": False},
    )
    assert gate(verdict_of(reference, off, gates_from=off), "resume_continuity").passed


def test_a_reference_that_resumed_at_the_same_step_is_no_baseline_for_the_jump(tmp_path):
    """Both resumed at step 20 with the same jump: the reference's change would cancel the
    candidate's, so the candidate's own change is judged."""
    reference = make_run(tmp_path / "bf16", fp8=False, resume_at=20, loss_jump=0.5)
    resume = gate(
        verdict_of(reference, make_run(tmp_path / "fp8", resume_at=20, loss_jump=0.5)),
        "resume_continuity",
    )
    assert not resume.passed and resume.value == pytest.approx(0.3)


def test_a_completed_candidate_is_judged_on_its_last_capability_evaluation(tmp_path):
    """A final capability evaluation that failed (capability_failed) must not leave the gate
    judging an earlier one."""
    reference, candidate = pair(tmp_path)
    log = candidate / "capability.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:-1]))
    bucket = gate(verdict_of(reference, candidate), "bucket_accuracy_gap")
    assert not bucket.passed and bucket.detail.startswith(
        f"no capability evaluation of both runs at the last step ({STEPS}) with equal tokens"
    )


def test_a_broken_reference_fails_every_candidate(tmp_path, cli):
    reference = make_run(
        tmp_path / "bf16", fp8=False, state="failed", last_step=30, edits={12: {"loss": math.inf}}
    )
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    result = cli("compare", reference, a, b, "--no-png")
    assert result.code == 1, result.out + result.err
    problem = (
        f"reference bf16 is not clean: bf16 status failed at step 30 of {STEPS}: RuntimeError: "
        "CUDA error: an illegal memory access; bf16 non-finite: loss or grad_norm at step 12"
    )
    assert f"a: FAIL: {problem}" in result.out and f"b: FAIL: {problem}" in result.out
    document = json.loads((tmp_path / "compare-bf16-vs-a-b" / "verdict.json").read_text())
    assert document["reference"]["clean"] is False and len(document["reference"]["problems"]) == 2


# --------------------------------------------------------------------------------------
# The worst layer
# --------------------------------------------------------------------------------------


def test_worst_layer_is_the_fp8_module_worst_over_the_last_quarter(tmp_path):
    # EARLY_WORST has the largest error of the run, but before the last quarter (steps 31-40);
    # a module kept in BF16 reports the largest number of all but never ran FP8.
    kept = ("decoder.layers.0.mlp.linear_fc1",)
    reference, candidate = pair(tmp_path, kept_bf16=kept, alerts=[underflow_alert()])
    layer = verdict_of(reference, candidate).worst_layer
    assert layer["module"] == WORST
    assert layer["fp8_error"] == pytest.approx(0.3) and layer["error_samples"] == 2
    assert layer["steps"] == [31, 40] and layer["error_steps"] == [31, 40]
    assert layer["underflow"] == {
        "input": pytest.approx(0.01),
        "weight": pytest.approx(0.63),
        "grad_output": pytest.approx(0.01),
    }
    assert layer["saturation"]["input"] == pytest.approx(0.001)
    assert [a["step"] for a in layer["alerts"]] == [35]


def test_no_worst_layer_without_fp8_telemetry(tmp_path):
    reference, candidate = pair(tmp_path, telemetry=False)
    assert verdict_of(reference, candidate).worst_layer is None


# --------------------------------------------------------------------------------------
# Bad and non-comparable input: exit 2, with the path and what to do
# --------------------------------------------------------------------------------------


def damage_metrics(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[4] = lines[4][:30]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def drop_field(run: Path, name: str, field: str) -> None:
    records = [json.loads(line) for line in (run / name).read_text().splitlines()]
    records[2].pop(field)
    write_jsonl(run / name, records)


def tamper_predictions(run: Path) -> None:
    file = run / "capability" / "step_00000040.jsonl"
    file.write_text(file.read_text().replace('"correct": false', '"correct": true'))


BAD_INPUTS = {
    "missing": (lambda fp8: shutil.rmtree(fp8), "{fp8}: no such directory; give run directories"),
    "not a run": (
        lambda fp8: [p.unlink() for p in fp8.glob("*.json*") if p.is_file()],
        "{fp8}: not an fp8ops run directory (no status.json)",
    ),
    "damaged metrics": (
        damage_metrics,
        "{fp8}/metrics.jsonl:5: not valid JSON (",  # (what the parser said); the file is damaged
    ),
    "metrics field": (
        lambda fp8: drop_field(fp8, "metrics.jsonl", "tokens"),
        "{fp8}/metrics.jsonl: record 3: no 'tokens' field; the file is damaged",
    ),
    "damaged run.json": (
        lambda fp8: (fp8 / "run.json").write_text("{"),
        "{fp8}/run.json: cannot be read",
    ),
    "another run's run.json": (
        lambda fp8: shutil.copy(
            make_run(fp8.parent / "other", changes={"optimizer.lr": 1e-3}) / "run.json",
            fp8 / "run.json",
        ),
        "{fp8}/run.json: manifest is ",
    ),
    "edited manifest": (
        lambda fp8: (fp8 / "manifest.yaml").write_text(
            (fp8 / "manifest.yaml").read_text().replace("margin: 0", "margin: 1")
        ),
        "{fp8}/manifest.yaml hashes to ",
    ),
    "no layers.json": (
        lambda fp8: (fp8 / "layers.json").unlink(),
        "{fp8}/layers.json: no such file",
    ),
    "damaged manifest": (
        lambda fp8: (fp8 / "manifest.yaml").write_text("name: [\n"),
        "{fp8}/manifest.yaml",
    ),
    "no evaluation": (
        lambda fp8: (fp8 / "eval.jsonl").unlink(),
        "{fp8}/eval.jsonl: no evaluation recorded (status completed at step 40); "
        + "compare judges held-out loss, so train with data.eval_fraction > 0",
    ),
    "tampered predictions": (tamper_predictions, "{fp8}/capability/step_00000040.jsonl: sha256"),
    "damaged telemetry": (
        lambda fp8: (fp8 / "telemetry.zarr" / "zarr.json").write_text("{"),
        "{fp8}/telemetry.zarr/zarr.json cannot be read",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_naming_the_file(tmp_path, cli, case):
    reference, candidate = pair(tmp_path)
    damage, message = BAD_INPUTS[case]
    damage(candidate)
    result = cli("compare", reference, candidate, "--no-png")
    assert result.code == 2, result.out + result.err
    assert message.format(fp8=candidate) in result.err
    assert not (tmp_path / "compare").exists()  # nothing written for bad input


def test_one_run_or_a_mixed_input_is_refused(tmp_path, cli):
    reference = make_run(tmp_path / "bf16", fp8=False)
    result = cli("compare", reference, "--no-png")
    assert result.code == 2 and "compare needs a reference and at least one candidate" in result.err
    dual = tmp_path / "dual"
    dual.mkdir()
    (dual / "dualtrack.json").write_text("{}")
    result = cli("compare", reference, dual)
    assert result.code == 2 and "is a dual-track directory (dualtrack.json); give it alone" in (
        result.err
    )


NOT_COMPARABLE = {
    "data": (
        {"fingerprint": "ab" * 32},
        "run.json data.fingerprint is abababababab..., the reference {ref} has c8c8c8c8c8c8...",
    ),
    "seed": ({"data_seed": 7}, "run.json seeds.data is 7, the reference {ref} has 1234"),
    "batch": (
        {"changes": {"schedule.global_batch_size": 32}},
        "manifest.yaml schedule.global_batch_size is 32, the reference {ref} has 16",
    ),
    "tokens": (
        {"edits": {7: {"tokens": 1024}}},
        "metrics.jsonl step 7 has tokens 1024, the reference {ref} has 512",
    ),
    "length": (
        {"changes": {"schedule.train_steps": 20}, "last_step": 20},
        "manifest.yaml schedule.train_steps is 20, the reference {ref} has 40",
    ),
    "weights": (
        {"initial_weights": "0f" * 32},
        (
            "run.json model.initial_weights_fingerprint is 0f0f0f0f0f0f..., the "
            "reference {ref} started from 1e1e1e1e1e1e..."
        ),
    ),
}


def test_a_candidate_is_judged_by_the_references_bar_not_a_looser_one_of_its_own(tmp_path, cli):
    """A loss gap of 0.034 fails the runs' 0.01. A candidate that wrote itself a 0.05 bar is not
    judged by it: the gates differ and nothing is written, until one bar is given (--gates)."""
    reference = make_run(tmp_path / "bf16", fp8=False)
    candidate = make_run(tmp_path / "fp8", eval_shift=0.034, changes={"gates.loss_gap": 0.05})
    out = tmp_path / "out"
    result = cli("compare", reference, candidate, "--out", out, "--no-png")
    assert result.code == 2, result.out + result.err
    assert (
        f"{candidate}: manifest.yaml gates.loss_gap is 0.05, the reference has 0.01 "
        f"({reference}); every candidate is judged by one bar: give it with --gates "
        "MANIFEST"
    ) in result.err
    assert not out.exists()

    result = cli(
        "compare",
        reference,
        candidate,
        "--out",
        out,
        "--no-png",
        "--gates",
        reference / "manifest.yaml",
    )
    assert result.code == 1, result.out + result.err
    assert "loss gap 0.034 > 0.01" in result.out
    document = json.loads((out / "verdict.json").read_text())
    assert document["gates"]["source"] == str(reference / "manifest.yaml")
    digest = hashlib.sha256((reference / "manifest.yaml").read_bytes()).hexdigest()
    assert document["gates"]["file_sha256"] == digest
    assert document["gates"]["loss_gap"] == 0.01

    result = cli(
        "compare",
        reference,
        candidate,
        "--out",
        out,
        "--no-png",
        "--gates",
        candidate / "manifest.yaml",
    )
    assert result.code == 0, result.out + result.err  # the bar given decides, and is recorded
    assert json.loads((out / "verdict.json").read_text())["gates"]["loss_gap"] == 0.05


def test_a_gates_manifest_that_cannot_be_read_is_refused_by_name(tmp_path, cli):
    reference, candidate = pair(tmp_path)
    bad = tmp_path / "gates.yaml"
    text = BASE_MANIFEST.read_text()
    assert "loss_gap: 0.03" in text
    bad.write_text(text.replace("loss_gap: 0.03", "loss_gap: -1"))
    out = tmp_path / "out"
    no_gates = tmp_path / "no-gates.yaml"
    no_gates.write_text(re.sub(r"(?ms)^gates:\n(  .*?\n|\n)*(?=^\S)", "", text))
    assert "gates:" not in no_gates.read_text()
    for given, message in (
        (tmp_path / "missing.yaml", "missing.yaml: no such file"),
        (bad, f"{bad}: gates.loss_gap"),
        (
            no_gates,
            (
                f"{no_gates}: --gates: the manifest writes no gates "
                "section, so fp8ops' defaults would judge"
            ),
        ),
    ):
        result = cli("compare", reference, candidate, "--out", out, "--no-png", "--gates", given)
        assert result.code == 2 and message in result.err, result.out + result.err
        assert not out.exists()


@pytest.mark.parametrize("case", list(NOT_COMPARABLE))
def test_runs_that_saw_other_data_are_not_compared(tmp_path, cli, case):
    kwargs, message = NOT_COMPARABLE[case]
    reference, candidate = pair(tmp_path, **kwargs)
    result = cli("compare", reference, candidate, "--no-png")
    assert result.code == 2, result.out + result.err
    assert f"{candidate}: {message.format(ref=reference)}" in result.err


# --------------------------------------------------------------------------------------
# The dual-track directory
# --------------------------------------------------------------------------------------


def test_a_dualtrack_directory_whose_candidate_failed_is_judged_without_its_fallback(tmp_path, cli):
    """The candidate failed (an error, retried by the next invocation), so the fallback track
    never started: the candidate is judged, and fails, instead of the directory being refused."""
    dual = tmp_path / "dual"
    make_run(dual / "bf16", fp8=False)
    make_run(dual / "fp8", state="failed", last_step=15)
    write_json(
        dual / "dualtrack.json",
        {
            "manifest": "ab" * 32,
            "tracks": [
                {"label": "bf16", "run_dir": "bf16", "role": "control", "status": "completed"},
                {"label": "fp8", "run_dir": "fp8", "role": "candidate", "status": "failed"},
            ],
        },
    )
    result = cli("compare", dual, "--no-png")
    assert result.code == 1, result.out + result.err
    assert "fp8 status failed at step 15" in result.out + result.err


def test_a_dualtrack_directory_compares_its_tracks(tmp_path, cli):
    dual = tmp_path / "dual"
    make_run(dual / "bf16", fp8=False)
    make_run(dual / "fp8", eval_shift=0.05)
    fallback = {WORST: "high underflow in the candidate track"}
    make_run(dual / "fp8-fallback", kept_bf16=(WORST,))
    write_json(
        dual / "dualtrack.json",
        {
            "manifest": "ab" * 32,
            "tracks": [
                {"label": "fp8", "run_dir": "fp8", "role": "candidate"},
                {"label": "bf16", "run_dir": "bf16", "role": "control"},
                {
                    "label": "fp8-fallback",
                    "run_dir": "fp8-fallback",
                    "role": "candidate",
                    "fallback_modules": fallback,
                },
            ],
        },
    )
    result = cli("compare", dual, "--no-png")
    assert result.code == 1, result.out + result.err
    assert "reference: bf16" in result.out
    assert "fp8: FAIL: loss gap 0.05 > 0.01" in result.out and "fp8-fallback: pass" in result.out
    document = json.loads((dual / "compare" / "verdict.json").read_text())
    fp8, kept = document["candidates"]
    assert (fp8["label"], kept["label"]) == ("fp8", "fp8-fallback")
    assert kept["run_dir"] == str(dual / "fp8-fallback") and kept["fallback_modules"] == fallback
    assert (fp8["fp8_modules"], kept["fp8_modules"]) == (len(MODULES), len(MODULES) - 1)
    assert kept["worst_layer"]["module"] != WORST  # BF16 there: not an FP8 module
    assert "kept in BF16: " + WORST in (dual / "compare" / "report.html").read_text()


def test_a_skipped_dualtrack_track_is_left_out(tmp_path):
    dual = tmp_path / "dual"
    make_run(dual / "bf16", fp8=False)
    make_run(dual / "fp8")
    write_json(
        dual / "dualtrack.json",
        {
            "tracks": [
                {"label": "bf16", "run_dir": "bf16", "role": "control", "status": "completed"},
                {"label": "fp8", "run_dir": "fp8", "role": "candidate", "status": "completed"},
                {
                    "label": "fp8-fallback",
                    "run_dir": "fp8-fallback",
                    "role": "candidate",
                    "status": "skipped",
                    "note": "no high-risk modules",
                },
            ]
        },
    )
    tracks, found = resolve_tracks([dual])
    assert found == dual and [t.label for t in tracks] == ["bf16", "fp8"]


def test_a_damaged_dualtrack_file_is_refused(tmp_path, cli):
    dual = tmp_path / "dual"
    make_run(dual / "bf16", fp8=False)
    tracks = [
        {"label": "bf16", "run_dir": "bf16", "role": "control"},
        {"label": "fp8", "run_dir": "fp8", "role": "candidate"},
        {
            "label": "fp8-fallback",
            "run_dir": "fp8-fallback",
            "role": "candidate",
            "status": "skipped",
        },
    ]
    write_json(dual / "dualtrack.json", {"tracks": tracks})
    result = cli("compare", dual)
    assert result.code == 2
    assert f"{dual / 'dualtrack.json'}: tracks[1].run_dir: {dual / 'fp8'} does not exist" in (
        result.err
    )
    # An evaluation interrupted in its third track, or before it, is not judged on two.
    make_run(dual / "fp8")
    write_json(dual / "dualtrack.json", {"tracks": tracks[:2]})
    result = cli("compare", dual)
    assert result.code == 2 and "the fp8-fallback track has not started" in result.err
    write_json(
        dual / "dualtrack.json", {"tracks": [*tracks[:2], {**tracks[2], "status": "running"}]}
    )
    result = cli("compare", dual)
    assert result.code == 2 and "the fp8-fallback track is running" in result.err


# --------------------------------------------------------------------------------------
# PNG export
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs /usr/bin/chromium")
@pytest.mark.slow
def test_png_export_writes_the_main_plots(tmp_path, cli):
    reference, candidate = pair(tmp_path, resume_at=20)
    result = cli("compare", reference, candidate, "--out", tmp_path / "out")
    assert result.code == 0, result.out + result.err
    for name in ("loss", "buckets", "layers"):
        png = tmp_path / "out" / "png" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert str(png) in result.out


def test_without_a_browser_png_export_fails_but_the_verdict_decides(tmp_path, cli, monkeypatch):
    """A GPU node without Chromium still gates: a warning, and the verdict's exit code."""
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-chromium"))
    reference, candidate = pair(tmp_path)
    result = cli("compare", reference, candidate, "--out", tmp_path / "out")
    assert result.code == 0
    assert "warning: no PNGs: " in result.err
    assert "PNG export failed (RuntimeError: Kaleido requires Google Chrome" in result.err
    assert "report.html and verdict.json are written. Pass --no-png to skip PNGs" in result.err
    assert "verdict: PASS" in result.out  # the verdict was still printed
    assert (tmp_path / "out" / "report.html").exists()
    assert json.loads((tmp_path / "out" / "verdict.json").read_text())["verdict"] == "pass"


def test_without_kaleido_png_export_says_so(tmp_path, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "kaleido", None)  # importlib finds no kaleido
    reference, candidate = pair(tmp_path)
    result = cli("compare", reference, candidate, "--out", tmp_path / "out")
    assert result.code == 0 and "PNG export needs kaleido" in result.err
    assert "Pass --no-png" in result.err and (tmp_path / "out" / "report.html").exists()


def test_compare_runs_without_torch_and_help_without_plotly(tmp_path):
    reference, candidate = pair(tmp_path)
    compare_only = (
        "import sys; from pathlib import Path; from fp8ops.compare.comparison import compare\n"
        f"compare([Path({str(reference)!r}), Path({str(candidate)!r})], png=False)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'megatron', 'transformer_engine')))"
    )
    help_only = "import sys, fp8ops.cli; print(sorted({'plotly', 'kaleido'} & set(sys.modules)))"
    for code in (compare_only, help_only):
        found = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert found == "[]"


def test_initial_weights_fingerprinted_under_two_schemes_are_not_compared(tmp_path, cli):
    """An older run's fingerprint names parameters by module path, a newer one's by checkpoint
    key (checkpoint/weights.py): the two differ for the same weights, so they say nothing."""
    reference, candidate = pair(tmp_path, initial_weights="0f" * 32)
    info = json.loads((candidate / "run.json").read_text())
    info["model"]["initial_weights_fingerprint_scheme"] = "checkpoint-keys"
    write_json(candidate / "run.json", info)
    result = cli("compare", reference, candidate, "--no-png")
    assert "initial_weights_fingerprint" not in result.err, result.err
    assert result.code in (0, 1)  # judged, not refused
    info["model"]["initial_weights_fingerprint_scheme"] = "parameter-names"  # as the reference
    write_json(candidate / "run.json", info)
    assert cli("compare", reference, candidate, "--no-png").code == 2


def test_recipes_rank_passing_first_then_by_loss_gap():
    from fp8ops.compare.gates import CandidateVerdict, GateResult
    from fp8ops.compare.recipes import rank_recipes

    def candidate(label, gap, passed=True):
        gates = [
            GateResult("loss_gap", passed, gap, 0.05, ""),
            GateResult("finite", True, None, None, ""),
        ]
        return CandidateVerdict(label, "run", "0" * 64, 4, gates, [], None, None, None)

    candidates = [
        candidate("a", 0.03),
        candidate("b", -0.02),
        candidate("d", 0.01),
        candidate("c", 0.01, passed=False),
    ]
    scalings = {"a": "delayed", "b": "mxfp8", "c": "block", "d": "current"}
    rows = rank_recipes(candidates, scalings)
    # a negative gap (lower loss than the reference) ranks above a small positive one
    assert [(r.label, r.rank) for r in rows] == [("b", 1), ("d", 2), ("a", 3), ("c", 4)]
    assert rows[3].failed_gates == ("loss_gap",)
    assert rows[0].published == {"H200": None, "B300": 1.42}  # MXFP8 is not Hopper's
    assert rank_recipes([candidate("a", 0.0)], {"a": "delayed"}) == []  # one recipe: no ranking

    # Alerts come after the gates, before the gap: a Degrade outweighs any number of Observes.
    def alert(level):
        return Alert(1, level, "saturation", "m", "input.saturation", 0.1, 0.01, "message")

    alerts = {"b": [alert("degrade")], "d": [alert("observe")] * 5}
    rows = rank_recipes(candidates, scalings, alerts=alerts, gpu="H200")
    assert [r.label for r in rows] == ["d", "a", "b", "c"]
    assert rows[0].alerts == {"stop": 0, "degrade": 0, "observe": 5}
    assert rows[2].alerts["degrade"] == 1
    assert rows[0].published == {"H200": 1.58}  # the target GPU's only
    with pytest.raises(ValueError, match="known: H200, B300"):
        rank_recipes(candidates, scalings, gpu="A100")
