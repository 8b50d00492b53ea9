"""Checkpoints and the locked resume, end to end on the small model.

* equivalence: 2N steps straight equal N steps, a stop, a resume and N more, bit for bit
  (losses, gradient norms, every module's FP8 state, optimizer state, telemetry rows), at TP=1
  and at TP=2 over gloo;
* topology change: a TP=2 checkpoint resumes at TP=1 and the reverse, the FP8 state mapped; with
  ``reduce_amax: false`` ranks hold different states, and that mapping is refused;
* drift: a changed manifest is refused before any model is built (exit 4) unless accepted,
  which records a revision naming the checkpoint's manifest as parent;
* overrides: an approved ledger override becomes a manifest revision on resume; the module runs
  in the base dtype with its FP8 state frozen, and a revoke lifts it at the next resume;
* a load that silently resets FP8 state is caught by the digest check.
"""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.checkpoint import CheckpointDir, CheckpointError, read_meta
from fp8ops.checkpoint import state as checkpoint_state
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.files import read_jsonl
from fp8ops.manifest import derive, load_manifest, manifest_hash, write_manifest
from fp8ops.overrides import Ledger
from fp8ops.run import read_metrics, read_status
from fp8ops.start import DriftRefused, plan_resume
from fp8ops.telemetry import open_run
from fp8ops.train import resume_training, run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

SCHEDULE = {**SCHEDULE, "schedule.eval_iters": 2}
N = 4  # steps before the interruption, and after it
FC2 = "decoder.layers.1.mlp.linear_fc2"


@pytest.fixture(scope="module")
def manifest(small_base, tmp_path_factory) -> Path:
    """A fine-tuning manifest of 2N steps, evaluating and checkpointing every N, whose base is
    the small model pre-trained for a few steps (the shared one)."""
    return write_derived(
        tmp_path_factory.mktemp("resume") / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": str(small_base / "final"),
            "data.num_examples": 400,
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": N,
            "schedule.checkpoint_interval": N,
            "optimizer.lr": 2e-3,
            "telemetry.every_steps": 1,
            "telemetry.error_sample_every": 2,
        },
    )


@pytest.fixture(scope="module")
def straight(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    run_training(manifest, run, progress=False)
    return run


def _final(run: Path):
    return read_meta(run / "checkpoints" / checkpoint_name(2 * N))


def _tensor_files(run: Path, step: int) -> dict:
    """sha256 of the checkpoint's tensor files (the DCP index embeds a random id)."""
    files = read_meta(run / "checkpoints" / checkpoint_name(step)).files
    return {name: f["sha256"] for name, f in files.items() if name.endswith(".distcp")}


def _telemetry(run: Path, rank: int = 0) -> dict[str, np.ndarray]:
    store = open_run(run)
    return {m: store.module_history(m, rank=rank).to_numpy() for m in store.modules}


def assert_same_training(a: Path, b: Path) -> None:
    """Bit for bit: the runs compared are one configuration run the same way (both in this
    process, or both under torchrun), the same arithmetic on either side of a checkpoint."""
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m.step for m in ma] == [m.step for m in mb] == list(range(1, 2 * N + 1))
    for key in ("loss", "grad_norm", "lr", "skipped"):
        assert [getattr(m, key) for m in ma] == [getattr(m, key) for m in mb], key
    assert _final(a).fp8.digests == _final(b).fp8.digests  # every module's scales + histories
    assert _final(a).weights_fingerprint == _final(b).weights_fingerprint
    assert _tensor_files(a, 2 * N) == _tensor_files(b, 2 * N)  # optimizer state included
    ta, tb = _telemetry(a), _telemetry(b)
    for module in ta:
        assert np.array_equal(ta[module], tb[module], equal_nan=True), module


# -- equivalence ------------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_and_resume_equals_the_straight_run_bit_for_bit(manifest, straight, tmp_path, cli):
    run = tmp_path / "run"
    paused = run_training(manifest, run, progress=False, stop_at=N)
    assert paused.paused and paused.steps == N
    assert read_status(run).state == "paused"
    assert CheckpointDir(run).latest().name == checkpoint_name(N)

    result = cli("resume", run, "--no-progress")
    assert result.code == 0, result.err
    assert f"resumed from {checkpoint_name(N)} (step {N})" in result.out
    assert f"trained steps {N + 1}-{2 * N}" in result.out
    assert read_status(run).state == "completed"
    assert_same_training(straight, run)
    resumed = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resumed"]
    assert [(e["step"], e["drift"], e["fp8_state"]) for e in resumed] == [(N, [], "own")]


