"""Telemetry and alerts in a real training run: the store a run leaves, NaN injected into one
module stopping the run at that step by name, a weight forced to saturate drawing a Degrade
alert and a BF16 proposal, and a training process killed with SIGKILL leaving its store
readable up to the last commit."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.alerts import read_alerts
from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.state import fp8_digest
from fp8ops.files import read_jsonl
from fp8ops.manifest import derive, load_manifest, write_manifest
from fp8ops.overrides import Ledger
from fp8ops.start import New
from fp8ops.telemetry import TelemetryError, open_run
from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES
from fp8ops.train import open_trainer, run_training
from fp8ops.train.distributed import init_distributed, shutdown_distributed
from fp8ops.train.ending import NotReleasable, StopRun

# Every test trains a run (several in a process that is signalled or killed): the full suite's.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
SMALL = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.ffn_hidden_size": 256,
    "model.seq_length": 64,
    "model.init_checkpoint": None,
    "data.num_examples": 600,
    "schedule.warmup_steps": 1,
    "schedule.micro_batch_size": 4,
    "schedule.global_batch_size": 8,
    "schedule.eval_interval": 1000,
    "schedule.eval_iters": 2,
    "schedule.log_interval": 1,
    "telemetry.every_steps": 1,
    "telemetry.error_sample_every": 2,
    "telemetry.flush_steps": 4,
}
TARGET = "decoder.layers.1.mlp.linear_fc1"


@pytest.fixture(scope="module")
def manifest():
    """The CPU default shrunk, from random weights (no base needed), measuring every step."""
    return derive(load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"), SMALL, "telemetry test")


def _trainer(manifest, run_dir, steps: int):
    manifest = derive(manifest, {"schedule.train_steps": steps}, f"{steps} steps")
    ranks = init_distributed(manifest.topology, source="test")
    return open_trainer(New(manifest, [manifest], run_dir, "test"), ranks, progress=False)


def test_a_run_leaves_a_readable_store_matching_its_metrics(manifest, tmp_path, cli):
    short = write_manifest(
        derive(manifest, {"schedule.train_steps": 6}, "6 steps"), tmp_path / "short.yaml"
    )
    run_training(short, tmp_path / "run", progress=False)
    store = open_run(tmp_path / "run")
    assert store.committed_steps == {0: 6}
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = store.step_metrics()
    assert steps["loss"].tolist() == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    history = store.module_history(TARGET)
    assert list(history.index) == [1, 2, 3, 4, 5, 6]
    assert (history["fp8_gemms"] == 6).all()  # 2 micro-batches x 3 GEMMs
    assert history["input.scale"].notna().all() and history["input.saturation"].notna().all()
    errors = history["fp8_rel_error"]
    assert errors[[2, 4, 6]].notna().all() and errors[[1, 3, 5]].isna().all()  # sampled
    snapshot = store.step_snapshot(6)
    assert list(snapshot.columns) == list(MODULE_METRIC_NAMES)
    assert len(snapshot) == 8  # 2 layers x 4 projections
    assert set(store.to_xarray().dims) == {"step", "module"}

    # fp8ops inspect: the worst modules by a metric, from the store.
    result = cli("inspect", tmp_path / "run", "--worst", "input.scale", "--top", "3")
    assert result.code == 0
    out = result.out
    assert "worst 3 modules by input.scale, steps 1-6" in out
    assert sum(name in out for name in snapshot.index) == 3
    result = cli("inspect", tmp_path / "run", "--worst", "input.nonsense")
    assert (result.code, "input.nonsense" in result.err) == (2, True)


def test_nan_in_one_module_stops_the_run_at_that_step_naming_it(manifest, tmp_path):
    nan_step = 4
    trainer = _trainer(manifest, tmp_path / "run", steps=8)
    calls = {"n": 0}

    def inject(module, args):
        calls["n"] += 1
        if calls["n"] == 2 * (nan_step - 1) + 1:  # the first micro-batch of step nan_step
            poisoned = args[0].clone()
            poisoned.view(-1)[0] = float("nan")
            return (poisoned, *args[1:])
        return None

    dict(trainer.model.named_modules())[TARGET].register_forward_pre_hook(inject)
    try:
        with pytest.raises(StopRun) as stop:
            trainer.train()
    finally:
        shutdown_distributed()
    first = stop.value.alerts[0]
    assert (first["step"], first["module"], first["level"]) == (nan_step, TARGET, "stop")
    assert first["metric"] == "input.nan"
    assert TARGET in str(stop.value) and f"step {nan_step}" in str(stop.value).lower()
    assert stop.value.exit_code == 3
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("stopped", nan_step)
    # The Stop path saved a training checkpoint of that step, with the state as it stopped.
    meta = read_meta(run / "checkpoints" / status["checkpoint"])
    assert (meta.step, meta.reason) == (nan_step, "alert-stop: nonfinite")
    assert meta.fp8.digests[TARGET] == [fp8_digest(trainer.collector.modules[TARGET])]
    assert meta.telemetry_committed == nan_step
    assert any(a.rule == "nonfinite" and a.module == TARGET for a in read_alerts(run))
    assert open_run(run).committed_steps == {0: nan_step}  # flushed on the Stop path


# Issue 49, 10: lr 1e30 (clipping out of the way) blows every weight up at step 1; step 2's loss
# is NaN. Cast statistics every 50 steps, as the CPU default measures them: step 2 counts none.
BLOW_UP = {
    "schedule.train_steps": 4,
    "schedule.warmup_steps": 0,
    "optimizer.lr": 1e30,
    "optimizer.clip_grad": 1e38,
    "telemetry.every_steps": 50,
    "capability.enabled": False,
}


def test_an_optimizer_blow_up_stops_at_the_step_that_made_it(manifest, tmp_path):
    blow_up = write_manifest(derive(manifest, BLOW_UP, "lr 1e30"), tmp_path / "blow_up.yaml")
    with pytest.raises(StopRun) as stop:
        run_training(blow_up, tmp_path / "run", progress=False)
    first = stop.value.alerts[0]
    assert (first["step"], first["rule"], first["metric"]) == (1, "update_blowup", "update_norm")
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")  # no second step trained
    # Measured: an update of norm 3.5e32 on weights of norm 19 (AdamW's first step moves each
    # weight by lr, 1e30).
    assert row["update_norm"] > 1e30 and 1 < row["weight_norm"] < 1e3
    assert first["value"] == pytest.approx(row["update_norm"], rel=1e-6)  # float32 in the alert
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["state"], status["step"]) == ("stopped", 1)
    meta = read_meta(tmp_path / "run" / "checkpoints" / status["checkpoint"])
    assert (meta.step, meta.reason) == (1, "alert-stop: update_blowup")

    # With the rule off, step 2's NaN is localized to the first module whose amax jumped,
    # where the Stop said before that no module's telemetry showed where it started.
    with pytest.raises(StopRun) as stop:
        run_training(
            blow_up,
            tmp_path / "off",
            assignments={"alerts.update_blowup_factor": None},
            progress=False,
        )
    first = stop.value.alerts[0]
    assert (first["step"], first["rule"]) == (2, "nonfinite")
    assert first["module"] is not None and first["metric"].endswith(".amax")
    assert first["value"] > 1e29  # an amax of the weights step 1 moved by 1e30 each
    assert "no module's telemetry shows where it started" not in first["message"]
    assert f"amaxes jumped first in {first['module']}" in first["message"]


# An SGD step at the learning rate's bound (float32's largest number), clipping off: a gradient
# element above 1 steps its weight past the float range. The gradients stay finite.
OVERFLOW = {
    "schedule.warmup_steps": 0,
    "optimizer.name": "sgd",
    "optimizer.beta1": 0.0,
    "optimizer.lr": 3.4e38,
    "optimizer.clip_grad": None,
    "alerts.update_blowup_factor": None,  # the non-finite update is nonfinite's to say
    "capability.enabled": False,
}


def _overflowing(manifest, run_dir, steps: int, **settings):
    """A trainer whose first step overflows a weight: one weight's gradient made 1e4x larger
    (measured on this model without it: no element above 1, so the step stays finite)."""
    trainer = _trainer(
        derive(manifest, {**OVERFLOW, **settings}, "sgd at lr's bound"), run_dir, steps
    )
    weight = dict(trainer.model.named_parameters())[f"{TARGET}.weight"]
    weight.register_hook(lambda grad: grad * 1e4)
    return trainer


def test_an_update_that_overflows_the_weights_stops_at_its_step(manifest, tmp_path):
    """Issue 49 review: finite gradients, an update past the float range: nothing fired until
    the next step's NaN, and at the last step never, where the run then released them."""
    trainer = _overflowing(manifest, tmp_path / "run", steps=4)
    try:
        with pytest.raises(StopRun) as stop:
            trainer.train()
    finally:
        shutdown_distributed()
    first = stop.value.alerts[0]
    assert (first["step"], first["rule"], first["metric"]) == (1, "nonfinite", "update_norm")
    assert "the optimizer's update had norm inf, not finite, from finite gradients" in str(
        stop.value
    )
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")  # no second step trained
    assert row["grad_norm"] is not None and row["skipped"] is False  # finite gradients

    # With the Stop demoted, a run that ends on that step is not released.
    trainer = _overflowing(manifest, tmp_path / "last", steps=1, **{"alerts.nonfinite_stop": False})
    try:
        with pytest.raises(NotReleasable, match="the norm of step 1's update is inf"):
            trainer.train()
    finally:
        shutdown_distributed()
    assert not (tmp_path / "last" / "final").exists()


