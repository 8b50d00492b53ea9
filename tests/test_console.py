"""The ops console without a browser: the app object on a real run, the data behind its views,
the window what-if, the commands, the notebook under nbclient, and a live run followed.

The run is the small model's: the shared small base, then 12 FP8 fine-tuning steps with
telemetry every step and a checkpoint every 4 (as in test_resume.py). Tests that write to the
ledger work on a copy of it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)
for _package in ("ipywidgets", "plotly"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(
            f"needs the console extra: pip install -e '.[console]' ({_package})",
            allow_module_level=True,
        )

from support.console_run import STEPS, make_trained_run

from fp8ops.console import ConsoleApp
from fp8ops.console import app as console_app
from fp8ops.console.data import Overview, pool, window_heatmap
from fp8ops.console.notebook import notebook
from fp8ops.console.whatif import (
    CurrentScaling,
    SlotWhatIf,
    Window,
    fidelity,
    replay,
    replay_slots,
    run_window,
)
from fp8ops.files import read_jsonl
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.telemetry import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, TelemetryWriter, open_run

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(small_base, tmp_path_factory) -> tuple[Path, Path]:
    return make_trained_run(tmp_path_factory.mktemp("console"), small_base)


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the trained run to write to (ledger actions), alone in its runs directory."""
    copy = tmp_path / "runs" / "finetune"
    shutil.copytree(trained[1], copy)
    return copy


def console(run_dir: Path, user: str = "ana") -> ConsoleApp:
    app = ConsoleApp(run_dir.parent, user=user, follow=False)
    assert app.run is not None and app.run.run_dir == run_dir, app.message.value
    return app


def ledger_lines(run_dir: Path) -> list[dict]:
    return list(read_jsonl(run_dir / "overrides.jsonl"))


# -- views ----------------------------------------------------------------------------------------


def test_the_header_names_manifest_recipe_state_step_and_alerts(trained):
    _, run = trained
    app = console(run)
    header = app.header.value
    assert manifest_hash(load_manifest(run / "manifest.yaml"))[:12] in header
    assert "completed" in header and "amax_history_len 16" in header and "TP 1 x PP 1" in header
    assert f"<span class='fp8ops-last-step'>{STEPS}</span>" in header
    alerts = list(read_jsonl(run / "alerts.jsonl"))
    assert f"{sum(a['level'] == 'observe' for a in alerts)} observe" in header
    assert app.message.value == ""
    # No schedule, no policy: the switches section says so, with no empty plot.
    assert "no precision switches in this run" in app.switches_note.value
    assert app.timeline_view.output.outputs == () and app.switches_table.value == ""


def test_the_heatmap_holds_the_metric_for_every_module_and_step(trained):
    _, run = trained
    app = console(run)
    store = open_run(run)
    trace = app.heatmap_fig.data[0]
    assert list(trace.y) == list(store.modules) and list(trace.x) == list(range(1, STEPS + 1))
    expected = store.metric_window("input.amax").to_numpy().T
    np.testing.assert_array_equal(np.asarray(trace.customdata, np.float32), expected)
    np.testing.assert_allclose(np.asarray(trace.z, np.float64), np.log10(expected), rtol=1e-6)

    app.log_scale.value = False
    app.metric.value = "weight.saturation"
    np.testing.assert_array_equal(
        np.asarray(app.heatmap_fig.data[0].z, np.float32),
        store.metric_window("weight.saturation").to_numpy().T,
    )
    app.window.value = 0  # whole run: pooled per 256-step block; 12 steps are one partial block
    z = np.asarray(app.heatmap_fig.data[0].z, np.float32)
    assert z.shape == (len(store.modules), 1)
    np.testing.assert_array_equal(z[:, 0], store.metric_window("weight.saturation").max().values)


def test_choosing_a_module_changes_the_figure_data(trained):
    _, run = trained
    app = console(run)
    store = open_run(run)
    first, other = store.modules[0], store.modules[-1]
    assert app.module.value == first
    before = np.asarray(app.detail_fig.data[0].y)

    app.module.value = other
    amax = app.detail_fig.data[0]
    assert app.detail_fig.layout.title.text.startswith(f"{other} · input")
    assert not np.array_equal(before, np.asarray(amax.y))
    np.testing.assert_array_equal(
        np.asarray(amax.y, np.float32), store.module_history(other, "input.amax").to_numpy()[:, 0]
    )
    app.slot.value = "weight"
    assert app.detail_fig.data[0].name == "weight amax"
    np.testing.assert_array_equal(
        np.asarray(app.detail_fig.data[2].y, np.float32),
        store.module_history(other, "weight.scale").to_numpy()[:, 0],
    )
    traces = {trace.name: trace for trace in app.detail_fig.data}
    error = traces["FP8 vs BF16 error"]  # sampled every 2nd step: the unmeasured are left out
    assert list(error.x) == list(range(2, STEPS + 1, 2))