@pytest.mark.slow
def test_a_completed_run_has_nothing_to_resume(straight, cli):
    result = cli("resume", straight, "--no-progress")
    assert result.code == 0 and "nothing to train" in result.err


@pytest.mark.slow
def test_a_rerun_of_a_completed_run_on_another_machine_has_nothing_to_train(
    manifest, straight, cli, tmp_path, monkeypatch
):
    """A requeue or a chain's next link after the end, on a node with another environment:
    nothing to train, not a drift refusal. A manifest edited in place for the next experiment is
    still refused with its diff (it is not this run), and training longer is a resume."""
    from fp8ops.run import environment

    before = (straight / "events.jsonl").read_text()
    elsewhere = {**environment.environment_fingerprint(), "gpu": "another node's"}
    monkeypatch.setattr(environment, "environment_fingerprint", lambda: elsewhere)
    done = cli("train", manifest, "--resume", "--run-dir", straight, "--no-progress")
    assert done.code == 0 and f"completed at step {2 * N}: nothing to train" in done.err
    edited = write_manifest(
        derive(load_manifest(manifest), {"optimizer.lr": 1e-3}, "next"), tmp_path / "edited.yaml"
    )
    refused = cli("train", edited, "--resume", "--run-dir", straight, "--no-progress")
    assert refused.code == 4 and "optimizer.lr" in refused.err
    longer = write_manifest(
        derive(load_manifest(manifest), {"schedule.train_steps": 2 * N + 2}, "longer"),
        tmp_path / "longer.yaml",
    )
    refused = cli("train", longer, "--resume", "--run-dir", straight, "--no-progress")
    assert refused.code == 4 and "schedule.train_steps" in refused.err
    assert (straight / "events.jsonl").read_text() == before


