"""The metric sinks (``fp8ops.sinks``): what a run's records become, the per-layer summary, the
dispatcher's bounded queue and its failing sinks, and TensorBoard, W&B (offline) and MLflow (a
local file store) written and read back with their own readers, a resume from an earlier
checkpoint continuing each without a step twice."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support import sink_readers

import fp8ops.sinks.configured as configured_module
from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.schema import Logging
from fp8ops.sinks import Dispatcher, RunContext, check_libraries, make_sinks, sink_names
from fp8ops.sinks.items import Checkpointed, Ended, Scalars, Text, from_alerts, from_record
from fp8ops.sinks.layers import worst_modules
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


def _metrics(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "tokens": 512, "grad_norm": None, "skipped": False}


# -- records into items ------------------------------------------------------------------------


def test_a_metrics_row_becomes_train_scalars_every_n_steps():
    row = {**_metrics(4, 2.5), "lr": 1e-3, "tokens_per_s": float("nan")}
    [item] = from_record("metrics.jsonl", row, step=3, every_steps=2)
    # None (a non-finite grad norm) is left out; a bool is a number; NaN stays NaN.
    assert item.step == 4
    assert set(item.values) == {
        "train/loss",
        "train/tokens",
        "train/skipped",
        "train/lr",
        "train/tokens_per_s",
    }
    assert item.values["train/loss"] == 2.5 and item.values["train/skipped"] == 0.0
    assert math.isnan(item.values["train/tokens_per_s"])
    assert from_record("metrics.jsonl", _metrics(5, 2.0), step=4, every_steps=2) == []


def test_evaluations_capability_and_events_become_items():
    [evaluation] = from_record(
        "eval.jsonl",
        {"step": 6, "loss": 1.5, "buckets": {"task=add": 1.25}},
        step=6,
        every_steps=1,
    )
    assert evaluation == Scalars(6, {"eval/loss": 1.5, "eval/task=add": 1.25})

    def items(event: dict, step: int = 9):
        return from_record("events.jsonl", {"time": "t", **event}, step=step, every_steps=1)

    assert items({"event": "capability_evaluated", "step": 6, "accuracy": 0.5}) == [
        Scalars(6, {"capability/accuracy": 0.5})
    ]
    assert items({"event": "checkpoint_saved", "step": 6, "path": "x"}) == [Checkpointed(6)]
    assert items({"event": "evaluated", "step": 6, "loss": 1.5}) == []  # eval.jsonl has it
    assert items({"event": "fp8_state_checked", "step": 6, "agree": True}) == []
    [disagree] = items({"event": "fp8_state_checked", "step": 6, "agree": False})
    assert disagree.tag == "events" and '"agree": false' in disagree.text
    # An event without a step is placed at the last step seen; an ending says how it ended.
    text, ended = items({"event": "failed", "error": "RuntimeError: boom"}, step=9)
    assert text == Text(9, "events", 'failed: {"error": "RuntimeError: boom"}')
    assert ended == Ended(9, "failed")


def test_a_steps_alerts_are_counted_per_level_and_each_is_a_line():
    alert = {
        "step": 7,
        "level": "degrade",
        "rule": "saturation",
        "module": "decoder.layers.1.mlp.linear_fc1",
        "metric": "weight.saturation",
        "value": 0.0021,
        "threshold": 0.001,
        "message": "...",
        "rank": 0,
        "action": "proposed",
    }
    nan = {**alert, "level": "stop", "rule": "nonfinite", "module": None, "metric": "loss"}
    nan.update(value="nan", threshold=None, action="stopped", rank=None)
    counts, text = from_alerts([alert, nan])
    assert counts == Scalars(7, {"alerts/observe": 0.0, "alerts/degrade": 1.0, "alerts/stop": 1.0})
    assert text.text.splitlines() == [
        "[degrade] saturation decoder.layers.1.mlp.linear_fc1 weight.saturation 0.0021 vs 0.001 "
        "(rank 0): proposed",
        "[stop] nonfinite loss nan: stopped",
    ]


# -- the per-layer summary ---------------------------------------------------------------------


def test_the_layer_summary_names_the_worst_modules_of_each_key_metric():
    names = ["m0", "m1", "m2", "m3"]
    row = np.full((4, len(MODULE_METRIC_NAMES)), np.nan, dtype=np.float32)
    # A module's saturation is its worst slot's; m3 is quiet (0) and not among the worst.
    row[:, COLUMN["input.saturation"]] = [0.001, 0.0, 0.5, 0.0]
    row[:, COLUMN["weight.saturation"]] = [0.002, 0.003, np.nan, 0.0]
    row[:, COLUMN["grad_output.saturation"]] = [np.nan, 0.004, 0.1, 0.0]
    # A scale that did not move (1.0) is quiet; fp8_rel_error is the module's own column.
    row[:, COLUMN["weight.scale_change"]] = [1.0, 4.0, 1.0, 2.0]
    row[:, COLUMN["fp8_rel_error"]] = [0.03, 0.05, 0.04, 0.02]
    values = worst_modules(names, row, 2)
    f = np.float32  # the row's values, as float() reads them back
    assert values == {
        "layers/saturation/max": float(f(0.5)),
        "layers/saturation/m2": float(f(0.5)),
        "layers/saturation/m1": float(f(0.004)),
        "layers/scale_change/max": 4.0,
        "layers/scale_change/m1": 4.0,
        "layers/scale_change/m3": 2.0,
        "layers/fp8_rel_error/max": float(f(0.05)),
        "layers/fp8_rel_error/m1": float(f(0.05)),
        "layers/fp8_rel_error/m2": float(f(0.04)),
    }  # underflow and blocks_at_floor are NaN everywhere: not measured, not sent
    assert "layers/saturation/m0" in worst_modules(names, row, 3)
    assert worst_modules(names, row, 0) == {k: v for k, v in values.items() if k.endswith("/max")}


# -- the dispatcher: a bounded queue, failing sinks --------------------------------------------


class _Sink:
    """A sink of the test's own (the protocol of fp8ops.sinks.base.Sink): it keeps what it is
    sent, and can be held at ``open``/``write`` or made to raise."""

    def __init__(self, name: str, *, hold: str | None = None, fail: str | None = None):
        self.name, self.hold, self.fail = name, hold, fail
        self.skip_through = 0
        self.items: list = []
        self.release = threading.Event()
        self.closed_with = "not closed"

    def _maybe(self, what: str) -> None:
        if self.hold == what:
            self.release.wait(30)
        if self.fail == what:
            raise OSError(28, "No space left on device")

    def open(self, saved):
        self._maybe("open")

    def write(self, items):
        self._maybe("write")
        self.items += items

    def flush(self):
        pass

    def close(self, outcome):
        self.closed_with = outcome

    def state(self):
        return {"last_step": max((i.step for i in self.items), default=0)}


def _dispatcher(tmp_path, sinks, **kwargs):
    reports = []
    dispatcher = Dispatcher(
        sinks,
        state_file=tmp_path / "sinks.json",
        report=lambda kind, message, fields: reports.append((kind, message)),
        modules=["m0"],
        worst=1,
        **kwargs,
    )
    return dispatcher.start(), reports


def test_a_full_queue_drops_and_counts_and_never_waits(tmp_path):
    stuck = _Sink("stuck", hold="open")  # the thread waits in open(): nothing is taken out
    dispatcher, reports = _dispatcher(tmp_path, [stuck], capacity=4)
    started = time.perf_counter()
    for step in range(1, 51):
        dispatcher.record("metrics.jsonl", _metrics(step, 1.0))
    seconds = time.perf_counter() - started
    assert seconds < 1.0  # 50 puts against a stuck sink (measured: 0.2 ms)
    assert dispatcher.dropped == 46
    assert [kind for kind, _ in reports] == ["sink_records_dropped"]  # reported once
    stuck.release.set()
    assert dispatcher.close(30)
    assert [i.step for i in stuck.items] == [1, 2, 3, 4]  # the queued ones, in order
    assert dispatcher.summary()["dropped"] == 46


def test_a_failing_sink_is_reported_once_and_the_others_go_on(tmp_path):
    full, fine = _Sink("full", fail="write"), _Sink("fine")
    dispatcher, reports = _dispatcher(tmp_path, [full, fine])
    for step in range(1, 6):
        dispatcher.record("metrics.jsonl", _metrics(step, 1.0))
        dispatcher.record("events.jsonl", {"event": "checkpoint_saved", "step": step})
    dispatcher.record("events.jsonl", {"event": "train_completed", "seconds": 1.0})
    assert dispatcher.close(30)
    assert [kind for kind, _ in reports] == ["sink_failed"]
    assert "metric sink full failed (write)" in reports[0][1]
    assert "No space left on device" in reports[0][1]
    assert [i.step for i in fine.items if isinstance(i, Scalars)] == [1, 2, 3, 4, 5]
    assert fine.closed_with == "completed" and full.closed_with == "not closed"
    summary = dispatcher.summary()
    assert list(summary["failed"]) == ["full"] and summary["written"]["full"] == 0
    # sinks.json: the working sink's state at the end; the failed one's as it was when it
    # still worked (a resume continues its run from there).
    assert json.loads((tmp_path / "sinks.json").read_text()) == {
        "fine": {"last_step": 5},
        "full": {"last_step": 0},
    }


def test_closing_waits_a_bounded_time_for_a_sink_that_hangs(tmp_path):
    hung = _Sink("hung", hold="write")
    dispatcher, reports = _dispatcher(tmp_path, [hung])
    dispatcher.record("metrics.jsonl", _metrics(1, 1.0))
    started = time.perf_counter()
    assert not dispatcher.close(0.3)
    assert time.perf_counter() - started < 5.0  # bounded by the wait (measured: 0.3 s)
    assert [kind for kind, _ in reports] == ["sinks_not_closed"]
    hung.release.set()


def test_steps_a_sink_already_holds_are_not_sent_to_it_again(tmp_path):
    behind, ahead = _Sink("behind"), _Sink("ahead")
    ahead.skip_through = 3  # e.g. W&B's last step before a resume from step 1's checkpoint
    dispatcher, _ = _dispatcher(tmp_path, [behind, ahead], start_step=1)
    for step in range(2, 6):
        dispatcher.record("metrics.jsonl", _metrics(step, 1.0))
    assert dispatcher.close(30)
    assert [i.step for i in behind.items] == [2, 3, 4, 5]
    assert [i.step for i in ahead.items] == [4, 5]
    assert dispatcher.summary()["already_sent"] == {"behind": 0, "ahead": 2}


# -- the manifest section and its checks -------------------------------------------------------


def test_a_sink_whose_library_is_missing_is_refused_with_the_pip_command(monkeypatch):
    logging = Logging.model_validate({"tensorboard": {}, "wandb": {"mode": "offline"}})
    assert sink_names(logging) == ["tensorboard", "wandb"]
    monkeypatch.setattr(configured_module, "_installed", lambda module: module != "wandb")
    with pytest.raises(ManifestError) as refused:
        check_libraries(logging)
    assert "logging.wandb needs the wandb package" in str(refused.value)
    assert "pip install 'fp8ops[sinks]'" in str(refused.value)


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("https://me:SECRET@mlflow.example", "holds credentials"),
        ("/srv/mlruns", "must be a URI with its scheme"),
        ("databricks", None),
        ("sqlite:////srv/mlflow.db", None),
    ],
)
def test_an_mlflow_uri_with_credentials_or_without_a_scheme_is_refused(uri, words):
    tiny = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    if words is None:
        derive(tiny, {"logging.mlflow": {"tracking_uri": uri}}, "ok")
        return
    with pytest.raises(ManifestError, match=words) as refused:
        derive(tiny, {"logging.mlflow": {"tracking_uri": uri}}, "refused")
    assert "SECRET" not in str(refused.value)  # credentials are not repeated into logs


# -- the libraries themselves ------------------------------------------------------------------


def _context(run_dir: Path, start_step: int) -> RunContext:
    return RunContext(
        run_dir=run_dir,
        name="sinks-test",
        manifest_hash="a" * 64,
        run_id="run-1",
        start_step=start_step,
        manifest_yaml="name: sinks-test\n",
        config={"name": "sinks-test"},
    )


def _segment(run_dir: Path, logging: Logging, start: int, end: int, offset: float) -> None:
    """Steps start+1..end of a run, losses ``offset + 1/step``, an alert at ``end`` and a
    checkpoint every other step, through every sink of ``logging``; closed."""
    reports = []
    dispatcher = Dispatcher(
        make_sinks(logging, _context(run_dir, start)),
        state_file=run_dir / "sinks.json",
        report=lambda kind, message, fields: reports.append(message),
        modules=["m0", "m1"],
        worst=1,
        start_step=start,
    ).start()
    for step in range(start + 1, end + 1):
        dispatcher.record("metrics.jsonl", _metrics(step, offset + 1 / step))
        row = np.full((2, len(MODULE_METRIC_NAMES)), np.nan, dtype=np.float32)
        row[:, COLUMN["fp8_rel_error"]] = [0.01 * step, 0.02]
        dispatcher.layers(step, row)
        if step % 2 == 0:
            dispatcher.record("events.jsonl", {"event": "checkpoint_saved", "step": step})
    alert = {"step": end, "level": "observe", "rule": "fp8_error", "module": "m0"}
    alert.update(metric="fp8_rel_error", value=0.5, threshold=0.06, message="m", rank=0)
    dispatcher.alerts([{**alert, "action": "logged"}])
    dispatcher.record("events.jsonl", {"event": "paused", "step": end, "reason": "stop-at"})
    assert dispatcher.close(120)
    assert reports == []
    assert dispatcher.summary()["failed"] == {}


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"needs {module}: pip install 'fp8ops[sinks]'",
    )


@pytest.mark.slow
@_needs("tensorboard")
def test_tensorboard_after_a_resume_from_an_earlier_checkpoint_shows_each_step_once(tmp_path):
    logging = Logging.model_validate({"tensorboard": {}})
    _segment(tmp_path, logging, 0, 6, offset=0.0)
    _segment(tmp_path, logging, 4, 8, offset=10.0)  # steps 5 and 6 trained again
    board = tmp_path / "tensorboard"
    f = np.float32  # TensorBoard keeps float32: both sides convert the same float
    assert sink_readers.tensorboard_scalars(board, "train/loss") == [
        (s, float(f((0.0 if s <= 4 else 10.0) + 1 / s))) for s in range(1, 9)
    ]  # the purge at step 5: the attempt that went on
    assert sink_readers.tensorboard_scalars(board, "layers/fp8_rel_error/m1") == [
        (1, float(f(0.02)))
    ]  # m1's 0.02 is the worst at step 1 only; from step 2 on m0's 0.01 * step is
    assert [s for s, _ in sink_readers.tensorboard_scalars(board, "layers/fp8_rel_error/m0")] == [
        2,
        3,
        4,
        5,
        6,
        7,
        8,
    ]
    assert [
        (s, t.strip()) for s, t in sink_readers.tensorboard_text(board, "alerts") if s == 8
    ] == [(8, "[observe] fp8_error m0 fp8_rel_error 0.5 vs 0.06 (rank 0): logged")]


@pytest.mark.slow
@_needs("wandb")
def test_wandb_offline_resume_continues_the_same_run_without_a_step_twice(tmp_path):
    logging = Logging.model_validate({"wandb": {"mode": "offline", "project": "sinks-test"}})
    _segment(tmp_path, logging, 0, 6, offset=0.0)
    first_id = json.loads((tmp_path / "sinks.json").read_text())["wandb"]["run_id"]
    _segment(tmp_path, logging, 4, 8, offset=10.0)
    runs = sink_readers.wandb_runs(tmp_path / "wandb")
    assert [run_id for run_id, _ in runs] == [first_id, first_id]  # one run, two segments
    losses = [(row["_step"], row["train/loss"]) for _, rows in runs for row in rows]
    # W&B keeps a step's first values: the resume sent only what came after step 6.
    assert losses == [(s, (0.0 if s <= 6 else 10.0) + 1 / s) for s in range(1, 9)]
    alerts = [row["alerts"] for _, rows in runs for row in rows if "alerts" in row]
    assert alerts == [
        "[observe] fp8_error m0 fp8_rel_error 0.5 vs 0.06 (rank 0): logged",
        "[observe] fp8_error m0 fp8_rel_error 0.5 vs 0.06 (rank 0): logged",
    ]


@pytest.mark.slow
@_needs("mlflow")
def test_mlflow_file_store_resume_continues_the_same_run_without_a_step_twice(tmp_path):
    logging = Logging.model_validate({"mlflow": {}})
    _segment(tmp_path, logging, 0, 6, offset=0.0)
    _segment(tmp_path, logging, 4, 8, offset=10.0)
    state = json.loads((tmp_path / "sinks.json").read_text())["mlflow"]
    uri, run_id = state["tracking_uri"], state["run_id"]
    assert uri == (tmp_path / "mlruns").as_uri()
    # MLflow keeps every value logged: the resume sent only the steps after its history's last.
    assert sink_readers.mlflow_history(uri, run_id, "train/loss") == [
        (s, (0.0 if s <= 6 else 10.0) + 1 / s) for s in range(1, 9)
    ]
    client = sink_readers.mlflow_client(uri)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"  # paused: the segment ended at --stop-at
    [experiment] = [e for e in client.search_experiments() if e.name == "sinks-test"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    text = Path(client.download_artifacts(run_id, "alerts/step-00000008.txt", str(tmp_path)))
    assert text.read_text() == "[observe] fp8_error m0 fp8_rel_error 0.5 vs 0.06 (rank 0): logged\n"


@pytest.mark.slow
@_needs("mlflow")
def test_an_unreachable_tracking_server_is_reported_once_and_nothing_waits(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries: minutes
    with socket.socket() as probe:  # a port nothing listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logging = Logging.model_validate({"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}})
    reports = []
    dispatcher = Dispatcher(
        make_sinks(logging, _context(tmp_path, 0)),
        state_file=tmp_path / "sinks.json",
        report=lambda kind, message, fields: reports.append((kind, fields)),
        modules=[],
        worst=0,
    ).start()
    started = time.perf_counter()
    for step in range(1, 101):
        dispatcher.record("metrics.jsonl", _metrics(step, 1.0))
    assert time.perf_counter() - started < 1.0  # measured: 1 ms for 100 steps
    assert dispatcher.close(120)
    assert [(kind, fields["sink"], fields["during"]) for kind, fields in reports] == [
        ("sink_failed", "mlflow", "open")
    ]