def test_a_result_not_releasable_keeps_the_checkpoints_its_advice_names(manifest, tmp_path):
    """The final save ran before the result was judged, and deleted the oldest checkpoint
    (keep_checkpoints) that the refusal then advised resuming with a fix."""
    keep_one = {"alerts.nonfinite_stop": False, "schedule.checkpoint_interval": 1}
    keep_one["schedule.keep_checkpoints"] = 1
    trainer = _overflowing(manifest, tmp_path / "run", steps=3, **keep_one)
    try:
        with pytest.raises(NotReleasable) as refused:
            trainer.train()
    finally:
        shutdown_distributed()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000002", "step_00000003"]
    said = str(refused.value)
    assert "its checkpoints are kept (step_00000002, step_00000003 in checkpoints/)" in said
    assert (
        f"resume an earlier one with a fix (fp8ops resume {tmp_path / 'run'} --checkpoint 2 "
        in said
    )


def test_a_saturating_weight_draws_degrade_and_a_proposal(manifest, tmp_path):
    # Stop off for saturation and FP8 error: the weight below saturates far past their stop
    # levels (and its clipped output errs accordingly); this test is about the level below.
    no_stop = derive(
        manifest,
        # No capability evaluation either: its forwards would run the growing hook below.
        {
            "alerts.saturation.stop": None,
            "alerts.fp8_rel_error.stop": None,
            "capability.enabled": False,
        },
        "saturation never stops",
    )
    trainer = _trainer(no_stop, tmp_path / "run", steps=8)
    module = dict(trainer.model.named_modules())[TARGET]
    growth = {"factor": 1.0, "calls": 0}

    def grow(mod, args):
        # From step 2 on, before each step's first micro-batch (when the weight is cast), the
        # weight is 4x larger than at the previous step: the delayed scale is always stale.
        growth["calls"] += 1
        if growth["calls"] % 2 == 1 and growth["calls"] > 1:
            growth["factor"] *= 4.0
            with torch.no_grad():
                mod.weight.mul_(growth["factor"])

    module.register_forward_pre_hook(grow)
    try:
        trainer.train()
    finally:
        shutdown_distributed()
    run = tmp_path / "run"
    degrade = [a for a in read_alerts(run) if a.level == "degrade"]
    # The cause first; its clipped output then disturbs the next module, which may follow.
    assert (degrade[0].module, degrade[0].metric) == (TARGET, "weight.saturation")
    assert degrade[0].value > 1e-3
    assert not [a for a in degrade if a.module.startswith("decoder.layers.0.")]  # upstream: calm
    # Degrade proposed the module in the run's override ledger, with what triggered it.
    proposed = list(Ledger(run).overrides().values())
    assert proposed[0].module == TARGET
    assert len({o.module for o in proposed}) == len(proposed)  # one open proposal per module
    first = proposed[0]
    assert (first.status, first.who, first.step) == ("proposed", "fp8ops-alerts", degrade[0].step)
    trigger = next(t for t in first.triggers if t.metric == "weight.saturation")
    assert trigger.value == degrade[0].value and trigger.threshold == degrade[0].threshold
    saturation = open_run(run).module_history(TARGET)["weight.saturation"]
    assert saturation.iloc[-1] > 1e-3 and saturation.iloc[0] < 1e-3