def test_metrics_the_recipe_does_not_have_are_named_not_applicable(trained):
    """A delayed run has no block metrics: the module view says so on the line, and the heatmap
    says so instead of "nothing measured"; the lines the recipe has carry no such mark."""
    _, run = trained
    app = console(run)
    names = [trace.name for trace in app.detail_fig.data]
    assert "blocks at floor (n/a: delayed scaling)" in names
    assert "input window max" in names and "input scale" in names
    assert "delayed scaling" in app.detail_fig.layout.title.text
    app.metric.value = "input.blocks_at_floor"
    assert "not applicable under delayed scaling" in app.heatmap_note.value
    app.metric.value = "input.saturation"
    assert "not applicable" not in app.heatmap_note.value


def test_an_alert_row_leads_to_its_module(trained):
    _, run = trained
    app = console(run)
    alerts = list(read_jsonl(run / "alerts.jsonl"))
    assert alerts, "the small run raises a few observe alerts"
    assert len(app.alerts_list.options) == len(alerts)
    label, index = app.alerts_list.options[-1]  # the oldest, listed last
    app.alerts_list.value = index
    assert app.module.value == alerts[0]["module"] and alerts[0]["module"] in label
    app.alert_level.value = "stop"
    assert app.alerts_list.options == ()


# -- overrides --------------------------------------------------------------------------------


def test_staging_writes_a_ledger_record_with_its_triggers(run_copy):
    app = console(run_copy)
    alert = next(iter(read_jsonl(run_copy / "alerts.jsonl")))
    app.module.value = alert["module"]  # selects it for staging too
    assert app.stage_modules.value == (alert["module"],)
    app.stage_button.click()
    assert "refused" in app.message.value and "reason" in app.message.value  # reason required
    assert not (run_copy / "overrides.jsonl").exists() or not ledger_lines(run_copy)

    app.stage_reason.value = "input saturation since step 4"
    app.user.value = " "
    app.stage_button.click()
    assert "enter the operator" in app.message.value
    assert app.stage_reason.value  # kept, to try again
    app.user.value = "ana"
    app.stage_button.click()
    (record,) = ledger_lines(run_copy)
    assert (record["kind"], record["module"], record["who"]) == ("staged", alert["module"], "ana")
    assert record["reason"] == "input saturation since step 4"
    assert [t["metric"] for t in record["triggers"]] == [alert["metric"]]  # from alerts.jsonl
    assert "staged" in app.message.value and record["hash"][:12] in app.message.value
    assert app.override_pick.value == record["hash"]
    assert "staged" in app.ledger_table.value
    assert "no new revision" in app.resume_preview.value  # staged is not approved yet


def test_approval_by_the_same_operator_is_refused_and_another_one_approves(run_copy):
    app = console(run_copy, user="ana")
    module = app.module.value
    app.stage_reason.value = "grad spikes"
    app.stage_button.click()
    app.approve_button.click()  # still ana
    assert "refused" in app.message.value and "cannot approve it too" in app.message.value
    assert len(ledger_lines(run_copy)) == 1

    app.user.value = "ben"
    app.approve_button.click()
    staged, approved = ledger_lines(run_copy)
    assert (approved["kind"], approved["who"], approved["override"]) == (
        "approved",
        "ben",
        staged["hash"],
    )
    preview = app.resume_preview.value
    assert "new revision 2" in preview and "precision.overrides" in preview
    assert f"applies {staged['hash'][:12]}: {module} -&gt; bf16" in preview
    assert "approved" in app.ledger_table.value


def test_a_module_staged_to_current_scaling_previews_a_module_recipe(run_copy):
    app = console(run_copy, user="ana")
    module = app.module.value
    app.stage_reason.value = "saturates; current scaling follows it"
    app.stage_to.value = "current"
    app.stage_button.click()
    (staged,) = ledger_lines(run_copy)
    assert (staged["dtype"], staged["scaling"]) == ("fp8", "current")
    assert f"staged {module} to current scaling" in app.message.value
    app.user.value = "ben"
    app.approve_button.click()
    preview = app.resume_preview.value
    assert "precision.module_recipes" in preview and "precision.overrides" not in preview
    assert f"applies {staged['hash'][:12]}: {module} -&gt; current scaling" in preview


def test_a_module_staged_for_some_gemms_previews_an_override_of_those(run_copy):
    app = console(run_copy, user="ana")
    module = app.module.value
    assert app.stage_gemms.value == ("fprop", "dgrad", "wgrad")  # the whole module by default
    app.stage_reason.value = "gradients saturate"
    app.stage_gemms.value = ("dgrad", "wgrad")
    app.stage_button.click()
    (staged,) = ledger_lines(run_copy)
    assert staged["gemms"] == ["dgrad", "wgrad"]
    assert f"staged {module} to bf16 (dgrad, wgrad)" in app.message.value
    assert app.stage_gemms.value == ("fprop", "dgrad", "wgrad")  # back for the next staging
    app.user.value = "ben"
    app.approve_button.click()
    preview = app.resume_preview.value
    assert f"applies {staged['hash'][:12]}: {module} -&gt; bf16 (dgrad, wgrad)" in preview
    assert "precision.overrides" in preview


