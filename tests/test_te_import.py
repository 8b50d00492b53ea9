"""Transformer Engine debug statistics logs imported as a run: ``fp8ops import-te-debug``.

The logs are written by nvdlfw_inspect's own logger (``support.te_logs``: its FileLogger and
MetricLogger, as TE's stats buffer calls them; the values are the test's, since TE's debug
features need a GPU). What is checked: where each value lands in the store and in which unit,
what is kept under TE's names, the run records, inspect, the alerts replayed, the console and
compare on the imported run, and every bad log named by file and line, with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from support.te_logs import LAYERS, delayed_run, write_rank_log

from fp8ops.alerts import AlertEngine, read_alerts
from fp8ops.alerts.replay import record_replay, replay_alerts
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import load_manifest
from fp8ops.overrides.te_debug import te_layer_name
from fp8ops.run import read_run_record, read_status
from fp8ops.te_import import TeLogError, import_te_debug
from fp8ops.te_import.names import module_name
from fp8ops.telemetry import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, TelemetryWriter, open_run
from fp8ops.telemetry.catalogue import describe

pytest.importorskip("nvdlfw_inspect")

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "tiny-gpt-cpu.yaml"
ITERATIONS = range(0, 40, 2)  # freq 2: the odd iterations are rows with nothing logged
BAD = LAYERS[2]  # saturates from iteration 10
NAN_LAYER, NAN_STEP = LAYERS[5], 30  # its gradient's cur_amax is NaN there


def printed(value: float) -> float:
    """A value as the log holds it: nvdlfw_inspect prints four decimals."""
    return float(f"{value:.4f}")


def faulty_run() -> list:
    """The delayed-scaling run of support.te_logs with one layer saturating and one NaN."""
    entries = []
    for layer, tensor, stat, value, it in delayed_run(ITERATIONS):
        if (layer, tensor, stat) == (BAD, "activation", "overflows%") and it >= 10:
            value = 0.5  # 0.5 % clipped: above the degrade level 1e-3 (a fraction)
        if (layer, tensor, stat, it) == (NAN_LAYER, "gradient", "cur_amax", NAN_STEP):
            value = math.nan
        entries.append((layer, tensor, stat, value, it))
    return entries


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("te") / "debug_logs"
    for rank in (0, 1):
        write_rank_log(log_dir, rank, faulty_run())
    return log_dir


@pytest.fixture(scope="module")
def imported(logs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "te-run"
    import_te_debug(logs, out, manifest=MANIFEST)
    return out


def copy_logs(logs: Path, tmp_path: Path) -> Path:
    target = tmp_path / "logs" / "nvdlfw_inspect_statistics_logs"
    target.mkdir(parents=True)
    for path in (logs / "nvdlfw_inspect_statistics_logs").iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return tmp_path / "logs"


def rank_file(log_dir: Path, rank: int) -> Path:
    return log_dir / "nvdlfw_inspect_statistics_logs" / f"nvdlfw_inspect_globalrank-{rank}.log"


# -- the store ----------------------------------------------------------------------------------


def test_every_value_lands_in_its_module_metric_and_step_in_the_catalogue_s_unit(imported):
    store = open_run(imported)
    assert store.modules == LAYERS  # TE's names, in the order first logged (forward order)
    assert store.metrics[: len(MODULE_METRIC_NAMES)] == MODULE_METRIC_NAMES
    assert store.ranks == (0, 1) and store.committed_steps == {0: 39, 1: 39}
    assert store.first_step == 0 and store.step_metric_names == STEP_METRIC_NAMES
    slot = {"activation": "input", "weight": "weight", "gradient": "grad_output"}
    unit = {"cur_amax": ("amax", 1.0), "underflows%": ("underflow", 0.01)}
    unit["overflows%"] = ("saturation", 0.01)
    expected: dict[str, np.ndarray] = {}  # metric -> [iterations, modules]
    for layer, tensor, stat, value, it in faulty_run():
        if stat in unit:
            metric, factor = f"{slot[tensor]}.{unit[stat][0]}", unit[stat][1]
        else:  # no catalogue metric means the same: kept under TE's name
            metric, factor = f"te.{tensor}.{stat}", 1.0
        grid = expected.setdefault(metric, np.full((39, len(LAYERS)), np.nan, np.float32))
        # Exact: the importer does the same float64 operations (the printed value times the
        # factor), then rounds to float32 as this assignment does.
        grid[it, LAYERS.index(layer)] = printed(value) * factor
    assert len(expected) == 21
    for rank in (0, 1):
        for metric, grid in expected.items():
            got = store.metric_window(metric, rank=rank).to_numpy()
            np.testing.assert_array_equal(got, grid, err_msg=f"{metric}, rank {rank}")
    # Iterations nothing was logged at are rows too, all NaN: "not measured".
    assert np.isnan(store.module_rows(1, 2)).all() and np.isnan(store.module_rows(39)).all()
    # A quantized tensor's stat was logged: the module ran FP8 casts at that iteration.
    enabled = store.metric_window("fp8_enabled")
    assert (enabled.loc[list(ITERATIONS)] == 1).all().all() and enabled.loc[1].isna().all()
    # No TE stat means what these do: NaN throughout, never a made-up number.
    for metric in ("input.scale", "input.scale_inv", "input.window_max", "fp8_rel_error"):
        assert store.metric_window(metric).isna().all().all(), metric
    assert store.step_metrics().isna().all().all()  # TE logs no loss


def test_a_nan_te_logged_flags_the_tensor_s_slot(imported):
    store = open_run(imported)
    nan = store.metric_window("grad_output.nan")
    assert nan.loc[NAN_STEP, NAN_LAYER] == 1
    assert int(np.nansum(nan.to_numpy())) == 1  # nowhere else
    assert np.isnan(store.metric_window("grad_output.amax").loc[NAN_STEP, NAN_LAYER])


def test_the_store_s_catalogue_says_where_each_column_came_from(imported):
    about = {m["name"]: m for m in open_run(imported).schema.catalogue["module_metrics"]}
    assert "'underflows%' of the activation" in about["input.underflow"]["meaning"]
    assert "divided by 100" in about["input.underflow"]["meaning"]
    assert about["te.activation.mse"]["unit"] == "value^2"
    assert "kept under its own name" in about["te.weight.l2_norm"]["meaning"]
    assert about["input.scale"]["meaning"].startswith("The scale in use")  # the catalogue's
    # The import's meanings are the store's: the catalogue itself (every other store's) is as
    # it was. (The import once edited the catalogue's own dicts.)
    ours = {m["name"]: m["meaning"] for m in describe()["module_metrics"]}
    assert ours["input.underflow"].startswith("Share of this step's cast elements")


def test_the_run_records_say_it_was_imported_and_from_which_files(imported, logs):
    record = read_run_record(imported)
    source = record.imported
    assert source.kind == "te_debug" and Path(source.source) == logs.resolve()
    assert [f.rank for f in source.files] == [0, 1]
    for entry in source.files:
        data = (logs / entry.path).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.bytes == len(data)
        assert entry.lines == len(faulty_run()) and entry.skipped == 0
    assert source.recipe == "delayed" and source.recipe_from == f"the manifest {MANIFEST}"
    assert source.mapped["activation_underflows%"] == "input.underflow"
    assert "te.activation.mse" in source.kept and source.warnings == []
    assert (source.first_iteration, source.last_iteration) == (0, 38)
    assert record.topology.world_size == 2
    status = read_status(imported)
    assert status.state == "imported" and status.step == 38
    assert not (imported / "layers.json").exists()  # TE's logs give no shapes: none made up


# -- what works on it ---------------------------------------------------------------------------


def test_the_replayed_alerts_name_the_saturating_layer_and_the_nan(imported):
    alerts = read_alerts(imported)
    degrade = [a for a in alerts if a.level == "degrade"]
    assert [(a.module, a.metric, a.step) for a in degrade] == [(BAD, "input.saturation", 14)]
    stop = [a for a in alerts if a.level == "stop"]
    assert [(a.module, a.metric, a.step, a.rule) for a in stop] == [
        (NAN_LAYER, "grad_output.nan", NAN_STEP, "nonfinite")
    ]
    # Both ranks logged the same values (TE reduces them): each alert once.
    assert all(a.rank == 0 for a in alerts)
    events = [json.loads(line) for line in (imported / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["imported", "alerts_replayed"]
    assert events[1]["stop_step"] == NAN_STEP


def test_replay_judges_the_stored_rows_as_the_engine_judges_them_live(tmp_path):
    """A store fp8ops wrote: the replay's alerts are the engine's fed row by row; it is
    shown, and never replaces the run's own alerts.jsonl."""
    modules = [f"m{i}" for i in range(3)]
    rng = np.random.default_rng(0)
    rows = rng.uniform(0, 2e-3, (30, 3, len(MODULE_METRIC_NAMES))).astype(np.float32)
    rows[:, :, MODULE_METRIC_NAMES.index("fp8_enabled")] = 1
    for name in ("input.nan", "input.inf", "weight.nan", "weight.inf"):
        rows[:, :, MODULE_METRIC_NAMES.index(name)] = 0
    steps = np.full((30, len(STEP_METRIC_NAMES)), 1.5, np.float32)
    with TelemetryWriter(tmp_path / "run" / "telemetry.zarr", rank=0, modules=modules) as w:
        for i in range(30):
            w.append(i + 1, rows[i], steps[i])
    manifest = load_manifest(MANIFEST)
    live = AlertEngine(manifest.alerts, modules, [True] * 3)
    expected = []
    for i in range(30):
        values = dict(zip(STEP_METRIC_NAMES, map(float, steps[i]), strict=True))
        expected += [a.message for a in live.observe(i + 1, rows[i], values)]
    replay = replay_alerts(tmp_path / "run", manifest)
    assert [a.message for a in replay.alerts] == expected and expected  # some fired
    assert not replay.imported
    with pytest.raises(Fp8opsError, match="trained by fp8ops"):
        record_replay(tmp_path / "run", replay, MANIFEST)