def _torchrun(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "fp8ops",
            *map(str, args),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def tp2_straight(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tp2") / "run"
    _ok(_torchrun("train", manifest, "--run-dir", run, "--set", "topology.tensor_parallel=2"))
    return run


@pytest.mark.slow
def test_tp2_stop_and_resume_equals_the_straight_tp2_run(manifest, tp2_straight, tmp_path):
    run = tmp_path / "run"
    _ok(
        _torchrun(
            "train",
            manifest,
            "--run-dir",
            run,
            "--set",
            "topology.tensor_parallel=2",
            "--stop-at",
            N,
        )
    )
    _ok(_torchrun("resume", run))
    assert_same_training(tp2_straight, run)
    assert _telemetry(run, rank=1).keys() == _telemetry(tp2_straight, rank=1).keys()
    for module, rows in _telemetry(run, rank=1).items():
        assert np.array_equal(rows, _telemetry(tp2_straight, rank=1)[module], equal_nan=True)


# -- topology change ---------------------------------------------------------------------------


@pytest.mark.slow
def test_tp2_checkpoint_resumes_at_tp1_and_tp1_at_tp2(
    manifest, straight, tp2_straight, tmp_path, cli
):
    # TP=2 -> TP=1: from the TP=2 run's step-N checkpoint, in a copy of its directory.
    down = tmp_path / "down"
    shutil.copytree(tp2_straight, down)
    refused = cli("resume", down, "--checkpoint", N, "--set", "topology.tensor_parallel=1")
    assert refused.code == DriftRefused.exit_code
    assert "topology.tensor_parallel: 2 -> 1" in refused.err
    result = cli(
        "resume",
        down,
        "--checkpoint",
        N,
        "--set",
        "topology.tensor_parallel=1",
        "--accept-drift",
        "one rank left",
        "--no-progress",
    )
    assert result.code == 0, result.err
    event = [e for e in read_jsonl(down / "events.jsonl") if e["event"] == "resumed"][-1]
    # The saved state was one shared group (amaxes reduced over TP): every rank reads it, and
    # the load verified each module's restored state against its saved digest.
    assert event["fp8_state"] == "group0" and event["accepted"] == "one rank left"
    revision = load_manifest(down / "manifest.yaml")
    assert revision.topology.tensor_parallel == 1
    assert revision.revision.parent == read_meta(down / "checkpoints" / checkpoint_name(N)).manifest
    assert "one rank left" in revision.revision.reason
    # Same data, same weights, another summation layout: close, not bit-identical.
    after = {m.step: m.loss for m in read_metrics(down)}
    tp2 = {m.step: m.loss for m in read_metrics(tp2_straight)}
    assert after[N + 1] == pytest.approx(tp2[N + 1], rel=2e-2)

    # TP=1 -> TP=2: the one-rank run's step-N checkpoint continued by two ranks.
    up = tmp_path / "up"
    shutil.copytree(straight, up)
    _ok(
        _torchrun(
            "resume",
            up,
            "--checkpoint",
            N,
            "--set",
            "topology.tensor_parallel=2",
            "--accept-drift",
            "a second rank",
        )
    )
    assert read_meta(up / "checkpoints" / checkpoint_name(2 * N)).topology.tensor_parallel == 2
    # Rank 1 joined the telemetry store at step N+1: nothing before, rows after.
    joined = open_run(up).module_history(FC2, rank=1)
    applies = [c for c in joined.columns if "block" not in c]  # delayed scaling: no blocks
    assert joined.loc[:N].isna().all().all()
    assert joined.loc[N + 1 :, applies].notna().any().all()


@pytest.mark.slow
def test_per_rank_fp8_state_refuses_a_topology_change(manifest, tmp_path, cli):
    run = tmp_path / "run"
    _ok(
        _torchrun(
            "train",
            manifest,
            "--run-dir",
            run,
            "--set",
            "topology.tensor_parallel=2",
            "--set",
            "precision.reduce_amax=false",
            # Per-rank scales (no amax reduction) saturate linear_proj's input 1-2% from step 5
            # on this base: a Stop would end the resume below, which is not what this tests.
            "--set",
            "alerts.saturation.stop=null",
            "--stop-at",
            N,
        )
    )
    meta = read_meta(run / "checkpoints" / checkpoint_name(N))
    assert (meta.fp8.layout, meta.fp8.groups) == ("per_rank", 2)
    result = cli("resume", run, "--set", "topology.tensor_parallel=1", "--accept-drift", "try")
    assert result.code == DriftRefused.exit_code
    assert "2 different FP8 states" in result.err and "not defined" in result.err
    assert "tensor_parallel 2" in result.err  # says where it would be defined
    _ok(_torchrun("resume", run))  # the saved topology: each rank takes its own state


# -- drift -------------------------------------------------------------------------------------


@pytest.fixture
def paused(manifest, tmp_path) -> Path:
    run = tmp_path / "paused"
    run_training(manifest, run, progress=False, stop_at=N)
    return run


@pytest.mark.slow
def test_a_changed_manifest_is_refused_then_accepted_as_a_revision(manifest, paused, tmp_path, cli):
    edited = write_manifest(
        derive(load_manifest(manifest), {"optimizer.lr": 1e-3}, "edited"), tmp_path / "e.yaml"
    )
    events_before = (paused / "events.jsonl").read_text()
    refused = cli("train", edited, "--resume", "--run-dir", paused, "--no-progress")
    assert refused.code == DriftRefused.exit_code == 4
    assert "manifest    optimizer.lr: 0.002 -> 0.001" in refused.err
    assert "--accept-drift" in refused.err
    assert (paused / "events.jsonl").read_text() == events_before  # refused before building

    reason = "lower lr after the spike"
    done = cli(
        "train", edited, "--resume", "--run-dir", paused, "--accept-drift", reason, "--no-progress"
    )
    assert done.code == 0, done.err
    locked = load_manifest(paused / "manifest.yaml")
    saved = read_meta(paused / "checkpoints" / checkpoint_name(N)).manifest
    assert locked.optimizer.lr == 1e-3 and locked.revision.parent == saved
    assert reason in locked.revision.reason and "optimizer.lr" in locked.revision.reason
    assert (paused / "manifests" / f"{manifest_hash(locked)}.yaml").exists()
    # Later checkpoints carry the whole chain.
    assert _final(paused).revisions[-2:] == [saved, manifest_hash(locked)]


@pytest.mark.slow
def test_set_on_resume_needs_a_reason(paused, cli):
    result = cli("resume", paused, "--set", "optimizer.lr=0.001")
    assert result.code == 4 and "optimizer.lr: 0.002 -> 0.001" in result.err


@pytest.mark.slow
def test_train_resume_without_a_checkpoint_starts_the_run(manifest, tmp_path, cli):
    result = cli(
        "train",
        manifest,
        "--resume",
        "--run-dir",
        tmp_path / "new",
        "--stop-at",
        1,
        "--no-progress",
    )
    assert result.code == 0, result.err
    assert read_status(tmp_path / "new").state == "paused"


@pytest.mark.slow
def test_a_paused_run_directory_points_at_resume(manifest, paused, cli):
    result = cli("train", manifest, "--run-dir", paused, "--no-progress")
    assert result.code == 2 and f"fp8ops resume {paused}" in result.err


# -- overrides applied on resume ------------------------------------------------------------------


@pytest.mark.slow
def test_an_approved_override_is_applied_on_resume_and_a_revoke_lifts_it(paused, cli, tmp_path):
    ledger = Ledger(paused)
    staged = ledger.stage(FC2, "saturates after the lr spike", who="alice")
    ledger.approve(staged.id, who="bob")
    frozen = read_meta(paused / "checkpoints" / checkpoint_name(N)).fp8.digests[FC2]

    result = cli("resume", paused, "--no-progress")
    assert result.code == 0, result.err
    assert f"fallback: {FC2} -> bf16 (saturates after the lr spike)" in result.out
    speed = re.search(
        r"tokens/s: median [\d,]+ over the (\d+) steps before, [\d,]+ over the "
        r"(\d+) after( \([+-][\d.]+%\))?\n",
        result.out,
    )
    assert speed, result.out
    # The change only when both medians hold 5 steps or more (first steps warm up).
    assert bool(speed.group(3)) == (min(int(speed.group(1)), int(speed.group(2))) >= 5)
    locked = load_manifest(paused / "manifest.yaml")
    (override,) = locked.precision.overrides
    assert (override.module, override.approval) == (FC2, ledger.get(staged.id).approval)
    assert "resume applies approved overrides" in locked.revision.reason
    layers = {r["fqn"]: r for r in json.loads((paused / "layers.json").read_text())["rows"]}
    assert (layers[FC2]["precision"], layers[FC2]["reason"]["code"]) == ("bf16", "override")
    # BF16 from step N+1: its FP8 state stayed exactly as the checkpoint left it.
    assert _final(paused).fp8.digests[FC2] == frozen
    assert open_run(paused).module_history(FC2, "fp8_gemms").loc[N + 1 :].eq(0).all().all()
    fallbacks = json.loads((paused / "fallbacks.json").read_text())
    assert fallbacks[FC2]["from_step"] == N + 1
    assert fallbacks[FC2]["revision"] == manifest_hash(locked)
    applied = ledger.get(staged.id)
    assert (applied.status, applied.applied_step) == ("applied", N + 1)
    assert applied.applied_revision == manifest_hash(locked)

    # Revoked: the next resume (here from the final checkpoint, with more steps) lifts it.
    ledger.revoke(staged.id, "fixed upstream", who="carol")
    longer = cli(
        "resume",
        paused,
        "--set",
        f"schedule.train_steps={2 * N + 2}",
        "--accept-drift",
        "two more steps",
        "--no-progress",
    )
    assert longer.code == 0, longer.err
    assert f"lifted: {FC2} -> fp8" in longer.out
    assert load_manifest(paused / "manifest.yaml").precision.overrides == ()
    assert json.loads((paused / "fallbacks.json").read_text()) == {}


@pytest.mark.slow
def test_a_self_approval_written_by_hand_is_not_applied(paused, cli, monkeypatch):
    """Issue 49, defect 2, as reported: on an unsigned ledger, ana's own approval appended by
    hand (the chain recomputed) passed `overrides verify` and the resume applied it."""
    from support.ledger_run import append_by_hand

    fc1 = "decoder.layers.1.mlp.linear_fc1"
    monkeypatch.setenv("FP8OPS_USER", "ana")
    assert cli("overrides", "stage", paused, fc1, "--reason", "x").code == 0
    (staged,) = Ledger(paused).overrides()
    assert "cannot approve it too" in cli("overrides", "approve", paused, staged).err
    append_by_hand(paused, {"kind": "approved", "override": staged, "who": "ana", "note": None})
    verified = cli("overrides", "verify", paused)
    assert verified.code == 2 and "cannot approve it too" in verified.err
    before = {f.name: f.read_bytes() for f in paused.iterdir() if f.is_file()}
    resumed = cli("resume", paused, "--no-progress")
    assert resumed.code == 2 and "line 2: the approved record by ana" in resumed.err
    assert {f.name: f.read_bytes() for f in paused.iterdir() if f.is_file()} == before


# -- what the load verifies ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_load_that_resets_fp8_state_is_refused(paused, monkeypatch):
    """TE's failure mode: state keys that don't match are skipped and the module keeps its fresh
    state (scale 1, empty histories). Simulated by a restore that puts nothing back."""
    monkeypatch.setattr(checkpoint_state, "restore_fp8", lambda modules, loaded: None)
    before = {f.name: f.read_bytes() for f in paused.iterdir() if f.is_file()}
    with pytest.raises(CheckpointError, match="FP8 state after loading .* reset"):
        resume_training(paused, progress=False)
    # Refused before anything was written: the run is still paused, ready for a good resume.
    assert {f.name: f.read_bytes() for f in paused.iterdir() if f.is_file()} == before


@pytest.mark.slow
def test_the_weights_are_verified_under_the_scheme_their_checkpoint_names(paused):
    """A checkpoint records how its weights fingerprint names the parameters; one that names
    none was written before schemes were named (module paths), and is verified that way: here,
    where it is not true, the load is refused."""
    from support.checkpoint_surgery import edit_meta

    checkpoint = paused / "checkpoints" / checkpoint_name(N)
    assert read_meta(checkpoint).weights_fingerprint_scheme == "checkpoint-keys"
    edit_meta(checkpoint, lambda meta: meta.pop("weights_fingerprint_scheme"))
    assert read_meta(checkpoint).weights_fingerprint_scheme == "parameter-names"
    with pytest.raises(CheckpointError, match="the restored weights hash to .* refusing"):
        resume_training(paused, progress=False)


@pytest.mark.slow
def test_a_checkpoint_written_before_schemes_were_named_resumes(
    manifest, straight, tmp_path, monkeypatch
):
    """As an older fp8ops wrote it: the fingerprint by module path, and no scheme named."""
    from support.checkpoint_surgery import edit_meta

    from fp8ops.checkpoint import weights

    run = tmp_path / "older"
    monkeypatch.setattr(weights, "FINGERPRINT_SCHEME", weights.PARAMETER_NAMES)
    run_training(manifest, run, progress=False, stop_at=N)
    monkeypatch.undo()
    checkpoint = run / "checkpoints" / checkpoint_name(N)
    edit_meta(checkpoint, lambda meta: meta.pop("weights_fingerprint_scheme"))
    resume_training(run, progress=False)
    assert_same_training(straight, run)


@pytest.mark.slow
def test_plan_refuses_environment_drift_before_building_anything(paused):
    from fp8ops.run.environment import environment_fingerprint

    other = {**environment_fingerprint(), "torch": "9.9.9"}
    with pytest.raises(DriftRefused, match="environment torch: '.*' -> '9.9.9'"):
        plan_resume(paused, environment=other)
    plan = plan_resume(paused, environment=other, accept_drift="new torch, same numerics")
    assert plan.new_revisions == [] and plan.accepted_reason == "new torch, same numerics"


# -- stop requests -------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_both_at_one_step_and_resume_finishes(manifest, tmp_path):
    """The signal reaches rank 1 only; the ranks agree on the stop step (an all-reduce of their
    flags), checkpoint it together and exit with 75; the resume then completes the run."""
    import os
    import signal
    import time

    run = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "fp8ops",
            "train",
            str(manifest),
            "--run-dir",
            str(run),
            "--no-progress",
            "--set",
            "topology.tensor_parallel=2",
            "--set",
            "schedule.train_steps=40",
            "--set",
            "schedule.checkpoint_interval=100",
            # This is about stopping on a signal: at lr 2e-3 over 40 steps a layer's input can
            # saturate past the Stop level, which would end the resumed run first.
            "--set",
            "alerts.saturation.stop=0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 600  # against a hang only: the start and two steps
    while not ((run / "metrics.jsonl").exists() and len(read_jsonl(run / "metrics.jsonl")) >= 2):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"two steps not logged:\n{process.communicate()[0][-3000:]}")
        time.sleep(0.2)
    workers = subprocess.run(
        ["pgrep", "-P", str(process.pid)], capture_output=True, text=True, check=False
    )
    pids = sorted(int(p) for p in workers.stdout.split())
    assert len(pids) == 2, workers
    rank1 = next(p for p in pids if "RANK=1\0" in Path(f"/proc/{p}/environ").read_text())
    os.kill(rank1, signal.SIGUSR1)
    out, _ = process.communicate(timeout=600)  # against a hang only: a step and a checkpoint
    assert process.returncode != 0, out[-2000:]  # torchrun reports the workers' exit 75
    assert "exit 75" in out
    status = read_status(run)
    assert (status.state, status.reason) == ("interrupted", "another rank was asked to stop")
    step = status.step
    assert 2 <= step < 40 and read_meta(run / "checkpoints" / status.checkpoint).step == step
    _ok(_torchrun("resume", run))
    assert read_status(run).state == "completed"
    assert [m.step for m in read_metrics(run)] == list(range(1, 41))


# -- what a crash can leave behind ----------------------------------------------------------------


@pytest.mark.slow
def test_train_resume_sets_aside_an_attempt_that_never_checkpointed(manifest, paused, cli):
    """A job killed before its first checkpoint, then requeued: nothing to resume, so the same
    command starts over, keeping the old attempt's records."""
    shutil.rmtree(paused / "checkpoints")  # as if killed before the first save
    status = json.loads((paused / "status.json").read_text())
    (paused / "status.json").write_text(json.dumps({**status, "state": "running"}))
    result = cli(
        "train", manifest, "--resume", "--run-dir", paused, "--stop-at", 1, "--no-progress"
    )
    assert result.code == 0, result.err
    assert "moved to" in result.err and "starts over" in result.err
    assert (paused / "attempts" / "1" / "metrics.jsonl").exists()
    assert [m.step for m in read_metrics(paused)] == [1]
    assert read_status(paused).state == "paused"


@pytest.mark.slow
def test_a_missing_latest_pointer_falls_back_to_the_newest_complete_checkpoint(paused, cli):
    (paused / "checkpoints" / "latest").unlink()  # killed between the rename and the pointer
    leftovers = [
        paused / "checkpoints" / ".step_00000009.partial",
        paused / "checkpoints" / ".step_00000001.deleting",
    ]
    for leftover in leftovers:
        leftover.mkdir()
    result = cli("resume", paused, "--stop-at", N + 1, "--no-progress")
    assert result.code == 0, result.err
    assert f"resumed from {checkpoint_name(N)}" in result.out
    assert not any(leftover.exists() for leftover in leftovers)  # cleared by the next save


@pytest.mark.slow
def test_overrides_survive_requeues_and_a_resume_from_before_they_were_applied(
    manifest, paused, cli
):
    ledger = Ledger(paused)
    staged = ledger.stage(FC2, "saturates", who="alice")
    ledger.approve(staged.id, who="bob")
    assert cli("resume", paused, "--stop-at", N + 1, "--no-progress").code == 0
    applied_records = [r for r in ledger.records() if r["kind"] == "applied"]
    assert len(applied_records) == 1

    # Back to the checkpoint from before the override: applied again from there, without a
    # second "applied" record; the later checkpoint is set aside and `latest` moves back first.
    back = cli("resume", paused, "--checkpoint", N, "--stop-at", N + 1, "--no-progress")
    assert back.code == 0, back.err
    assert [o.module for o in load_manifest(paused / "manifest.yaml").precision.overrides] == [FC2]
    assert [r for r in ledger.records() if r["kind"] == "applied"] == applied_records
    assert (paused / "checkpoints" / "superseded" / checkpoint_name(N + 1)).is_dir()
    event = [e for e in read_jsonl(paused / "events.jsonl") if e["event"] == "resumed"][-1]
    assert event["overrides_applied"] == [FC2] and event["superseded"] == [checkpoint_name(N + 1)]

    # A requeue runs the manifest file, which lists no overrides: not drift, and they stay.
    requeued = cli(
        "train", manifest, "--resume", "--run-dir", paused, "--stop-at", N + 2, "--no-progress"
    )
    assert requeued.code == 0, requeued.err
    assert [o.module for o in load_manifest(paused / "manifest.yaml").precision.overrides] == [FC2]
    assert CheckpointDir(paused).latest().name == checkpoint_name(N + 2)


@pytest.mark.slow
def test_changes_a_checkpoint_cannot_be_loaded_into_are_refused_even_when_accepted(paused, cli):
    for change, why in (
        ("model.hidden_size=128", "shapes"),
        ("seeds.data=7", "data order"),
        ("precision.enabled=false", None),
    ):
        result = cli(
            "resume",
            paused,
            "--set",
            change,
            "--accept-drift",
            "try",
            "--stop-at",
            N + 1,
            "--no-progress",
        )
        if why is None:  # FP8 off is loadable: the saved FP8 state is just not used
            assert result.code == 0, result.err
            continue
        assert result.code == 4 and why in result.err, result.err


@pytest.mark.slow
def test_other_alert_thresholds_resume_with_fresh_windows(paused, cli):
    result = cli(
        "resume",
        paused,
        "--set",
        "alerts.window_steps=7",
        "--accept-drift",
        "wider windows",
        "--stop-at",
        N + 1,
        "--no-progress",
    )
    assert result.code == 0, result.err


@pytest.mark.slow
def test_a_checkpoint_saved_before_an_alert_rule_existed_resumes(manifest, tmp_path, cli):
    """The alert windows a checkpoint holds are those of the fp8ops that saved it: a rule added
    since (here blocks_at_floor, its windows left out of the save as an older fp8ops would) is
    not in the file. The resume loads the rest and starts that rule afresh."""
    from fp8ops.alerts import AlertEngine
    from fp8ops.checkpoint.sharded_io import saved_keys

    state_dict = AlertEngine.state_dict
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            AlertEngine,
            "state_dict",
            lambda self: {
                k: v for k, v in state_dict(self).items() if not k.startswith("blocks_at_floor.")
            },
        )
        run_training(manifest, tmp_path / "run", progress=False, stop_at=N)
    saved = saved_keys(tmp_path / "run" / "checkpoints" / checkpoint_name(N))
    assert "rank.alerts.saturation.degrade.open" in saved
    assert not any("blocks_at_floor" in key for key in saved)
    result = cli("resume", tmp_path / "run", "--stop-at", N + 1, "--no-progress")
    assert result.code == 0, result.err
    assert CheckpointDir(tmp_path / "run").latest().name == checkpoint_name(N + 1)
    (event,) = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "resumed"]
    assert event["alert_rules_fresh"] == ["blocks_at_floor"]