def test_self_approval_when_the_manifest_allows_it(run_copy):
    solo = derive(
        load_manifest(run_copy / "manifest.yaml"),
        {"review.allow_self_approval": True},
        "one-person team",
    )
    _lock_to(run_copy, solo, accepted="one-person team")
    app = console(run_copy, user="ana")
    app.stage_reason.value = "trying"
    app.stage_button.click()
    app.approve_button.click()
    assert [r["who"] for r in ledger_lines(run_copy)] == ["ana", "ana"]


def _lock_to(run, manifest, accepted=None):
    """Lock ``run`` to a new revision, as a resume with accepted drift does (RunDir.reopen);
    ``accepted``: the reason its ``resumed`` event records (a revision that loosens the review
    rules holds only with it)."""
    ManifestStore(run / "manifests").put(manifest)
    (run / "manifest.yaml").unlink()  # (write_manifest never overwrites)
    write_manifest(manifest, run / "manifest.yaml")
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "manifest": manifest_hash(manifest)}))
    if accepted is not None:
        event = {"event": "resumed", "new_revisions": [manifest_hash(manifest)]}
        with (run / "events.jsonl").open("a") as events:
            events.write(json.dumps({**event, "accepted": accepted}) + "\n")


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_the_console_signs_with_the_key_it_is_given_and_flags_what_does_not_verify(
    run_copy, tmp_path
):
    import hashlib

    from fp8ops.overrides.signing import NAMESPACE

    lines = []
    for name in ("ana", "ben"):
        key = tmp_path / name
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
            check=True,
        )
        lines.append(f'{name} namespaces="{NAMESPACE}" {(tmp_path / f"{name}.pub").read_text()}')
    allowed = tmp_path / "allowed_signers"
    allowed.write_text("".join(lines))
    signed = derive(
        load_manifest(run_copy / "manifest.yaml"),
        {
            "review.allowed_signers": str(allowed),
            "review.allowed_signers_sha256": hashlib.sha256(allowed.read_bytes()).hexdigest(),
        },
        "operators sign",
    )
    _lock_to(run_copy, signed)
    app = console(run_copy, user="ana")
    app.signing_key.value = str(tmp_path / "ana")
    app.stage_reason.value = "saturation"
    app.stage_button.click()
    (staged,) = ledger_lines(run_copy)
    assert staged["signature"].startswith("-----BEGIN SSH SIGNATURE-----")
    assert "unverified" not in app.ledger_table.value
    app.user.value, app.signing_key.value = "ben", ""  # approves without a key: flagged
    app.approve_button.click()
    assert "signature" not in ledger_lines(run_copy)[1]
    assert "unverified" in app.ledger_table.value and "not signed" in app.ledger_table.value


def test_reject_and_revoke_need_a_reason(run_copy):
    app = console(run_copy)
    app.stage_reason.value = "first try"
    app.stage_button.click()
    app.reject_button.click()
    assert "refused" in app.message.value and len(ledger_lines(run_copy)) == 1
    app.decision_reason.value = "not worth it"
    app.reject_button.click()
    assert ledger_lines(run_copy)[-1]["kind"] == "rejected"
    assert app.override_pick.options == ()  # nothing open any more

    app.stage_reason.value = "second try"
    app.stage_button.click()
    app.user.value = "ben"
    app.approve_button.click()
    app.decision_reason.value = "the saturation went away"
    app.revoke_button.click()
    assert [r["kind"] for r in ledger_lines(run_copy)] == [
        "staged",
        "rejected",
        "staged",
        "approved",
        "revoked",
    ]
    assert "no new revision" in app.resume_preview.value


