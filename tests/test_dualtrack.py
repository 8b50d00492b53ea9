"""``fp8ops dualtrack``: three tracks from one manifest on the same data and tokens, resumable,
the third track's modules chosen from the candidate's run; and ``fp8ops compare`` on them:
a clean FP8 candidate passes the gates, a damaged one fails naming the cause."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.alerts import Alert, write_alerts
from fp8ops.dualtrack.run import _train_fallback
from fp8ops.dualtrack.tracks import (
    CANDIDATE,
    Track,
    check_fallback_globs,
    fallback_modules,
    recipe_manifest,
)
from fp8ops.errors import ManifestError
from fp8ops.manifest import diff_manifests, load_manifest, manifest_hash
from fp8ops.run import read_metrics, read_status
from fp8ops.run.records import AdmissionRow, RecipeRecord, table_hash
from fp8ops.train.signals import REQUEUE_EXIT

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

LAYERS = 3  # first and last fall back; the middle one stays FP8 in every FP8 track
SHORT = {
    **SMALL_MODEL,
    **SCHEDULE,
    "model.num_layers": LAYERS,
    "model.init_checkpoint": None,
    "data.num_examples": 400,
    "schedule.train_steps": 12,
    "schedule.eval_interval": 6,
    "schedule.checkpoint_interval": 6,
    "capability.items": 16,
    "capability.max_new_tokens": 8,
}
TRACKS = ("bf16", "fp8", "fp8-fallback")
# How long a dualtrack process may take, against a hang only: tens of seconds here, and a
# machine twice as slow running other tests beside it takes four times that.
HANG_S = 600


@pytest.fixture(scope="module")
def short_manifest(tmp_path_factory) -> Path:
    return write_derived(
        tmp_path_factory.mktemp("dualtrack") / "short.yaml", MANIFESTS / "tiny-gpt-cpu.yaml", SHORT
    )


@pytest.fixture(scope="module")
def short_dualtrack(short_manifest, tmp_path_factory) -> Path:
    """A dual-track evaluation preempted (SIGUSR1, as SLURM signals before a time limit) while
    training the candidate, which checkpoints and exits 75; then run again to the end."""
    out = tmp_path_factory.mktemp("short") / "dt"
    command = [
        sys.executable,
        "-m",
        "fp8ops",
        "dualtrack",
        str(short_manifest),
        "--out",
        str(out),
        "--no-compare",
        "--no-progress",
    ]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + HANG_S
    while not (out / "fp8" / "metrics.jsonl").exists() and first.poll() is None:
        assert time.monotonic() < deadline, "the candidate track never started"
        time.sleep(0.02)
    first.send_signal(signal.SIGUSR1)
    output, _ = first.communicate(timeout=HANG_S)
    assert first.returncode == REQUEUE_EXIT, output
    assert read_status(out / "fp8").state == "interrupted"
    assert not (out / "fp8-fallback").exists()
    second = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert second.returncode == 0, second.stdout + second.stderr
    return out


@pytest.mark.slow
def test_tracks_differ_only_in_precision(short_manifest, short_dualtrack):
    source = load_manifest(short_manifest)
    plan = json.loads((short_dualtrack / "dualtrack.json").read_text())
    assert [t["label"] for t in plan["tracks"]] == list(TRACKS)
    assert [t["status"] for t in plan["tracks"]] == ["completed"] * 3
    for track in plan["tracks"]:
        locked = load_manifest(short_dualtrack / track["run_dir"] / "manifest.yaml")
        assert track["manifest"] == manifest_hash(
            load_manifest(short_dualtrack / track["manifest_file"])
        )
        changed = {c.path.split(".")[0] for c in diff_manifests(source, locked)}
        assert changed <= {"precision", "revision"}, (track["label"], changed)
    control = load_manifest(short_dualtrack / "bf16" / "manifest.yaml")
    assert not control.precision.enabled
    layers = json.loads((short_dualtrack / "bf16" / "layers.json").read_text())
    assert not [row["fqn"] for row in layers["rows"] if row["precision"] == "fp8"]


@pytest.mark.slow
def test_tracks_see_the_same_data_and_tokens(short_dualtrack):
    runs = [short_dualtrack / label for label in TRACKS]
    data = {json.loads((run / "run.json").read_text())["data"]["fingerprint"] for run in runs}
    assert len(data) == 1
    tokens = [[(m.step, m.tokens, m.loss_tokens) for m in read_metrics(run)] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert [t[0] for t in tokens[0]] == list(range(1, SHORT["schedule.train_steps"] + 1))
    evaluated = [
        [e["step"] for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())]
        for run in runs
    ]
    assert evaluated[0] == evaluated[1] == evaluated[2] == [6, 12]
    # FP8 changes the numbers: the tracks are really different runs.
    losses = [read_metrics(run)[-1].loss for run in runs]
    assert losses[0] != losses[1]


@pytest.mark.slow
def test_the_interrupted_candidate_resumed_from_its_checkpoint(short_dualtrack):
    events = [json.loads(line) for line in (short_dualtrack / "fp8" / "events.jsonl").open()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 1 and 1 <= resumed[0]["step"] < SHORT["schedule.train_steps"]
    assert read_status(short_dualtrack / "fp8").state == "completed"


@pytest.mark.slow
def test_the_fallback_track_keeps_the_first_and_last_layers_in_bf16(short_dualtrack):
    plan = json.loads((short_dualtrack / "dualtrack.json").read_text())
    modules = plan["tracks"][2]["fallback_modules"]
    layers = {name.split(".")[2] for name in modules}
    assert layers == {"0", str(LAYERS - 1)} and len(modules) == 8
    rows = json.loads((short_dualtrack / "fp8-fallback" / "layers.json").read_text())["rows"]
    precision = {row["fqn"]: (row["precision"], row["reason"]["code"]) for row in rows}
    for name in modules:
        assert precision[name] == ("bf16", "override")
    middle = [n for n in precision if n.startswith("decoder.layers.1.") and ".linear_" in n]
    assert len(middle) == 4 and all(precision[n][0] == "fp8" for n in middle)


@pytest.mark.slow
def test_running_it_again_changes_nothing(cli, short_manifest, short_dualtrack):
    before = {label: (short_dualtrack / label / "metrics.jsonl").read_bytes() for label in TRACKS}
    result = cli(
        "dualtrack", short_manifest, "--out", short_dualtrack, "--no-compare", "--no-progress"
    )
    assert result.code == 0, result.err
    for label in TRACKS:
        assert (short_dualtrack / label / "metrics.jsonl").read_bytes() == before[label]


@pytest.mark.slow
def test_a_stop_request_between_tracks_ends_the_command_with_exit_75(
    cli, short_manifest, short_dualtrack
):
    (short_dualtrack / "stop.request").write_text("test\n")
    result = cli(
        "dualtrack", short_manifest, "--out", short_dualtrack, "--no-compare", "--no-progress"
    )
    assert result.code == REQUEUE_EXIT
    assert "stopped between two tracks (stop.request in the run directory)" in result.err
    assert not (short_dualtrack / "stop.request").exists()  # answered
    again = cli(
        "dualtrack", short_manifest, "--out", short_dualtrack, "--no-compare", "--no-progress"
    )
    assert again.code == 0, again.err


@pytest.mark.slow
def test_another_manifest_is_refused_for_an_existing_dual_track_dir(
    cli, short_manifest, short_dualtrack, tmp_path
):
    other = write_derived(tmp_path / "other.yaml", short_manifest, {"optimizer.lr": 1e-3})
    result = cli("dualtrack", other, "--out", short_dualtrack, "--no-progress")
    assert result.code == 2
    assert "holds the dual-track evaluation of manifest" in result.err
    assert str(short_dualtrack / "tracks" / "source.yaml") in result.err
    plain = tmp_path / "not-dualtrack"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine\n")
    result = cli("dualtrack", short_manifest, "--out", plain, "--no-progress")
    assert result.code == 2 and "not a dual-track directory" in result.err
    assert (plain / "notes.txt").read_text() == "mine\n"


def test_a_bf16_manifest_has_no_candidate(cli, short_manifest, tmp_path):
    bf16 = write_derived(tmp_path / "bf16.yaml", short_manifest, {"precision.enabled": False})
    result = cli("dualtrack", bf16, "--out", tmp_path / "dt", "--no-progress")
    assert result.code == 2
    assert "precision.enabled" in result.err and "no FP8 candidate" in result.err
    assert not (tmp_path / "dt").exists()  # refused before anything was written


def test_a_world_of_the_wrong_size_is_refused_before_anything_is_written(
    cli, short_manifest, tmp_path, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = cli("dualtrack", short_manifest, "--out", tmp_path / "dt", "--no-progress")
    assert result.code == 2 and "this job has 2 process(es) but topology asks for 1" in result.err
    assert not (tmp_path / "dt").exists()


def test_a_track_whose_gemms_the_device_lacks_is_refused_before_anything_is_written(
    cli, short_manifest, tmp_path, monkeypatch
):
    """The block track would train last; its refusal comes before the control trains."""
    from fp8ops.megatron import model

    monkeypatch.setattr(model, "block_scaled_mm_unsupported", lambda device: "an old cuBLAS")
    native = write_derived(
        tmp_path / "native.yaml", short_manifest, {"precision.backend": "scaled_mm"}
    )
    out = tmp_path / "dt"
    result = cli(
        "dualtrack", native, "--tracks", "bf16,delayed,block", "--out", out, "--no-progress"
    )
    assert result.code == 2
    assert (
        "precision.scaling 'block' on precision.backend 'scaled_mm' cannot run here: an old cuBLAS"
        in result.err
    )
    assert not out.exists()


def test_the_gemms_checked_are_those_of_the_fp8_tracks_that_train(short_manifest):
    from fp8ops.dualtrack.run import _fp8_tracks

    source = load_manifest(short_manifest)
    assert _fp8_tracks(source, {}) == [source]  # the candidate (and its fallback)
    current = recipe_manifest(source, "current")
    # --tracks bf16,current: the source's own recipe never trains
    assert _fp8_tracks(source, {"current": current}) == [current]


@pytest.mark.slow
def test_a_fallback_glob_typo_is_refused_before_the_candidate_trains(cli, short_manifest, tmp_path):
    typo = write_derived(
        tmp_path / "typo.yaml", short_manifest, {"dualtrack.fallback_modules": ["*.linear_fc3"]}
    )
    result = cli("dualtrack", typo, "--out", tmp_path / "dt", "--no-progress")
    assert result.code == 2
    assert "dualtrack.fallback_modules: '*.linear_fc3' matches none of the" in result.err
    assert (tmp_path / "dt" / "bf16" / "layers.json").exists()
    assert not (tmp_path / "dt" / "fp8").exists()


@pytest.mark.slow
def test_fallback_modules_come_from_alerts_and_globs(short_manifest, short_dualtrack, tmp_path):
    candidate = tmp_path / "fp8"
    shutil.copytree(short_dualtrack / "fp8", candidate)
    fc1 = "decoder.layers.1.mlp.linear_fc1"
    write_alerts(
        candidate,
        [
            Alert(4, "degrade", "saturation", fc1, "input.saturation", 0.2, 0.01, "saturated"),
            Alert(
                5,
                "observe",
                "scale_change",
                "decoder.layers.1.mlp.linear_fc2",
                "scale_change",
                9.0,
                4.0,
                "moved",
            ),
        ],
    )
    source = load_manifest(short_manifest)
    only_alerts = _rule(source, fallback_first_last=False)
    assert fallback_modules(only_alerts, candidate) == {
        fc1: "dual-track: degrade alert saturation at step 4 in the FP8 candidate"
    }
    by_glob = _rule(only_alerts, fallback_alerted=False, fallback_modules=("*.1.self_attention.*",))
    assert sorted(fallback_modules(by_glob, candidate)) == [
        "decoder.layers.1.self_attention.linear_proj",
        "decoder.layers.1.self_attention.linear_qkv",
    ]
    # A module an approved override moved to BF16 during the candidate's run (its layers.json
    # is the latest resume's) still ran FP8 before that: it is still chosen.
    layers = json.loads((candidate / "layers.json").read_text())
    row = next(r for r in layers["rows"] if r["fqn"] == fc1)
    override = {"code": "override", "text": "approved override (ledger)"}
    row.update(precision="bf16", formats=None, reason=override)
    if row.get("gemms") is not None:  # a module override moves all three GEMMs
        row["gemms"] = {g: {"precision": "bf16", "reason": override} for g in row["gemms"]}
    rows = tuple(AdmissionRow.model_validate(r) for r in layers["rows"])
    layers["table_hash"] = table_hash(rows, RecipeRecord.model_validate(layers["recipe"]))
    (candidate / "layers.json").write_text(json.dumps(layers))
    assert list(fallback_modules(only_alerts, candidate)) == [fc1]
    typo = _rule(by_glob, fallback_modules=("*.linear_fc3",))
    with pytest.raises(ManifestError, match=r"dualtrack.fallback_modules: '\*.linear_fc3'"):
        fallback_modules(typo, candidate)


@pytest.mark.slow
def test_a_fallback_glob_naming_only_modules_the_candidate_keeps_in_bf16_is_refused_early(
    short_manifest, short_dualtrack
):
    """Checked against the control's layers.json before the candidate trains: found after,
    fixing the glob changes the source manifest and costs the tracks already trained."""
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    source = load_manifest(short_manifest)
    excluded = source.model_copy(
        update={
            "precision": source.precision.model_copy(update={"exclude_modules": (fc2,)}),
            "dualtrack": source.dualtrack.model_copy(update={"fallback_modules": (fc2,)}),
        }
    )
    with pytest.raises(ManifestError, match="matches none of the 11 modules the candidate will"):
        check_fallback_globs(excluded, short_dualtrack / "bf16")
    check_fallback_globs(_rule(source, fallback_modules=(fc2,)), short_dualtrack / "bf16")


@pytest.mark.slow
def test_a_fallback_that_would_hold_every_fp8_module_is_skipped(
    short_manifest, short_dualtrack, tmp_path
):
    out = tmp_path / "dt"
    shutil.copytree(short_dualtrack / "fp8", out / "fp8")
    (out / "tracks").mkdir()
    candidate = Track(CANDIDATE, "candidate", out / "tracks" / "fp8.yaml", out / "fp8")
    source = _rule(load_manifest(short_manifest), fallback_modules=("*",))
    outcome = _train_fallback(source, out, candidate, False, {"tracks": []})
    assert outcome.status == "skipped"
    assert outcome.note.startswith("the dualtrack rules choose all 12 of the candidate's FP8")
    assert not (out / "tracks" / "fp8-fallback.yaml").exists()
    assert not (out / "fp8-fallback").exists()  # nothing trained


def test_a_track_that_failed_is_recorded_failed_so_compare_judges_it(
    short_manifest, tmp_path, monkeypatch
):
    """Recorded "interrupted", compare DIR refused it as unfinished for as long as the failure
    repeated; "failed" is judged (and fails). The next invocation still retries it."""
    import fp8ops.train
    from fp8ops.dualtrack.run import _train

    def failing(manifest_file, run_dir, **_):
        run_dir.mkdir(parents=True)
        (run_dir / "status.json").write_text(json.dumps({"state": "failed", "error": "boom"}))
        raise RuntimeError("boom")

    monkeypatch.setattr(fp8ops.train, "run_training", failing)
    (tmp_path / "dt" / "tracks").mkdir(parents=True)
    manifest = shutil.copy(short_manifest, tmp_path / "dt" / "tracks" / "fp8.yaml")
    track = Track(CANDIDATE, "candidate", Path(manifest), tmp_path / "dt" / "fp8")
    plan = {"tracks": []}
    with pytest.raises(RuntimeError, match="boom"):
        _train(track, tmp_path / "dt", False, plan)
    assert [entry["status"] for entry in plan["tracks"]] == ["failed"]
    # An attempt that fails before its trainer writes anything leaves the last one's "failed"
    # in status.json: that attempt is interrupted, not failed.
    monkeypatch.setattr(fp8ops.train, "run_training", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _train(track, tmp_path / "dt", False, plan)
    assert [entry["status"] for entry in plan["tracks"]] == ["interrupted"]


def _rule(manifest, **fields):
    """``manifest`` with its dualtrack section changed (a test's shortcut; not a revision)."""
    return manifest.model_copy(update={"dualtrack": manifest.dualtrack.model_copy(update=fields)})


# -- the release gate on real tracks ------------------------------------------------------------

GATE = {
    **SHORT,
    "data.num_examples": 800,
    "schedule.train_steps": 30,
    "schedule.eval_interval": 10,
    "schedule.checkpoint_interval": 30,
    "schedule.eval_iters": 8,
    "optimizer.lr": 2e-3,
    "capability.items": 40,
    "telemetry.every_steps": 5,
    "telemetry.error_sample_every": 5,
    "gates.loss_gap": 0.01,  # the schema's default; the CPU default's 0.03 is for its lr 2e-3
}

# The damaged candidate's change: every FP8 tensor scaled 2**17 below what its amax allows.
DAMAGE = {"precision.margin": 17}


@pytest.fixture(scope="module")
def gate_dualtrack(tmp_path_factory) -> tuple[Path, int, str]:
    """The three tracks of a 30-step fine-tune, compared at the end (with PNGs)."""
    from fp8ops.cli import main

    tmp = tmp_path_factory.mktemp("gate")
    manifest = write_derived(tmp / "gate.yaml", MANIFESTS / "tiny-gpt-cpu.yaml", GATE)
    with pytest.raises(SystemExit) as done:
        main(["dualtrack", str(manifest), "--out", str(tmp / "dt"), "--no-progress"])
    return tmp / "dt", done.value.code or 0, str(manifest)


@pytest.mark.slow
def test_a_clean_fp8_candidate_passes_the_gate(gate_dualtrack):
    out, code, _ = gate_dualtrack
    verdict = json.loads((out / "compare" / "verdict.json").read_text())
    assert code == 0 and verdict["verdict"] == "pass", verdict
    assert [c["label"] for c in verdict["candidates"]] == ["fp8", "fp8-fallback"]
    for candidate in verdict["candidates"]:
        gates = {g["name"]: g for g in candidate["gates"]}
        assert abs(gates["loss_gap"]["value"]) <= 0.01
        assert gates["loss_gap"]["threshold"] == 0.01
        assert max(candidate["worst_layer"]["underflow"].values()) < 0.05
        # Capability ran in every track, on the same 40 items.
        assert candidate["capability"]["overall"]["items"] == 40
    report = (out / "compare" / "report.html").read_text()
    assert '<section id="loss">' in report and "plotly-graph-div" in report
    assert sorted(p.suffix for p in (out / "compare" / "png").iterdir()) == [".png"] * 3


@pytest.mark.slow
def test_a_damaged_fp8_candidate_fails_the_gate_naming_the_cause(cli, gate_dualtrack, tmp_path):
    """A margin of 17 binades maps a tensor's amax under two of E4M3's subnormal steps: most
    values of every FP8 tensor underflow and the held-out loss rises (measured: a gap of 0.028
    against the threshold's 0.01; at 16 binades the gap was 0.003, within the threshold). With
    the FP8-error Stop rule off, the run completes and only the gate stands between it and a
    release."""
    out, _, manifest = gate_dualtrack
    damaged = write_derived(
        tmp_path / "damaged.yaml",
        Path(manifest),
        {**DAMAGE, "alerts.fp8_rel_error.stop": None},
    )
    trained = cli("train", damaged, "--run-dir", tmp_path / "damaged", "--no-progress")
    assert trained.code == 0, trained.err
    result = cli(
        "compare", out / "bf16", tmp_path / "damaged", "--out", tmp_path / "cmp", "--no-png"
    )
    assert result.code == 1, result.out + result.err
    (candidate,) = json.loads((tmp_path / "cmp" / "verdict.json").read_text())["candidates"]
    gates = {g["name"]: g for g in candidate["gates"]}
    assert not gates["loss_gap"]["passed"] and gates["loss_gap"]["value"] > 0.01
    assert candidate["cause"].startswith("loss gap ")
    worst = candidate["worst_layer"]
    assert worst["module"].startswith("decoder.layers.") and worst["module"] in candidate["cause"]
    # The named cause: a third of a tensor or more flushed to zero (a clean run flushes < 1%).
    assert max(worst["underflow"].values()) > 0.3
    assert f"FAIL: {candidate['cause']}" in result.out


@pytest.mark.slow
def test_a_candidate_stopped_by_an_alert_fails_the_gate(cli, gate_dualtrack, tmp_path):
    """The same damage with the default alerts: the FP8-error Stop rule halts the run, and
    the gate fails it for not completing, naming the alert and its module."""
    out, _, manifest = gate_dualtrack
    damaged = write_derived(tmp_path / "damaged.yaml", Path(manifest), DAMAGE)
    trained = cli("train", damaged, "--run-dir", tmp_path / "damaged", "--no-progress")
    assert trained.code == 3 and "stopped by an alert" in trained.err
    result = cli(
        "compare", out / "bf16", tmp_path / "damaged", "--out", tmp_path / "cmp", "--no-png"
    )
    assert result.code == 1, result.out + result.err
    (candidate,) = json.loads((tmp_path / "cmp" / "verdict.json").read_text())["candidates"]
    gates = {g["name"]: g for g in candidate["gates"]}
    assert not gates["completed"]["passed"]
    alerts = map(json.loads, (tmp_path / "damaged" / "alerts.jsonl").read_text().splitlines())
    stop = next(a for a in alerts if a["level"] == "stop")
    assert "stopped" in candidate["cause"] and stop["module"] in candidate["cause"]


@pytest.mark.slow
def test_dualtrack_at_tensor_parallel_2(short_manifest, tmp_path):
    """Under torchrun the three tracks share one process group; they still see the same tokens."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "fp8ops",
        "dualtrack",
        str(short_manifest),
        "--out",
        str(tmp_path / "dt"),
        "--set",
        "topology.tensor_parallel=2",
        "--set",
        "schedule.train_steps=4",
        "--no-png",
        "--no-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan = json.loads((tmp_path / "dt" / "dualtrack.json").read_text())
    assert [t["status"] for t in plan["tracks"]] == ["completed"] * 3
    tokens = [[m.tokens for m in read_metrics(tmp_path / "dt" / t)] for t in TRACKS]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 4
    verdict = json.loads((tmp_path / "dt" / "compare" / "verdict.json").read_text())
    assert verdict["verdict"] == "pass"


# -- recipe tracks (--tracks) -------------------------------------------------------------------


def test_parse_tracks_refuses_what_it_cannot_train():
    from fp8ops.dualtrack.tracks import parse_tracks

    assert parse_tracks("current,bf16,delayed") == ("bf16", "current", "delayed")
    for text, message in (
        ("bf16,fp4", "unknown track 'fp4'"),
        ("bf16,current,current", "named twice"),
        ("delayed,current", "name the bf16 control"),
        ("bf16", "at least one recipe"),
    ):
        with pytest.raises(ManifestError, match=message):
            parse_tracks(text)


def test_a_recipe_track_resets_the_fields_of_other_recipes(short_manifest):
    source = load_manifest(short_manifest)
    assert source.precision.amax_history_len == 16  # the CPU default's delayed window
    current = recipe_manifest(source, "current")
    assert current.precision.scaling == "current"
    assert current.precision.amax_history_len == 1024  # the default: not current's field
    assert current.revision.parent == manifest_hash(source)
    assert recipe_manifest(source, "delayed") is source


@pytest.mark.slow
def test_recipe_tracks_train_and_compare_ranks_them(short_manifest, tmp_path, cli):
    out = tmp_path / "recipes"
    result = cli(
        "dualtrack",
        short_manifest,
        "--tracks",
        "bf16,delayed,current",
        "--out",
        out,
        "--no-png",
        "--no-progress",
    )
    assert result.code in (0, 1), result.err
    plan = json.loads((out / "dualtrack.json").read_text())
    assert plan["requested"] == ["bf16", "delayed", "current"]
    assert [t["label"] for t in plan["tracks"]] == ["bf16", "delayed", "current"]
    assert {t["status"] for t in plan["tracks"]} == {"completed"}
    assert load_manifest(out / "tracks" / "current.yaml").precision.scaling == "current"
    assert "recipes, ranked by the gates" in result.out
    verdict = json.loads((out / "compare" / "verdict.json").read_text())
    ranked = {row["scaling"]: row for row in verdict["recipes"]}
    assert set(ranked) == {"delayed", "current"}
    assert sorted(row["rank"] for row in verdict["recipes"]) == [1, 2]
    assert ranked["delayed"]["published_gemm_speedup"] == {"H200": 1.69, "B300": 1.64}
    assert ranked["current"]["published_gemm_speedup"] == {"H200": 1.58, "B300": 1.39}
    assert set(ranked["current"]["alerts"]) == {"stop", "degrade", "observe"}
    page = (out / "compare" / "report.html").read_text()
    assert "<h3>Recipes</h3>" in page and "not measured here" in page
    targeted = cli("compare", out, "--gpu", "h200", "--no-png")
    assert targeted.code in (0, 1), targeted.err
    verdict = json.loads((out / "compare" / "verdict.json").read_text())
    assert verdict["target_gpu"] == "H200"
    assert {tuple(row["published_gemm_speedup"]) for row in verdict["recipes"]} == {("H200",)}
    assert cli("compare", out, "--gpu", "A100", "--no-png").code == 2
    # the same directory with other tracks is another evaluation
    again = cli("dualtrack", short_manifest, "--tracks", "bf16,block", "--out", out)
    assert again.code == 2 and "not bf16,block" in again.err