def test_inspect_alerts_replay_and_compare_on_the_command_line(imported, logs, tmp_path, cli):
    shown = cli("inspect", imported, "--worst", "input.saturation", "--top", "2")
    assert shown.code == 0, shown.err
    assert "imported from Transformer Engine debug logs" in shown.out
    assert "activation_overflows% -> input.saturation" in shown.out
    table = shown.out.split("worst 2 modules by input.saturation")[1]
    assert table.index(BAD) < table.index(LAYERS[7])  # the saturating layer heads the list
    assert "te.gradient.l2_norm" in cli("inspect", imported, "--worst", "te.gradient.l2_norm").out

    listed = cli("alerts", imported, "--level", "degrade")
    assert listed.code == 0 and BAD in listed.out and "grad_output.nan" in listed.out

    before = read_alerts(imported)
    again = cli("alerts", imported, "--replay", MANIFEST)
    assert again.code == 0, again.err
    assert f"a live run would have stopped at step {NAN_STEP}" in again.out
    assert "kept as its alerts.jsonl" in again.out
    assert read_alerts(imported) == before  # the same rules again: replaced, not appended

    other = tmp_path / "te-run-2"
    assert cli("import-te-debug", logs, "--out", other).code == 0
    refused = cli("compare", imported, other)
    assert refused.code == 2 and "an imported run" in refused.err
    assert "held-out loss" in refused.err and not list(imported.parent.glob("compare-*"))
    resumed = cli("resume", imported)
    assert resumed.code == 2 and "cannot train or resume it" in resumed.err