def test_the_resume_preview_shows_a_refusal_as_text(run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    app = console(run_copy)
    assert "no resume possible now" in app.resume_preview.value
    assert "no checkpoint" in app.resume_preview.value
    assert app.message.value == ""


def test_a_stopped_run_previews_its_refusal_until_an_override_is_approved(run_copy):
    status = json.loads((run_copy / "status.json").read_text())
    (run_copy / "status.json").write_text(json.dumps({**status, "state": "stopped"}))
    app = console(run_copy, user="ana")
    assert "no resume possible now" in app.resume_preview.value
    assert "a Stop alert halted it" in app.resume_preview.value
    app.stage_reason.value = "saturates"
    app.stage_button.click()
    assert "no resume possible now" in app.resume_preview.value  # staged is not approved
    app.user.value = "ben"
    app.approve_button.click()
    assert "new revision 2" in app.resume_preview.value


# -- data behind the views ----------------------------------------------------------------------


def test_pool_keeps_the_worst_of_each_bin():
    values = np.array([[1, 5], [3, np.nan], [2, np.nan], [np.nan, np.nan], [0, 1]], np.float32)
    np.testing.assert_array_equal(pool(values, 2, "max"), [[3, 5], [2, np.nan], [0, 1]])
    np.testing.assert_array_equal(pool(values, 2, "min"), [[1, 5], [2, np.nan], [0, 1]])


MODULES = 4  # of the synthetic stores


def _synthetic_store(path: Path, steps: int) -> TelemetryWriter:
    writer = TelemetryWriter(path, rank=0, modules=[f"m{i}" for i in range(MODULES)])
    return _append(writer, 0, steps)


def _append(writer: TelemetryWriter, first: int, steps: int) -> TelemetryWriter:
    rng = np.random.default_rng(first)
    for step in range(first + 1, first + steps + 1):
        row = rng.random((MODULES, len(MODULE_METRIC_NAMES)), dtype=np.float32)
        writer.append(step, row, np.zeros(len(STEP_METRIC_NAMES), np.float32))
    writer.flush()
    return writer


def test_the_whole_run_overview_equals_pooling_everything_and_grows(tmp_path):
    writer = _synthetic_store(tmp_path / "telemetry.zarr", 700)
    store = open_run(tmp_path)
    overview = Overview(store, "input.scale")  # a scale: the smallest of each bin is kept
    overview.update()
    assert overview.pooled_steps == 512  # two complete blocks; the rest is read each time
    hm = overview.heatmap()
    everything = store.metric_window("input.scale").to_numpy()
    np.testing.assert_array_equal(hm.z, pool(everything, 256, "min").T)
    assert list(hm.starts) == [1, 257, 513] and hm.ends[-1] == 700

    _append(writer, 700, 400)  # 1100 steps now: two more complete blocks
    writer.close()
    store.refresh()
    overview.update()
    assert overview.pooled_steps == 1024
    everything = store.metric_window("input.scale").to_numpy()
    np.testing.assert_array_equal(overview.heatmap().z, pool(everything, 256, "min").T)
    window = window_heatmap(store, "input.scale", 101, 1101)  # 1000 steps: one column each
    np.testing.assert_array_equal(window.z, everything[100:].T)


def test_a_bare_store_shows_what_is_missing(tmp_path):
    _synthetic_store(tmp_path / "run" / "telemetry.zarr", 300).close()
    app = ConsoleApp(tmp_path / "run", follow=False)
    assert "manifest.yaml" in app.header.value  # named as the problem
    assert "no status.json or manifest.yaml" in app.ledger_table.value
    assert np.asarray(app.heatmap_fig.data[0].z).shape == (MODULES, 300)


def test_a_run_unreadable_when_opened_is_read_once_it_can_be(trained, tmp_path):
    """A console opened as a run starts can find its telemetry store half made (the directory,
    no arrays yet): it says so, and following reads the run as soon as it can. (It once kept
    the error for good: a live console test failed so when its run started slowly.)"""
    run = _starting_run(trained[1], tmp_path)
    (run / "telemetry.zarr").mkdir()
    app = ConsoleApp(run.parent, user="ana", follow=False)
    assert app.run is None and "no telemetry store" in app.message.value
    assert app.poll()  # still unreadable: it tried again, and says so again
    assert app.run is None and "no telemetry store" in app.message.value
    _complete_the_store(trained[1], run)
    assert app.poll()
    assert app.run is not None and app.run.run_dir == run and app.message.value == ""
    assert app.run.header.last_step == console(trained[1]).run.header.last_step


def test_a_store_half_made_after_the_run_was_opened_is_read_once_it_can_be(trained, tmp_path):
    """The same, when the run was read before its store existed: the store's directory appears
    first, and the run is read again until the store is whole."""
    run = _starting_run(trained[1], tmp_path)
    app = ConsoleApp(run.parent, user="ana", follow=False)
    assert app.run is not None and app.run.telemetry is None  # no store yet: nothing wrong
    (run / "telemetry.zarr").mkdir()
    assert app.poll()
    assert app.run is None and "no telemetry store" in app.message.value
    assert app.poll()  # nothing else changed on disk: it still tries again
    _complete_the_store(trained[1], run)
    assert app.poll()
    assert app.run is not None and app.run.telemetry is not None and app.message.value == ""


def test_a_run_whose_figures_cannot_be_read_is_shown_with_the_reason(run_copy):
    """Damaged telemetry chunks: the header, modules, alerts and ledger are shown all the same
    (staging an override on such a run is the point), and the message line says why the
    figures are missing."""
    damaged = [
        c
        for c in (run_copy / "telemetry.zarr").rglob("*")
        if c.is_file() and "/module_metrics/c/" in c.as_posix()
    ]
    assert damaged
    for chunk in damaged:
        chunk.write_bytes(b"not a zarr chunk")
    app = ConsoleApp(run_copy.parent, user="ana", follow=False)
    assert app.run is not None and app.run.run_dir == run_copy
    assert "tiny-gpt-cpu" in app.header.value and len(app.module.options) == 8
    assert "color:#b00" in app.message.value and app.message.value.count("Error") >= 1
    assert app.stage_modules.options and "fp8" in app.ledger_table.value
    app.close()


def test_an_unreadable_manifest_while_following_is_named_and_following_goes_on(run_copy):
    app = console(run_copy)
    (run_copy / "manifest.yaml").write_text("precision: [not yaml\n")
    assert app.poll()
    assert "unreadable" in app.header.value and app.message.value == ""
    alerts = (run_copy / "alerts.jsonl").read_text().splitlines()
    (run_copy / "alerts.jsonl").write_text("\n".join(alerts[:-1]) + "\n")
    assert app.poll() and len(app.run.alerts) == len(alerts) - 1  # the next change is drawn
    app.close()


def test_a_pick_that_cannot_be_read_leaves_nothing_of_the_previous_run(trained, run_copy):
    app = console(run_copy)
    live = _starting_run(trained[1], run_copy.parent.parent)
    (live / "telemetry.zarr").mkdir()  # its store half made
    app.refresh_runs()
    app.picker.value = str(live)
    assert app.run is None and "no telemetry store" in app.message.value
    assert app.header.value == "" and app.module.options == () and app.ledger_table.value == ""
    assert not app.heatmap_view.output.outputs and not app.detail_view.output.outputs
    app.close()


def _starting_run(trained_run: Path, tmp_path: Path) -> Path:
    """A run directory as a run starts: its status, manifest and run.json, no store yet."""
    run = tmp_path / "runs" / "live"
    run.mkdir(parents=True)
    for name in ("status.json", "manifest.yaml", "run.json"):
        shutil.copy(trained_run / name, run / name)
    return run


def _complete_the_store(trained_run: Path, run: Path) -> None:
    shutil.rmtree(run / "telemetry.zarr")
    shutil.copytree(trained_run / "telemetry.zarr", run / "telemetry.zarr")


def test_the_picker_switches_between_runs(run_copy):
    bare = run_copy.parent / "bare"
    _synthetic_store(bare / "telemetry.zarr", 300).close()
    app = ConsoleApp(run_copy.parent, follow=False)
    assert sorted(label for label, _ in app.picker.options) == ["bare", "finetune"]
    app.select_run(run_copy)
    assert "tiny-gpt-cpu" in app.header.value and len(app.module.options) == 8
    app.picker.value = str(bare)  # as the operator does
    assert app.run.run_dir == bare and app.module.options == ("m0", "m1", "m2", "m3")
    assert np.asarray(app.heatmap_fig.data[0].z).shape == (MODULES, 300)
    assert "manifest.yaml" in app.header.value


# -- in a kernel: reads off the event loop ---------------------------------------------------------


def _wait_until(condition, timeout_s: float = 60):
    """An awaitable that ticks the event loop (as a kernel's) until ``condition()``."""

    async def wait():
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    return wait()


def _record_threads(monkeypatch, *names: str) -> list[tuple[str, str]]:
    """Have the app module's functions ``names`` record the thread that calls them."""
    calls = []

    def recording(name: str, real):
        def call(*args):
            calls.append((name, threading.current_thread().name))
            return real(*args)

        return call

    for name in names:
        monkeypatch.setattr(console_app, name, recording(name, getattr(console_app, name)))
    return calls


def _figure_data(app: ConsoleApp) -> tuple:
    return (
        np.asarray(app.heatmap_fig.data[0].z).tolist(),
        [list(trace.y) for trace in app.detail_fig.data],
    )


def test_in_an_event_loop_a_run_is_read_in_the_worker_thread_and_shown_as_without_one(
    trained, monkeypatch
):
    """In a kernel (an event loop runs) the app reads the picked run in its worker thread, so
    the page keeps answering meanwhile, and draws what the same app draws without a loop."""
    _, run = trained
    readers = _record_threads(monkeypatch, "read_run")

    async def open_in_a_loop() -> ConsoleApp:
        app = ConsoleApp(run.parent, user="ana", follow=False)
        assert app.run is None  # being read: the loop has not run the result in yet
        await _wait_until(lambda: app.run is not None)
        return app

    live = asyncio.run(open_in_a_loop())
    assert len(readers) == 1 and readers[0][1].startswith("fp8ops-console")
    inline = console(run)
    assert readers[1][1] == threading.main_thread().name
    assert live.header.value == inline.header.value and live.message.value == ""
    assert _figure_data(live) == _figure_data(inline)
    assert live.module.options == inline.module.options
    assert live.ledger_table.value == inline.ledger_table.value
    assert live.resume_preview.value == inline.resume_preview.value
    live.close()
    inline.close()


def test_a_run_picked_while_another_is_read_is_the_only_one_shown(run_copy, monkeypatch):
    """The operator picks a second run while the first is still being read: the first one's
    result, arriving late, is dropped instead of flashing onto the page."""
    bare = run_copy.parent / "bare"
    _synthetic_store(bare / "telemetry.zarr", 300).close()
    first_read_may_finish = threading.Event()
    shown = []

    def read_run(run_dir, *args):
        if not shown and run_dir == first:
            assert first_read_may_finish.wait(60)
        return real_read_run(run_dir, *args)

    def show_run(self, read):
        shown.append(read.run.run_dir)
        real_show_run(self, read)

    real_read_run, real_show_run = console_app.read_run, ConsoleApp._show_run
    monkeypatch.setattr(console_app, "read_run", read_run)
    monkeypatch.setattr(ConsoleApp, "_show_run", show_run)

    async def pick_twice() -> ConsoleApp:
        app = ConsoleApp(run_copy.parent, user="ana", follow=False)  # reads the first run
        app.picker.value = str(second)  # meanwhile, the operator picks the other
        first_read_may_finish.set()
        await _wait_until(lambda: app.run is not None)
        await asyncio.sleep(0.3)  # room for anything late
        return app

    first = bare  # the picker lists runs by name, so the app opens on "bare"
    second = run_copy
    app = asyncio.run(pick_twice())
    assert shown == [second] and app.run.run_dir == second
    assert "tiny-gpt-cpu" in app.header.value and len(app.module.options) == 8
    app.close()


# -- the window what-if --------------------------------------------------------------------------


def test_replay_feeds_the_te_update_and_counts_overflows():
    amax = np.array([1, 2, 4, 1, 1, 1], np.float32)
    r = replay(amax, Window(2, "max", 0), 448.0, steps=range(1, 7))
    # The window holds this step's amax and the previous one; the scale is 448 / its max, and
    # a step casts with the scale of the update before it (the first with 1).
    np.testing.assert_array_equal(r.scale[:, 0], [448, 224, 112, 112, 448, 448])
    np.testing.assert_array_equal(r.scale_used[:, 0], [1, 448, 224, 112, 112, 448])
    assert list(r.steps[r.overflow[:, 0]]) == [2, 3]  # 2 x 448 and 4 x 224 > 448
    np.testing.assert_allclose(r.headroom_bits[:, 0], [np.log2(448), -1, -1, 2, 2, 0])
    # Starting later with a warm-up as long as the window gives the same steps.
    late = replay(amax[2:], Window(2, "max", 0), 448.0, steps=range(3, 7), warmup=2)
    np.testing.assert_array_equal(late.scale, r.scale[4:])


def test_current_scaling_what_if_casts_each_step_with_its_own_scale():
    amax = np.array([1, 2, 4, np.nan, 3, np.inf], np.float32)
    r = replay(amax, CurrentScaling(), 448.0)
    np.testing.assert_array_equal(r.scale_used, r.scale)  # nothing delayed
    assert r.scale[:3, 0].tolist() == [448, 224, 112] and r.scale[5, 0] == 1.0
    assert r.scale[4, 0] == np.float32(448) / np.float32(3)
    assert r.overflow[:, 0].tolist() == [False] * 5 + [True]  # only the inf saturates
    np.testing.assert_allclose(r.headroom_bits[[0, 1, 2, 4], 0], 0.0, atol=1e-6)
    pow2 = replay(amax, CurrentScaling(power_2_scale=True), 448.0)
    assert pow2.scale[4, 0] == 128.0  # 149.33 rounded down
    assert 0 < pow2.headroom_bits[4, 0] < 1
    delayed = replay(amax, Window(1, "max", 0), 448.0)
    assert delayed.overflow[:, 0].sum() > r.overflow[:, 0].sum()


def test_fidelity_counts_only_the_steps_a_slot_cast_in_fp8():
    """A module held in BF16 keeps its frozen scale in the row; those steps are not misses."""
    amax = np.array([np.nan, np.nan, 2, 2], np.float32)  # steps 1-2 held in BF16, then lifted
    r = replay(amax, Window(2, "max", 0), 448.0, steps=range(1, 5))
    recorded = np.array([112, 112, 224, 224], np.float32)  # the frozen scale, then the updates
    assert list(r.scale[:, 0]) == [1, 1, 224, 224]  # a replay starts from TE's initial scale
    assert fidelity(SlotWhatIf("m", "input", recorded, r, r)) == 1.0
    held = replay(np.full(3, np.nan, np.float32), Window(2, "max", 0), 448.0)
    assert np.isnan(fidelity(SlotWhatIf("m", "input", np.ones(3, np.float32), held, held)))


def test_the_replay_reproduces_the_recorded_weight_scales(trained):
    _, run = trained
    store = open_run(run)
    precision = load_manifest(run / "manifest.yaml").precision
    own = run_window(store, precision)
    results = replay_slots(
        store, list(store.modules), ["weight"], own, Window(4, "max", 0), precision.fp8_format
    )
    assert [fidelity(w) for w in results] == [1.0] * len(store.modules)
    later = replay_slots(
        store, list(store.modules), ["weight"], own, own, precision.fp8_format, start=9
    )
    assert list(later[0].steps) == [9, 10, 11, 12] and fidelity(later[0]) == 1.0


def test_the_app_replays_the_module_on_screen(trained):
    _, run = trained
    app = console(run)
    app.slot.value = "weight"
    app.whatif_len.value, app.whatif_algo.value = 1, "most_recent"
    app.whatif_button.click()
    assert "steps that overflowed" in app.whatif_summary.value, app.message.value
    assert "history 1, most_recent, margin 0" in app.whatif_summary.value
    amax = app.whatif_fig.data[0]
    np.testing.assert_array_equal(
        np.asarray(amax.y, np.float32),
        open_run(run).module_history(app.module.value, "weight.amax").to_numpy()[:, 0],
    )


def test_fp8ops_whatif(trained, cli):
    _, run = trained
    result = cli("whatif", run, "--history-len", 64, "--algo", "max", "--top", 3)
    assert result.code == 0, result.err
    assert "what-if: history 64, max, margin 0" in result.out
    assert "run's window: history 16, max, margin 0" in result.out
    data = json.loads(cli("whatif", run, "--slot", "weight", "--json").out)
    assert len(data["rows"]) == 8 and {r["fidelity"] for r in data["rows"]} == {1.0}
    bad = cli("whatif", run, "--algo", "largest")
    assert bad.code == 2 and "unknown amax_compute_algo 'largest'" in bad.err


def test_fp8ops_whatif_current_scaling(trained, cli):
    _, run = trained
    result = cli("whatif", run, "--recipe", "current", "--top", 3)
    assert result.code == 0, result.err
    assert "what-if: current scaling" in result.out
    assert "what-if 0 (headroom" in result.out  # no cast overflows its own scale
    data = json.loads(cli("whatif", run, "--recipe", "current", "--power-2-scale", "--json").out)
    assert data["what_if"] == {"recipe": "current", "power_2_scale": True, "amax_epsilon": 0.0}
    assert all(0 <= r["what_if"]["headroom_p10"] < 1 for r in data["rows"])
    for args, message in (
        (("--recipe", "mxfp8"), "needs every block's amax"),
        (("--recipe", "current", "--margin", "1"), "--margin is a delayed-scaling setting"),
        (("--power-2-scale",), "add --recipe current"),
        (("--recipe", "tensorwise"), "use one of delayed, current"),
    ):
        bad = cli("whatif", run, *args)
        assert bad.code == 2 and message in bad.err, (args, bad.err)


def test_the_app_replays_current_scaling(trained):
    _, run = trained
    app = console(run)
    app.whatif_recipe.value = "current"
    app.whatif_button.click()
    assert "what-if: current scaling" in app.whatif_summary.value, app.message.value


# -- commands and the notebook ----------------------------------------------------------------


def test_fp8ops_console_imports_neither_torch_nor_widgets(tmp_path):
    probe = (
        "import sys\nfrom fp8ops.cli import main\n"
        "try:\n    main(['console', sys.argv[1]])\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'ipywidgets', 'plotly') if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert "no such runs directory" in done.stderr


@pytest.mark.slow
def test_the_notebook_is_the_package_s_and_executes_under_nbclient(trained, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = ROOT / "notebooks" / "console.ipynb"
    on_disk = nbformat.read(path, as_version=4)
    assert on_disk.cells[0].source == notebook().cells[0].source
    assert len(on_disk.cells) == 1  # thin: the app lives in fp8ops.console

    _, run = trained
    monkeypatch.setenv("FP8OPS_CONSOLE_RUNS", str(run.parent))
    monkeypatch.setenv("FP8OPS_USER", "nbclient")
    # In a kernel the run is read in the app's worker thread: it is on screen a moment later.
    on_disk.cells.append(
        nbformat.v4.new_code_cell(
            "import asyncio\n"
            "for _ in range(600):\n"
            "    if app.run is not None:\n"
            "        break\n"
            "    await asyncio.sleep(0.1)\n"
            "print(app.run.run_dir.name, app.user.value, app._follower is not None, "
            "repr(app.message.value))"
        )
    )
    nbclient.NotebookClient(
        on_disk,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    ).execute()
    views = [
        o
        for o in on_disk.cells[0].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert views, on_disk.cells[0].outputs
    # In a kernel the app follows the run on the kernel's event loop.
    assert on_disk.cells[1].outputs[0]["text"].strip() == "finetune nbclient True ''"


# -- live -------------------------------------------------------------------------------------------


TICK_S = 0.05


def _tick_until(stop: threading.Event, ticks: list[float]) -> None:
    ticks.append(time.monotonic())
    while not stop.wait(TICK_S):
        ticks.append(time.monotonic())


def _holds(ticks: list[float]) -> list[tuple[float, float, float]]:
    """(how late, from, to) of each tick of a ticker that sleeps ``TICK_S`` at a time."""
    return [(b - a - TICK_S, a, b) for a, b in itertools.pairwise(ticks)]


def _worst_hold(loop_ticks: list[float], thread_ticks: list[float]) -> tuple[float, float]:
    """The event loop's longest hold-up, and its longest hold-up beyond what held the thread
    ticker up at the same time (no more than the two overlapped)."""
    thread_holds = _holds(thread_ticks)
    beyond = []
    for held, start, end in _holds(loop_ticks):
        beside = [
            min(h, min(d, end) - max(c, start)) for h, c, d in thread_holds if c < end and d > start
        ]
        beyond.append(held - max([0.0, *beside]))
    return max(h for h, _, _ in _holds(loop_ticks)), max(beyond)


def _opening_s(run_dir: Path) -> float:
    """How long the app takes to open ``run_dir`` with no event loop running, reading the run in
    the calling thread as well as drawing it: what a loop that read runs itself would be held up
    by. The median of three."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        app = ConsoleApp(run_dir, user="ana", follow=False)
        times.append(time.perf_counter() - started)
        assert app.run is not None and app.run.run_dir == run_dir, app.message.value
        app.close()
    return statistics.median(times)


@pytest.mark.slow
def test_the_console_follows_a_training_run_without_blocking_the_event_loop(
    trained, tmp_path, monkeypatch
):
    """A run trains in another process while the app polls it from an event loop, as in a
    kernel: the committed steps are followed to the end, the run and its ledger are read in the
    worker thread (when the store appears, and at each checkpoint), and a ticker on the same
    loop is never held up for long beyond what held the whole process: for less than what
    opening the run takes when the app reads it in its own thread, measured here (a ratio, not
    seconds: a slower or busier machine slows both, if not always alike)."""
    manifest, _ = trained
    run = tmp_path / "live"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fp8ops",
            "train",
            str(manifest),
            "--run-dir",
            str(run),
            "--set",
            "schedule.train_steps=24",
            "--set",
            "telemetry.flush_steps=4",
            "--set",
            "schedule.checkpoint_interval=100",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The reference, while the trainer starts (its imports keep a core busy, as its steps do
    # later): opening the module's finished run of 12 steps in this thread.
    opening = _opening_s(trained[1])
    readers = _record_threads(monkeypatch, "read_run", "read_ledger")

    # A busy machine can hold the whole process up for a second (two workers, torchrun ranks and
    # this trainer on two cores): a ticker in a thread of its own measures that, and only what
    # held the event loop beyond it counts against the app.
    loop_ticks, thread_ticks, stop = [], [], threading.Event()
    ticker = threading.Thread(target=lambda: _tick_until(stop, thread_ticks), daemon=True)

    async def follow() -> tuple[list[int | None], ConsoleApp]:
        deadline = time.monotonic() + 240
        while not (run / "status.json").exists():  # the app needs a run directory to show
            assert trainer.poll() is None, trainer.stdout.read()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        app = ConsoleApp(run, user="ana", follow_every_s=0.2)
        seen = []
        ticker.start()
        while time.monotonic() < deadline:
            loop_ticks.append(time.monotonic())
            await asyncio.sleep(TICK_S)
            step = app.run.header.last_step if app.run else None
            if not seen or seen[-1] != step:
                seen.append(step)
            if trainer.poll() is not None and step == 24 and "completed" in app.header.value:
                break
        app.close()
        return seen, app

    try:
        seen, app = asyncio.run(follow())
    finally:
        stop.set()
        if trainer.poll() is None:
            trainer.kill()
        output = trainer.communicate()[0]
    assert trainer.returncode == 0, output[-3000:]
    assert seen[-1] == 24 and "completed" in app.header.value
    assert len([s for s in seen if s]) >= 3, seen  # followed while it trained, block by block
    assert np.asarray(app.heatmap_fig.data[0].z).shape[1] == 24
    followed_by = list(readers)
    # And opening the followed run (24 steps) once it is done, with no trainer beside it: the
    # larger of the two is the reference.
    opening = max(opening, _opening_s(run))
    held, beyond_the_process = _worst_hold(loop_ticks, thread_ticks)
    print(
        f"loop held {held:.3f} s, {beyond_the_process:.3f} s beyond the process; opening {opening:.3f} s"
    )
    # Beyond what held the whole process, less than one opening of the run: drawing a followed
    # block runs in the loop, and on two loaded cores it has taken 0.72 of an opening measured
    # at a quieter moment (0.096 s against 0.134 s, 2026-12-03, four-rank tests beside it); that
    # the reads themselves never run there is checked below, by thread. In all, the whole
    # process's hold-ups included,
    # less than five openings or 5 s, whichever is longer: that bound is for a C call that holds
    # the GIL and so stalls the thread ticker too, and a loaded machine stalls the whole process
    # for a second or more (1.1 s seen under a full suite with an install beside it) however
    # short an opening is.
    assert beyond_the_process < opening and held < max(5 * opening, 5.0), (
        f"the event loop was held up for {held:.3f} s at most, and for {beyond_the_process:.3f} s "
        f"more than the whole process; opening the run in this thread took {opening:.3f} s"
    )
    assert {name for name, _ in followed_by} == {"read_run", "read_ledger"}
    assert all(thread.startswith("fp8ops-console") for _, thread in followed_by), followed_by