def test_sigkill_leaves_the_store_readable_up_to_its_last_commit(manifest, tmp_path):
    manifest_file = write_manifest(
        derive(manifest, {"schedule.train_steps": 200}, "long enough to kill"),
        tmp_path / "long.yaml",
    )
    run = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fp8ops",
            "train",
            str(manifest_file),
            "--run-dir",
            str(run),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600  # against a hang only: 12 steps take seconds
        while True:
            assert time.monotonic() < deadline and process.poll() is None, "no 12 steps committed"
            time.sleep(0.5)
            try:
                if open_run(run).committed_steps.get(0, 0) >= 12:
                    break
            except TelemetryError:  # the store may not exist yet
                continue
        os.kill(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    store = open_run(run)
    committed = store.committed_steps[0]
    assert committed >= 12 and committed % 4 == 0  # whole blocks only
    losses = store.step_metrics()["loss"]
    assert len(losses) == committed and np.isfinite(losses).all()
    logged = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    for step, loss in losses.items():
        assert loss == pytest.approx(logged[step], rel=1e-6)
    assert store.module_history(TARGET)["input.scale"].notna().all()


# How long a signalled run may take to exit, against a hang only: seconds alone, and once more
# than 60 s beside a full suite on two loaded cores (16 s alone).
EXIT_S = 300


def _start_long_run(manifest, tmp_path, steps_logged: int):
    """A 200-step run in a subprocess, returned once it has logged ``steps_logged`` steps."""
    manifest_file = write_manifest(
        # Blocks of 64 steps: whatever reaches the store before step 64 got there by a flush
        # on the stop or failure path, not by a block filling up.
        derive(
            manifest,
            {"schedule.train_steps": 200, "telemetry.flush_steps": 64},
            "long enough to terminate",
        ),
        tmp_path / "long.yaml",
    )
    run = tmp_path / "run"
    # A process started with SIGINT ignored keeps ignoring it (Python installs its handler only
    # over the default), and a script's background job, as a suite may be, ignores SIGINT. A
    # handled signal is reset to the default in the child: so the run can be interrupted.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fp8ops",
                "train",
                str(manifest_file),
                "--run-dir",
                str(run),
                "--no-progress",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 600  # against a hang only: it takes seconds
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(read_jsonl(metrics)) >= steps_logged):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"{steps_logged} steps not logged:\n{process.communicate()[1][-2000:]}")
        time.sleep(0.3)
    return process, run