@pytest.mark.slow
def test_stop_at_outside_the_remaining_steps_is_refused_up_front(paused, cli):
    for step in (N, 2 * N):
        result = cli("resume", paused, "--stop-at", step, "--no-progress")
        assert result.code == 2 and "--stop-at" in result.err
    assert read_status(paused).state == "paused"


def test_a_requeue_keeps_hand_written_and_ledger_overrides_in_the_saved_order():
    """A manifest file with its own override, a ledger override applied on top: the requeue's
    file (the hand-written one only) is the saved revision, not drift. Lists compare as written,
    so the merge must keep the saved order (hand-written first, as the resume appended)."""
    from fp8ops.start.drift import manifest_drift
    from fp8ops.start.plan import _with_ledger_overrides

    hand = {"module": "decoder.layers.0.mlp.linear_fc1", "reason": "hand-written"}
    approved = {"module": FC2, "reason": "saturates", "approval": "a" * 64}
    requested = derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"),
        {"precision.overrides": [hand]},
        "own override",
    )
    saved = derive(requested, {"precision.overrides": [hand, approved]}, "from the ledger")
    merged = _with_ledger_overrides(requested, saved)
    assert [o.module for o in merged.precision.overrides] == [hand["module"], FC2]
    assert manifest_drift(saved, merged) == []


@pytest.mark.slow
def test_a_format_change_on_resume_carries_the_scales_to_the_new_maximum(paused, cli):
    """hybrid -> e4m3 gradients: the saved backward scales were computed for E5M2's 57344 and
    would saturate E4M3 (448) on the first step; they are carried by 448 / 57344 at load."""
    result = cli(
        "resume",
        paused,
        "--set",
        "precision.fp8_format=e4m3",
        "--accept-drift",
        "gradients fit E4M3",
        "--stop-at",
        N + 1,
        "--no-progress",
    )
    assert result.code == 0, result.err
    event = [e for e in read_jsonl(paused / "events.jsonl") if e["event"] == "resumed"][-1]
    assert event["scales_carried"] == {"backward": 2.0**-7}
    assert "backward scales carried to the new recipe: x0.0078125" in result.out + result.err
    telemetry = open_run(paused)
    first = telemetry.step_snapshot(N + 1)
    assert (first["grad_output.saturation"] == 0).all(), first["grad_output.saturation"]
    # The update moved each carried scale as on any step, not by the factor (128x).
    assert (first["grad_output.scale_change"] < 4).all(), first["grad_output.scale_change"]
    assert (first["input.scale_change"] < 4).all()