def test_the_console_opens_the_imported_run(imported):
    pytest.importorskip("ipywidgets")
    from fp8ops.console import ConsoleApp

    app = ConsoleApp(imported, follow=False)
    try:
        assert app.run is not None and app.message.value == ""
        header = app.header.value
        assert "imported" in header and "Transformer Engine debug logs (delayed)" in header
        assert "problem" not in header  # no manifest.yaml is not a problem here
        assert list(app.module.options) == list(LAYERS)
        store = open_run(imported)
        trace = app.heatmap_fig.data[0]
        assert list(trace.y) == list(LAYERS)
        got = np.asarray(trace.customdata, np.float32)
        expected = store.metric_window("input.amax").dropna(how="all").to_numpy().T
        np.testing.assert_array_equal(got, expected)  # the logged iterations, as stored
        assert "te.activation.mean" in app.metric.options
        app.metric.value = "te.activation.mean"
        got = np.asarray(app.heatmap_fig.data[0].customdata, np.float32)
        expected = store.metric_window("te.activation.mean").dropna(how="all").to_numpy().T
        np.testing.assert_array_equal(got, expected)
        assert "1 stop" in header and "1 degrade" in header
    finally:
        app.close()


# -- the recipe and names -----------------------------------------------------------------------


def test_what_if_stats_of_another_recipe_stay_under_te_names(tmp_path):
    layer = "fc1"
    entries = [
        (layer, "activation", "underflows%", 1.0, 0),
        (layer, "activation", "mxfp8_underflows%", 2.0, 0),  # a "what if" under delayed
        (layer, "activation", "fp8_current_scaling_underflows%", 3.0, 0),
        (layer, "activation", "scale_inv_max", 0.25, 0),
        (layer, "weight", "fp8_block_scaling_mse_columnwise", 0.5, 0),
    ]
    write_rank_log(tmp_path / "logs", 0, entries)
    result = import_te_debug(tmp_path / "logs", tmp_path / "delayed", recipe="delayed")
    assert result.mapped == {"activation_underflows%": "input.underflow"}
    assert result.kept == [
        "te.activation.mxfp8_underflows%",
        "te.activation.fp8_current_scaling_underflows%",
        "te.activation.scale_inv_max",
        "te.weight.fp8_block_scaling_mse_columnwise",
    ]
    # Under current scaling its own prefixed stats are the casts', and the largest scale_inv
    # is the one the largest-amax cast used: what fp8ops records as scale_inv.
    current = import_te_debug(tmp_path / "logs", tmp_path / "current", recipe="current")
    assert current.mapped["activation_fp8_current_scaling_underflows%"] == "input.underflow"
    assert current.mapped["activation_scale_inv_max"] == "input.scale_inv"
    assert any("fills the same cell" in w for w in current.warnings)
    row = open_run(tmp_path / "current").step_snapshot(0).loc[layer]
    assert row["input.underflow"] == np.float32(3.0 * 0.01)  # the later line's (same ops)
    assert row["input.scale_inv"] == np.float32(0.25)