def test_sigterm_checkpoints_at_the_step_boundary_and_asks_for_a_requeue(manifest, tmp_path):
    process, run = _start_long_run(manifest, tmp_path, 9)  # past two 4-step blocks
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=EXIT_S)
    assert process.returncode == 75, err[-2000:]  # "requeue me", not a failure
    assert "SIGTERM" in err and "requeue" in err
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("interrupted", "SIGTERM")
    step = status["step"]
    meta = read_meta(run / "checkpoints" / status["checkpoint"])
    assert (meta.step, meta.reason) == (step, "requested: SIGTERM")
    # The step that was running finished; every logged step is in the store, committed.
    assert len(read_jsonl(run / "metrics.jsonl")) == step < 64
    assert open_run(run).committed_steps[0] == meta.telemetry_committed == step


def test_sigint_does_not_wait_and_marks_the_run_failed(manifest, tmp_path):
    process, run = _start_long_run(manifest, tmp_path, 9)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=EXIT_S)
    assert process.returncode == 130, err[-2000:]  # click's exit code for an interrupt
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "KeyboardInterrupt" in status["error"]
    logged = len(read_jsonl(run / "metrics.jsonl"))
    committed = open_run(run).committed_steps[0]
    # Flushed on the failure path (the signal may land between a step's metrics line and its
    # telemetry row).
    assert logged < 64 and committed in (logged, logged - 1) and committed >= 8


def test_sigterm_twice_is_one_stop_request(manifest, tmp_path):
    """Under SLURM a worker often gets two SIGTERMs for one preemption (its own, and torchrun's
    forwarded one): still one checkpoint at the step boundary and a requeue."""
    process, run = _start_long_run(manifest, tmp_path, 9)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=EXIT_S)
    assert process.returncode == 75, err[-2000:]
    assert json.loads((run / "status.json").read_text())["state"] == "interrupted"


