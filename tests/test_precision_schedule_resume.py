"""The precision schedule in training, end to end on the small model: each switch at its step
boundary recorded (``layers.json``'s table and history, a ``precision_phase`` event); a stop just
before a switch resumed equal to the straight run bit for bit; and a changed schedule at resume
refused as drift unless accepted."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.small_model import write_small_finetune

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.files import read_jsonl
from fp8ops.run import read_metrics
from fp8ops.run.records import read_layers_json
from fp8ops.telemetry import open_run
from fp8ops.train import run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

STEPS = 6
FC1 = "decoder.layers.1.mlp.linear_fc1"
FC2 = "decoder.layers.0.mlp.linear_fc2"
SCHEDULE = [
    # FC1 in BF16 for steps 2 and 3, back in FP8 from step 4.
    {"start": 2, "end": 3, "modules": [FC1], "reason": "a BF16 interval"},
    # fprop of every projection in BF16 for the last third: steps 5 and 6.
    {"start_fraction": 0.67, "modules": ["decoder.layers.*"], "gemms": ["fprop"], "reason": "end"},
    # FC2 of layer 0 under current scaling for step 4 only: its delayed state frozen meanwhile.
    {"start": 4, "end": 4, "modules": [FC2], "to": "current", "reason": "another recipe"},
]


@pytest.mark.slow  # four trainings of the small model, three of them half as long
def test_scheduled_switches_are_recorded_and_a_stop_before_one_resumes_as_straight(
    small_base, tmp_path, cli
):
    manifest = write_small_finetune(
        tmp_path / "m.yaml",
        small_base,
        {
            "schedule.train_steps": STEPS,
            "schedule.eval_interval": STEPS,
            "data.num_examples": 400,
            "telemetry.every_steps": 1,
            "precision.schedule": SCHEDULE,
        },
    )
    run, paused = tmp_path / "run", tmp_path / "paused"
    run_training(manifest, run, progress=False)
    run_training(manifest, paused, progress=False, stop_at=3)  # just before the switch at 4

    events = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "precision_phase"]
    assert [(e["step"], e["started"], e["ended"]) for e in events] == [
        (2, [0], []),
        (4, [2], [0]),
        (5, [1], [2]),
    ]
    assert events[0]["modules"] == [FC1] and events[0]["base_gemms"] == {
        FC1: ["fprop", "dgrad", "wgrad"]
    }
    assert events[0]["to"] == {FC1: "bf16"}
    assert events[1]["to"] == {FC2: "current", FC1: "delayed"}
    assert len(events[2]["modules"]) == 8 and set(events[2]["to"].values()) == {"delayed"}
    layers = read_layers_json(run)
    assert [(c.step, c.cause) for c in layers.history] == [
        (2, "precision.schedule[0] starts"),
        (
            4,
            "precision.schedule[2] starts (to current scaling); "
            "precision.schedule[0] ended with step 3",
        ),
        (5, "precision.schedule[1] starts; precision.schedule[2] ended with step 4"),
    ]
    assert layers.history[-1].table_hash == layers.table_hash  # the table it runs now
    assert layers.table.row(FC1).fp8_gemms == ("dgrad", "wgrad")
    # What the telemetry saw: FC1 cast nothing while in BF16, its three GEMMs in FP8 around.
    fp8_gemms = open_run(run).module_history(FC1)["fp8_gemms"].to_numpy()
    micro_batches = fp8_gemms[0] / 3
    assert micro_batches >= 1
    assert list(fp8_gemms / micro_batches) == [3, 0, 0, 3, 2, 2]
    # FC2 ran FP8 throughout, current scaling at step 4: its delayed state, frozen then, is
    # not what it cast, so that row's state metrics are NaN (the others' are not).
    fc2 = open_run(run).module_history(FC2)
    assert list(fc2["fp8_gemms"].to_numpy() / micro_batches) == [3, 3, 3, 3, 2, 2]
    assert list(fc2["input.scale"].isna()) == [False, False, False, True, False, False]
    stopped = read_layers_json(paused).table.row(FC2)  # the table for step 4, the resume's
    assert (stopped.scaling, stopped.reason.code) == ("current", "schedule")

    # The stopped run's checkpoint carries the table for step 4, which the resume decides again.
    copy = tmp_path / "copy"
    shutil.copytree(paused, copy)
    changed = [dict(SCHEDULE[0], end=4), *SCHEDULE[1:]]
    drift = cli("resume", paused, "--set", f"precision.schedule={changed}", "--no-progress")
    assert drift.code == 4 and "precision.schedule" in drift.err, drift.err
    finished = cli("resume", paused, "--no-progress")
    assert finished.code == 0, finished.err
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert [m.loss for m in read_metrics(paused)] == [m.loss for m in read_metrics(run)]
    final, straight = (r / "checkpoints" / checkpoint_name(STEPS) for r in (paused, run))
    assert read_meta(final).weights_fingerprint == read_meta(straight).weights_fingerprint
    resumed = read_layers_json(paused)
    assert resumed.table_hash == layers.table_hash and resumed.history == layers.history

    # Accepted, the changed schedule runs: FC1 stays in BF16 for step 4 too.
    accepted = cli(
        "resume",
        copy,
        "--set",
        f"precision.schedule={changed}",
        "--accept-drift",
        "FC1 longer in BF16",
        "--no-progress",
    )
    assert accepted.code == 0, accepted.err
    fp8_gemms = open_run(copy).module_history(FC1)["fp8_gemms"].to_numpy()
    assert list(fp8_gemms / micro_batches) == [3, 0, 0, 0, 2, 2]
    # Its history: the switches up to the stop as they ran, then the changed schedule's.
    history = [(c.step, c.cause) for c in read_layers_json(copy).history]
    assert history == [
        (2, "precision.schedule[0] starts"),
        (4, "precision.schedule[2] starts (to current scaling)"),
        (
            5,
            "precision.schedule[1] starts; precision.schedule[0] ended with step 4; "
            "precision.schedule[2] ended with step 4",
        ),
    ]


@pytest.mark.slow  # two short trainings of the small model
def test_a_stop_checkpoint_before_a_switch_carries_the_next_steps_table(small_base, tmp_path):
    """As a pause's checkpoint does: a resume decides the table of the step after the Stop, and
    the Stop's checkpoint must hold that table, else the resume reads the switch as drift."""
    from fp8ops.train.ending import StopRun

    settings = {
        "schedule.train_steps": 8,
        "schedule.eval_interval": 8,
        "data.num_examples": 400,
        "telemetry.every_steps": 1,
        "telemetry.error_sample_every": 1,
        "precision.margin": 17,  # most of every FP8 tensor underflows: the FP8-error Stop fires
    }
    plain = write_small_finetune(tmp_path / "plain.yaml", small_base, settings)
    with pytest.raises(StopRun) as first:
        run_training(plain, tmp_path / "plain", progress=False)
    halted = first.value.alerts[0]["step"]
    assert halted < 8
    phase = {"start": halted + 1, "modules": [FC1], "reason": "from the step after the Stop"}
    scheduled = write_small_finetune(
        tmp_path / "scheduled.yaml", small_base, {**settings, "precision.schedule": [phase]}
    )
    with pytest.raises(StopRun) as second:
        run_training(scheduled, tmp_path / "run", progress=False)
    assert second.value.alerts[0]["step"] == halted  # the phase starts after it
    layers = read_layers_json(tmp_path / "run")
    assert [(c.step, c.cause) for c in layers.history] == [
        (halted + 1, "precision.schedule[0] starts")
    ]
    saved = read_meta(tmp_path / "run" / "checkpoints" / checkpoint_name(halted))
    assert saved.admission == layers.history[-1].table_hash == layers.table_hash
    assert not layers.table.row(FC1).fp8
