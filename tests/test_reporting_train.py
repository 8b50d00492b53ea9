"""Metric sinks and alert notifications on a real training run of the small model: every sink
written as the run trains and read back with its own reader, a resume from an earlier checkpoint
continuing the same TensorBoard directory, W&B run and MLflow run without a step twice, the
per-layer summary equal to the telemetry store's values, every alert of ``alerts.jsonl`` at the
webhook; and a Stop alert that ends the process (exit 3) after its notification went out, with
one webhook down and one too slow, and nothing missing from ``alerts.jsonl``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)
for _library in ("tensorboard", "wandb", "mlflow"):
    if importlib.util.find_spec(_library) is None:
        pytest.skip("needs the sinks extra: pip install -e '.[sinks]'", allow_module_level=True)

from support import sink_readers
from support.small_model import write_small_finetune
from support.webhook_server import WebhookServer, refused_url

from fp8ops.alerts import read_alerts
from fp8ops.files import read_jsonl
from fp8ops.run import read_evals, read_metrics
from fp8ops.telemetry.reader import open_run
from fp8ops.train import resume_training, run_training

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

# Every sampled FP8 error (every other step) is over the observe level: alerts every run has.
WATCHED = {
    "schedule.train_steps": 8,
    "schedule.eval_interval": 4,
    "schedule.checkpoint_interval": 2,
    "schedule.keep_checkpoints": 4,
    "telemetry.error_sample_every": 2,
    "alerts.patience_steps": 1,
    "alerts.fp8_rel_error": {"observe": 0.0},
}


def _key(alert) -> tuple:
    return (alert["step"], alert["level"], alert["rule"], alert["module"], alert["rank"])


def test_every_sink_follows_the_run_and_a_resume_continues_them_once_per_step(
    small_base, tmp_path, monkeypatch
):
    manifest = write_small_finetune(
        tmp_path / "m.yaml",
        small_base,
        {
            **WATCHED,
            "logging.tensorboard": {},
            "logging.wandb": {"mode": "offline"},
            "logging.mlflow": {},
            "logging.worst_modules": 2,
            "notifications.webhooks": [{"url_env": "FP8OPS_TEST_HOOK", "level": "observe"}],
        },
    )
    run_dir = tmp_path / "run"
    with WebhookServer() as hook:
        monkeypatch.setenv("FP8OPS_TEST_HOOK", hook.url)
        run_training(manifest, run_dir, progress=False, stop_at=6)
        first_attempt = {}
        for line in read_jsonl(run_dir / "metrics.jsonl"):
            first_attempt.setdefault(line["step"], line["loss"])
        # From step 4's checkpoint: steps 5 and 6 are trained again.
        resume_training(run_dir, checkpoint="step_00000004", progress=False)
    metrics = {row.step: row.loss for row in read_metrics(run_dir)}  # the attempt that went on
    assert sorted(metrics) == list(range(1, 9))
    f32 = np.float32  # TensorBoard keeps float32: both sides convert the same float

    # TensorBoard: each step once, the resumed attempt's (purged from step 5 on).
    board = run_dir / "tensorboard"
    assert sink_readers.tensorboard_scalars(board, "train/loss") == [
        (s, float(f32(metrics[s]))) for s in range(1, 9)
    ]
    evals = {row.step: row.loss for row in read_evals(run_dir)}
    assert sink_readers.tensorboard_scalars(board, "eval/loss") == [
        (s, float(f32(evals[s]))) for s in (4, 8)
    ]
    # The per-layer summary is the store's: its largest sampled error over every module.
    store = open_run(run_dir)
    for step, value in sink_readers.tensorboard_scalars(board, "layers/fp8_rel_error/max"):
        assert value == float(store.step_snapshot(step)["fp8_rel_error"].max())
    sampled = [s for s, _ in sink_readers.tensorboard_scalars(board, "layers/fp8_rel_error/max")]
    assert sampled == [2, 4, 6, 8]

    # W&B: one run, two segments; it keeps a step's first values, so steps 5 and 6 are the
    # first attempt's and the resume sent only 7 and 8.
    state = json.loads((run_dir / "sinks.json").read_text())
    runs = sink_readers.wandb_runs(run_dir / "wandb")
    assert [run_id for run_id, _ in runs] == [state["wandb"]["run_id"]] * 2
    sent = [(row["_step"], row["train/loss"]) for _, rows in runs for row in rows]
    assert sent == [(s, first_attempt[s] if s <= 6 else metrics[s]) for s in range(1, 9)]

    # MLflow: one run, each step once, the same first values.
    uri, run_id = state["mlflow"]["tracking_uri"], state["mlflow"]["run_id"]
    assert sink_readers.mlflow_history(uri, run_id, "train/loss") == sent
    assert sink_readers.mlflow_client(uri).get_run(run_id).info.status == "FINISHED"

    # The webhook got every alert of alerts.jsonl, each with what the run did.
    recorded = sorted(_key(a.to_json()) for a in read_alerts(run_dir))
    assert recorded  # the observe level of 0 fires on the sampled steps
    told = [a for body in hook.bodies() for a in body["alerts"]]
    assert sorted(_key(a) for a in told) == recorded
    assert {a["action"] for a in told} == {"logged"}
    assert {body["run"]["dir"] for body in hook.bodies()} == {str(run_dir.resolve())}
    texts = sink_readers.tensorboard_text(board, "alerts")
    assert sum(len(text.splitlines()) for _, text in texts) == len(recorded)

    events = list(read_jsonl(run_dir / "events.jsonl"))
    closed = [e for e in events if e["event"] == "sinks_closed"]
    assert [e["failed"] for e in closed] == [{}, {}]  # one per segment, nothing failed
    assert [e["dropped"] for e in closed] == [0, 0]
    assert not [e for e in events if e["event"].startswith(("sink_", "notification_"))]


def test_a_stop_alert_notifies_before_the_process_exits_with_webhooks_down_and_slow(
    small_base, tmp_path
):
    manifest = write_small_finetune(
        tmp_path / "m.yaml",
        small_base,
        {
            **WATCHED,
            "alerts.fp8_rel_error": {"observe": 0.0, "degrade": 0.0, "stop": 0.0},
            "logging.tensorboard": {},
            "notifications.webhooks": [
                {"url_env": "HOOK_UP", "level": "stop"},
                {"url_env": "HOOK_DOWN", "format": "slack", "level": "stop"},
                {"url_env": "HOOK_SLOW", "level": "stop"},
            ],
            # The slow server answers after 6 s: past the timeout however busy the machine.
            "notifications.timeout_seconds": 2.0,
            "notifications.retries": 1,
            "notifications.exit_wait_seconds": 20.0,
        },
    )
    run_dir = tmp_path / "run"
    with WebhookServer() as up, WebhookServer(delay=6.0) as slow:
        environment = dict(os.environ, HOOK_UP=up.url, HOOK_DOWN=refused_url(), HOOK_SLOW=slow.url)
        done = subprocess.run(
            [sys.executable, "-m", "fp8ops", "train", str(manifest), "--run-dir", str(run_dir)]
            + ["--no-progress"],
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
        slow_tries = len(slow.requests)
    # The process ended after its notice reached the webhook that was up: at least once (on a
    # machine busy enough for that server to answer after the timeout, the same notice again).
    bodies = up.bodies()
    assert bodies and all(b == bodies[0] for b in bodies)
    body = bodies[0]
    assert body["did"] == "stopped" and body["level"] == "stop" and body["step"] == 2
    stops = [a.to_json() for a in read_alerts(run_dir) if a.level == "stop"]
    assert stops and sorted(_key(a) for a in body["alerts"]) == sorted(map(_key, stops))
    assert slow_tries == 2  # tried, timed out, tried again (retries: 1)
    failures = {
        e["url_env"]: e["error"]
        for e in read_jsonl(run_dir / "events.jsonl")
        if e["event"] == "notification_failed"
    }
    assert failures == {
        "HOOK_DOWN": "Connection refused (2 tries)",
        "HOOK_SLOW": "timed out (2 tries)",
    }
    assert "webhook 1 (HOOK_DOWN, slack) could not be told" in done.stderr
    assert "http://" not in done.stderr  # no webhook's URL is printed
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    # The sinks saw the Stop too.
    texts = sink_readers.tensorboard_text(run_dir / "tensorboard", "events")
    assert any(text.strip().startswith("stopped:") for _, text in texts)