def test_a_recipe_contradicting_delayed_scaling_stats_is_refused(tmp_path):
    write_rank_log(tmp_path / "logs", 0, [("fc1", "activation", "overflows%", 0.0, 0)])
    with pytest.raises(TeLogError, match=r"globalrank-0.log:1: fc1_activation_overflows% is a"):
        import_te_debug(tmp_path / "logs", tmp_path / "run", recipe="mxfp8")
    assert not (tmp_path / "run").exists()


def test_inferred_layer_names_become_fp8ops_module_paths(tmp_path):
    fqns = ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.11.self_attention.linear_qkv"]
    for fqn in fqns:  # the inverse of overrides export-te --naming inferred
        assert module_name(te_layer_name(fqn, "inferred"), "inferred") == fqn
    entries = [(te_layer_name(f, "inferred"), "activation", "cur_amax", 1.0, 0) for f in fqns]
    write_rank_log(tmp_path / "logs", 0, entries)
    result = import_te_debug(tmp_path / "logs", tmp_path / "run", naming="inferred")
    assert result.modules == tuple(fqns)
    write_rank_log(tmp_path / "other", 0, [("Layer_3", "activation", "cur_amax", 1.0, 0)])
    with pytest.raises(TeLogError, match=r"globalrank-0.log:1: layer 'Layer_3' does not start"):
        import_te_debug(tmp_path / "other", tmp_path / "run2", naming="inferred")


# -- bad logs -----------------------------------------------------------------------------------


def test_a_torn_last_line_is_skipped_with_a_warning(logs, tmp_path):
    log_dir = copy_logs(logs, tmp_path)
    path = rank_file(log_dir, 1)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:-4])  # cut mid-value, no newline
    seen = []
    result = import_te_debug(log_dir, tmp_path / "run", warn=seen.append)
    assert len(seen) == 1 and f"{path}:{len(lines)}: the last line has no newline" in seen[0]
    assert result.warnings == seen
    assert read_run_record(tmp_path / "run").imported.files[1].skipped == 1
    last = faulty_run()[-1]  # the torn line's value is not in the store
    store = open_run(tmp_path / "run")
    assert np.isnan(
        store.module_history(last[0], f"te.{last[1]}.{last[2]}", 38, 39, rank=1).iloc[0, 0]
    )