def test_evaluations_between_steps_stay_out_of_the_telemetry(manifest, tmp_path):
    every_step = write_manifest(
        derive(
            manifest,
            {"schedule.train_steps": 4, "schedule.eval_interval": 1, "telemetry.every_steps": 2},
            "evaluate after every step",
        ),
        tmp_path / "eval.yaml",
    )
    run_training(every_step, tmp_path / "run", progress=False)
    history = open_run(tmp_path / "run").module_history(TARGET)
    assert (history["fp8_gemms"] == 6).all()  # the training micro-batches' GEMMs only
    assert history.loc[[1, 3], "input.saturation"].isna().all()  # not measuring steps
    assert history.loc[[1, 3], "fp8_rel_error"].isna().all()


def test_a_store_of_another_catalogue_refuses_the_resume_saying_what_to_do(manifest, tmp_path):
    """A store written before the block metrics existed (40 module metrics, not 52): the resume
    cannot append rows of another layout to it, and says so before training."""
    from fp8ops.run import read_run_record
    from fp8ops.start.plan import ResumeRequest, plan_start
    from fp8ops.telemetry import TelemetryWriter
    from fp8ops.telemetry.catalogue import STEP_METRIC_NAMES

    run = tmp_path / "run"
    trainer = _trainer(manifest, run, steps=4)
    try:
        trainer.train(stop_at=2)
    finally:
        shutdown_distributed()
        trainer.run.release()  # as the process's end would: the resume below claims the run
    store = run / "telemetry.zarr"
    modules = open_run(run).modules
    old = [m for m in MODULE_METRIC_NAMES if ".block_" not in m and "blocks_at" not in m]
    assert len(old) == 40 and len(MODULE_METRIC_NAMES) == 52
    shutil.rmtree(store)
    run_id = {"run_id": read_run_record(run).run_id}  # this run's store, of an older layout
    writer = TelemetryWriter(store, rank=0, modules=modules, module_metrics=old, attrs=run_id)
    for step in (1, 2):
        writer.append(
            step,
            np.zeros((len(modules), len(old)), np.float32),
            np.zeros(len(STEP_METRIC_NAMES), np.float32),
        )
    writer.close()
    plan = plan_start(ResumeRequest(run))
    ranks = init_distributed(plan.manifest.topology, source="test")
    try:
        with pytest.raises(TelemetryError) as refused:
            open_trainer(plan, ranks, progress=False)
    finally:
        shutdown_distributed()
    message = str(refused.value)
    assert "holds 40 module metrics per row" in message and "writes 52" in message
    assert "input.block_exp_min" in message and f"mv {store} {store}.old" in message
    assert open_run(run).committed_steps == {0: 2}  # the store is left as it was


@pytest.mark.slow  # two runs trained
def test_a_store_linked_from_another_run_is_not_continued(manifest, tmp_path):
    """Found by trying to attack a run: telemetry.zarr replaced by a link to another run's
    store got this run's resumed steps appended to that run's telemetry (and a resume drops a
    store's steps past its own). The store names the run that made it; another's is refused
    before anything is opened for writing."""
    from fp8ops.start.plan import ResumeRequest, plan_start

    runs = {}
    for name in ("mine", "theirs"):
        runs[name] = tmp_path / name
        trainer = _trainer(manifest, runs[name], steps=6)
        try:
            trainer.train(stop_at=4 if name == "theirs" else 2)
        finally:
            shutdown_distributed()
            trainer.run.release()
    store, theirs = runs["mine"] / "telemetry.zarr", runs["theirs"] / "telemetry.zarr"
    before = {p.relative_to(theirs): p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    shutil.rmtree(store)
    store.symlink_to(theirs)
    plan = plan_start(ResumeRequest(runs["mine"]))
    ranks = init_distributed(plan.manifest.topology, source="test")
    try:
        with pytest.raises(TelemetryError, match="was written by another run") as refused:
            open_trainer(plan, ranks, progress=False)
    finally:
        shutdown_distributed()
    assert f"mv {store} {store}.damaged" in str(refused.value)
    after = {p.relative_to(theirs): p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    assert after == before  # their store: not a byte changed, its steps 3 and 4 kept
    assert open_run(runs["theirs"]).committed_steps == {0: 4}