def test_a_malformed_line_mid_file_is_an_error_naming_file_and_line(logs, tmp_path):
    log_dir = copy_logs(logs, tmp_path)
    path = rank_file(log_dir, 0)
    lines = path.read_text().splitlines(keepends=True)
    lines[99] = lines[99].replace("value=", "valeur=")
    path.write_text("".join(lines))
    with pytest.raises(TeLogError, match=r"globalrank-0.log:100: not a statistics line"):
        import_te_debug(log_dir, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert not list(tmp_path.glob(".run.importing-*"))


def test_bytes_that_are_not_text_are_named_by_line(logs, tmp_path):
    log_dir = copy_logs(logs, tmp_path)
    path = rank_file(log_dir, 1)
    lines = path.read_bytes().split(b"\n")
    lines[6] = lines[6][:40] + b"\xff\xfe" + lines[6][40:]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(TeLogError, match=r"globalrank-1.log:7: not UTF-8 text"):
        import_te_debug(log_dir, tmp_path / "run")


def test_timestamped_logs_are_found_and_two_runs_of_one_rank_refused(logs, tmp_path):
    folder = tmp_path / "logs" / "nvdlfw_inspect_statistics_logs"
    folder.mkdir(parents=True)
    source = rank_file(logs, 0).read_bytes()
    (folder / "nvdlfw_inspect_20261207_101500_globalrank-0.log").write_bytes(source)
    result = import_te_debug(tmp_path / "logs", tmp_path / "run")
    assert result.steps == {0: 39}
    (folder / "nvdlfw_inspect_20261207_111500_globalrank-0.log").write_bytes(source)
    with pytest.raises(TeLogError, match="rank 0 has 2 logs .*import one run at a time"):
        import_te_debug(tmp_path / "logs", tmp_path / "run2")


def test_an_unknown_stat_is_kept_under_its_name_with_one_warning(tmp_path):
    entries = [("fc1", "activation", "kurtosis", 3.0 + it, it) for it in range(3)]
    entries += [("fc2", "activation", "kurtosis", 1.0, 2)]
    write_rank_log(tmp_path / "logs", 0, entries)
    result = import_te_debug(tmp_path / "logs", tmp_path / "run")
    assert result.kept == ["te.activation.kurtosis"]
    assert len(result.warnings) == 1 and "'kurtosis' is not a stat" in result.warnings[0]
    assert "globalrank-0.log:1" in result.warnings[0]
    window = open_run(tmp_path / "run").metric_window("te.activation.kurtosis")
    assert window["fc1"].tolist() == [3.0, 4.0, 5.0]


def test_ranks_that_disagree_on_iterations(logs, tmp_path):
    # Rank 1 cut short (a crash): a warning naming its file; its telemetry ends there.
    short = copy_logs(logs, tmp_path / "short")
    lines = rank_file(short, 1).read_text().splitlines(keepends=True)
    rank_file(short, 1).write_text(
        "".join(line for line in lines if "iteration=000038" not in line)
    )
    result = import_te_debug(short, tmp_path / "short-run")
    assert result.steps == {0: 39, 1: 37}
    assert any(
        str(rank_file(short, 1)) in w and "ends at iteration 36" in w for w in result.warnings
    )

    # Rank 1 without an iteration the others logged, mid-run: an error, unless allowed.
    holed = copy_logs(logs, tmp_path / "holed")
    lines = rank_file(holed, 1).read_text().splitlines(keepends=True)
    rank_file(holed, 1).write_text(
        "".join(line for line in lines if "iteration=000012" not in line)
    )
    with pytest.raises(TeLogError, match=r"globalrank-1.log: rank 1 has no iteration 12, which"):
        import_te_debug(holed, tmp_path / "holed-run")
    assert not (tmp_path / "holed-run").exists()
    allowed = import_te_debug(holed, tmp_path / "holed-run", ranks_may_differ=True)
    assert any("has no iteration 12" in w for w in allowed.warnings)


def test_runs_appended_to_one_file_are_refused(tmp_path):
    write_rank_log(
        tmp_path / "back", 0, [("fc1", "activation", "max", 1.0, it) for it in (4, 5, 2)]
    )
    with pytest.raises(TeLogError, match=r"globalrank-0.log:3: iteration 2 after iteration 5"):
        import_te_debug(tmp_path / "back", tmp_path / "run")
    write_rank_log(tmp_path / "twice", 0, [("fc1", "activation", "max", 1.0, it) for it in (4, 4)])
    with pytest.raises(
        TeLogError,
        match=r"globalrank-0.log:2: fc1_activation_max at iteration 4 was logged already at line 1",
    ):
        import_te_debug(tmp_path / "twice", tmp_path / "run")


def test_nothing_to_import_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TeLogError, match="no nvdlfw_inspect statistics logs"):
        import_te_debug(tmp_path / "empty", tmp_path / "run")
    write_rank_log(tmp_path / "silent", 0, [])
    with pytest.raises(TeLogError, match="no statistics lines in .*globalrank-0.log"):
        import_te_debug(tmp_path / "silent", tmp_path / "run")
    with pytest.raises(TeLogError, match="no such directory"):
        import_te_debug(tmp_path / "missing", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_existing_run_directory_is_never_written_over(logs, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(TeLogError, match="fp8ops never writes over a run"):
        import_te_debug(logs, tmp_path / "run")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]


def test_a_failure_mid_import_leaves_no_run_directory(logs, tmp_path, monkeypatch):
    import fp8ops.te_import.importer as importer

    class Failing(TelemetryWriter):
        def append(self, step, module_values, step_values):
            if self.rank == 1 and step == 20:
                raise OSError(28, "No space left on device")
            super().append(step, module_values, step_values)

    monkeypatch.setattr(importer, "TelemetryWriter", Failing)
    with pytest.raises(OSError, match="No space left"):
        import_te_debug(logs, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []  # nor the temporary directory it was written in
