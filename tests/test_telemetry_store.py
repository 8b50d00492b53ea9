"""The telemetry store (``fp8ops.telemetry.store``) and its reader (``reader``): round trips,
the committed-steps protocol, ranks, resume, a live writer in another process, ``kill -9``,
damaged stores. Real files in ``tmp_path``; small layouts (4-step blocks, 8-step shards) so
every code path (partial blocks, whole shards, history tails) runs in a few dozen steps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from fp8ops.telemetry import (
    MODULE_METRIC_NAMES,
    STEP_METRIC_NAMES,
    TelemetryError,
    TelemetryWriter,
    open_run,
)
from fp8ops.telemetry.store import COMMITTED, HISTORY, STORE_NAME, WRITTEN_FROM

MODULES = ["decoder.layers.0.qkv", "decoder.layers.0.proj", "decoder.layers.1.fc1"]
N_MOD, N_MET, N_STEP = len(MODULES), len(MODULE_METRIC_NAMES), len(STEP_METRIC_NAMES)
SMALL = {"flush_every": 4, "steps_per_shard": 8}


def module_values(step: int, rank: int = 0) -> np.ndarray:
    """Exact in float32 for steps < 10_000: step, module and metric readable from the value."""
    m = np.arange(N_MOD)[:, None]
    k = np.arange(N_MET)[None, :]
    return (rank * 1e6 + step * 1000 + m * 100 + k).astype(np.float32)


def step_values(step: int, rank: int = 0) -> np.ndarray:
    return (rank * 1e6 + step * 10 + np.arange(N_STEP)).astype(np.float32)


def write(path: Path, steps: range, rank: int = 0, **kw) -> TelemetryWriter:
    writer = TelemetryWriter(path, rank=rank, modules=MODULES, **{**SMALL, **kw})
    for step in steps:
        writer.append(step, module_values(step, rank), step_values(step, rank))
    return writer


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def same_bits(a, b) -> bool:
    """Bit-for-bit float32 equality (NaN payloads and -0.0 included)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------------------
# Round trip
# ----------------------------------------------------------------------------------------


def test_round_trip_is_exact_for_every_reader(tmp_path):
    rng = np.random.default_rng(0)
    steps = range(5, 5 + 23)  # first_step 5; 2 whole shards + a 7-step tail, a partial block
    written = {}
    with TelemetryWriter(
        tmp_path / STORE_NAME,
        rank=0,
        modules=MODULES,
        first_step=5,
        attrs={"manifest_sha256": "ab12"},
        **SMALL,
    ) as writer:
        for step in steps:
            values = rng.standard_normal((N_MOD, N_MET)).astype(np.float32) * 1e3
            values[0, 0], values[1, 1], values[2, 2] = np.nan, -np.inf, -0.0
            values[0, 3] = np.float32(1e-42)  # subnormal
            written[step] = (values, rng.standard_normal(N_STEP).astype(np.float32))
            writer.append(step, *written[step])
    module = np.stack([written[s][0] for s in steps])  # [steps, modules, metrics]
    stepwise = np.stack([written[s][1] for s in steps])

    run = open_run(tmp_path)
    assert run.modules == tuple(MODULES) and run.metrics == MODULE_METRIC_NAMES
    assert run.step_metric_names == STEP_METRIC_NAMES
    assert run.ranks == (0,) and run.committed_steps == {0: 23}
    assert run.steps() == steps and run.last_step() == 27
    assert run.attrs == {"manifest_sha256": "ab12"}

    for m, name in enumerate(MODULES):  # 16 steps from module_history, 7 from module_metrics
        history = run.module_history(name)
        assert list(history.index) == list(steps) and history.index.name == "step"
        assert list(history.columns) == list(MODULE_METRIC_NAMES)
        assert (history.dtypes == np.float32).all()
        assert same_bits(history.to_numpy(), module[:, m, :])
    part = run.module_history(MODULES[1], ["weight.scale", "grad_norm"], start=10, stop=22)
    cols = [MODULE_METRIC_NAMES.index("weight.scale"), MODULE_METRIC_NAMES.index("grad_norm")]
    assert list(part.index) == list(range(10, 22))
    assert same_bits(part.to_numpy(), module[5:17, 1][:, cols])
    assert same_bits(run.module_history(MODULES[0], "input.amax").to_numpy()[:, 0], module[:, 0, 0])

    latest = run.step_snapshot()
    assert list(latest.index) == MODULES and latest.index.name == "module"
    assert same_bits(latest.to_numpy(), module[-1])
    assert same_bits(run.step_snapshot(5).to_numpy(), module[0])

    window = run.metric_window("weight.amax", start=20)
    assert list(window.index) == list(range(20, 28)) and list(window.columns) == MODULES
    assert same_bits(window.to_numpy(), module[15:, :, MODULE_METRIC_NAMES.index("weight.amax")])

    assert same_bits(run.step_metrics().to_numpy(), stepwise)
    assert list(run.step_metrics(stop=7).index) == [5, 6]
    assert len(run.step_metrics(start=100)) == 0  # beyond the commit: empty, never an error

    ds = run.to_xarray(start=8)
    assert ds.sizes == {"step": 20, "module": N_MOD}
    assert list(ds["step"].values) == list(range(8, 28)) and list(ds["module"].values) == MODULES
    for k, name in enumerate(MODULE_METRIC_NAMES):
        assert same_bits(ds[name].transpose("step", "module").values, module[3:, :, k])
    for k, name in enumerate(STEP_METRIC_NAMES):
        assert same_bits(ds[f"step.{name}"].values, stepwise[3:, k])
    assert ds["input.saturation"].attrs["units"] == "fraction"
    assert "clipped" in ds["input.saturation"].attrs["meaning"]
    assert ds["step.loss"].attrs["units"] == "nats/token"
    assert ds.attrs["run.manifest_sha256"] == "ab12"


def test_store_records_schema_and_catalogue(tmp_path):
    write(tmp_path / STORE_NAME, range(1, 3)).close()
    attrs = json.loads((tmp_path / STORE_NAME / "zarr.json").read_text())["attributes"]
    schema = attrs["fp8ops_telemetry"]
    assert schema["schema_version"] == 1 and schema["modules"] == MODULES
    assert schema["module_metrics"] == list(MODULE_METRIC_NAMES)
    assert [m["name"] for m in schema["catalogue"]["step_metrics"]] == list(STEP_METRIC_NAMES)


# ----------------------------------------------------------------------------------------
# The committed-steps protocol
# ----------------------------------------------------------------------------------------


def test_appended_but_unflushed_steps_are_invisible(tmp_path):
    writer = write(tmp_path / STORE_NAME, range(1, 7))  # one full block (1-4) + 2 steps
    wait_for(lambda: writer.committed_steps == 4)
    run = open_run(tmp_path)
    assert run.committed_steps == {0: 4}
    assert len(run.module_history(MODULES[0])) == 4
    assert run.step_snapshot().equals(run.step_snapshot(4))
    with pytest.raises(TelemetryError, match="step 5 is not committed"):
        run.step_snapshot(5)
    assert run.step_metrics(start=5).empty

    writer.flush()
    assert writer.committed_steps == 6
    assert open_run(tmp_path).committed_steps == {0: 6}  # a fresh reader sees them ...
    assert run.committed_steps == {0: 4}  # ... an open run only after refresh()
    run.refresh()
    assert run.committed_steps == {0: 6}
    assert same_bits(run.step_snapshot(6).to_numpy(), module_values(6))

    for step in range(7, 10):  # the partial block goes on filling after a flush
        writer.append(step, module_values(step), step_values(step))
    writer.close()
    run.refresh()
    assert same_bits(
        run.module_history(MODULES[2]).to_numpy(),
        np.stack([module_values(s)[2] for s in range(1, 10)]),
    )


def test_ranks_write_only_their_own_groups(tmp_path):
    path = tmp_path / STORE_NAME
    # Rank 1 starts first and waits for rank 0 to create the store.
    ranks: dict[int, TelemetryWriter] = {}
    early = threading.Thread(
        target=lambda: ranks.setdefault(
            1, TelemetryWriter(path, rank=1, modules=MODULES, wait_s=10, **SMALL)
        )
    )
    early.start()
    time.sleep(0.2)
    ranks[0] = TelemetryWriter(path, rank=0, modules=MODULES, **SMALL)
    early.join()
    for step in range(1, 19):  # interleaved, one process
        for rank in (1, 0):
            ranks[rank].append(step, module_values(step, rank), step_values(step, rank))
    for writer in ranks.values():
        writer.close()
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["rank_00000", "rank_00001"]

    run = open_run(tmp_path)
    assert run.ranks == (0, 1) and run.committed_steps == {0: 18, 1: 18}
    for rank in (0, 1):
        expected = np.stack([module_values(s, rank) for s in range(1, 19)])
        for m, name in enumerate(MODULES):
            assert same_bits(run.module_history(name, rank=rank).to_numpy(), expected[:, m])
        assert same_bits(run.step_snapshot(rank=rank).to_numpy(), expected[-1])
        assert same_bits(
            run.step_metrics(rank=rank).to_numpy(),
            np.stack([step_values(s, rank) for s in range(1, 19)]),
        )
    with pytest.raises(TelemetryError, match="rank 2 has no telemetry"):
        run.step_metrics(rank=2)


def test_ranks_must_agree_and_rank_0_must_come(tmp_path):
    path = tmp_path / STORE_NAME
    with pytest.raises(TelemetryError, match="not created by rank 0 within"):
        TelemetryWriter(path, rank=1, modules=MODULES, wait_s=0.1)
    assert not path.exists()  # waiting wrote nothing
    write(path, range(1, 2)).close()
    with pytest.raises(TelemetryError, match="same rows and columns"):
        TelemetryWriter(path, rank=1, modules=MODULES[:2], **SMALL)
    with pytest.raises(TelemetryError, match="already exists"):
        TelemetryWriter(path, rank=0, modules=MODULES, **SMALL)
    write(path, range(1, 2), rank=1).close()
    with pytest.raises(TelemetryError, match="resume"):
        TelemetryWriter(path, rank=1, modules=MODULES, **SMALL)


def test_append_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="divide steps_per_shard"):
        TelemetryWriter(tmp_path / "a.zarr", rank=0, modules=MODULES, flush_every=3)
    with pytest.raises(ValueError, match="unique"):
        TelemetryWriter(tmp_path / "b.zarr", rank=0, modules=["x", "x"])
    with write(tmp_path / STORE_NAME, range(1, 3)) as writer:
        with pytest.raises(ValueError, match="expected step 3, got 4"):
            writer.append(4, module_values(4), step_values(4))
        with pytest.raises(ValueError, match="module_values must have shape"):
            writer.append(3, module_values(3)[:2], step_values(3))
        with pytest.raises(ValueError, match="step_values must have shape"):
            writer.append(3, module_values(3), step_values(3)[:2])
    writer.close()  # idempotent
    with pytest.raises(TelemetryError, match="closed"):
        writer.append(3, module_values(3), step_values(3))
    assert open_run(tmp_path).committed_steps == {0: 2}


# ----------------------------------------------------------------------------------------
# Failures of the background thread
# ----------------------------------------------------------------------------------------


def break_rank_dir(path: Path) -> None:
    """Make the next write fail for real: the rank's directory becomes a plain file."""
    shutil.rmtree(path / "rank_00000")
    (path / "rank_00000").write_text("not a directory")


def test_background_errors_surface_on_the_next_call(tmp_path):
    path = tmp_path / STORE_NAME
    writer = write(path, range(1, 3))
    break_rank_dir(path)
    for step in range(3, 5):  # completes a block: the thread's write fails
        writer.append(step, module_values(step), step_values(step))
    with pytest.raises(TelemetryError, match="writer for rank 0 .* failed") as failed:
        writer.flush()
    assert isinstance(failed.value.__cause__, OSError)
    with pytest.raises(TelemetryError, match="failed"):  # and on every call after
        writer.append(5, module_values(5), step_values(5))
    writer.close()  # already reported: close only stops the thread


def test_background_error_seen_only_at_close_is_raised_by_close(tmp_path):
    path = tmp_path / STORE_NAME
    writer = write(path, range(1, 3))
    break_rank_dir(path)
    with pytest.raises(TelemetryError, match="failed"):
        writer.close()  # the tail written by close fails
    writer.close()


def test_a_body_exception_wins_over_a_writer_error(tmp_path):
    path = tmp_path / STORE_NAME
    with pytest.raises(KeyError) as raised, write(path, range(1, 3)):
        break_rank_dir(path)
        raise KeyError("the training loop's own error")
    if sys.version_info >= (3, 11):  # where exceptions carry notes
        assert "failed" in " ".join(raised.value.__notes__)


# ----------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------


def expected_history(steps, m: int = 0, rank: int = 0) -> np.ndarray:
    return np.stack([module_values(s, rank)[m] for s in steps])


def test_resume_continues_the_arrays(tmp_path):
    path = tmp_path / STORE_NAME
    write(path, range(1, 14)).close()  # 13 steps: a shard of 8 and a 5-step tail
    writer = TelemetryWriter.resume(path, rank=0)
    assert writer.next_step == 14
    for step in range(14, 31):
        writer.append(step, module_values(step), step_values(step))
    writer.close()
    run = open_run(tmp_path)
    assert run.committed_steps == {0: 30}
    group = zarr.open_group(path / "rank_00000", mode="r")
    assert group.attrs[HISTORY] == 24  # three whole shards, the second built across the resume
    for m in range(N_MOD):
        assert same_bits(
            run.module_history(MODULES[m]).to_numpy(), expected_history(range(1, 31), m)
        )
    assert same_bits(
        run.step_metrics().to_numpy(), np.stack([step_values(s) for s in range(1, 31)])
    )


def test_resume_at_an_earlier_step_replaces_what_follows(tmp_path):
    path = tmp_path / STORE_NAME
    write(path, range(1, 21)).close()
    writer = TelemetryWriter.resume(path, rank=0, next_step=11)  # the checkpoint was at 10
    assert open_run(tmp_path).committed_steps == {0: 10}  # withdrawn at once
    for step in range(11, 16):
        writer.append(step, module_values(step) + 0.5, step_values(step) + 0.5)
    writer.close()
    history = open_run(tmp_path).module_history(MODULES[1]).to_numpy()
    assert same_bits(history[:10], expected_history(range(1, 11), 1))
    assert same_bits(history[10:], expected_history(range(11, 16), 1) + 0.5)
    with pytest.raises(TelemetryError, match="at most 16"):
        TelemetryWriter.resume(path, rank=0, next_step=17)


def test_resume_overwrites_a_torn_tail(tmp_path):
    """Data beyond the marker (a crash between a flush's data and its marker) is replaced."""
    path = tmp_path / STORE_NAME
    write(path, range(1, 21)).close()
    group = zarr.open_group(path / "rank_00000", mode="r+")
    group.update_attributes({COMMITTED: 6, HISTORY: 0})  # as if steps 7-20 were never committed
    writer = TelemetryWriter.resume(path, rank=0)
    assert writer.next_step == 7
    for step in range(7, 19):
        writer.append(step, -module_values(step), -step_values(step))
    writer.close()
    run = open_run(tmp_path)
    assert run.committed_steps == {0: 18}
    history = run.module_history(MODULES[0]).to_numpy()
    assert same_bits(history[:6], expected_history(range(1, 7)))
    assert same_bits(history[6:], -expected_history(range(7, 19)))
    assert same_bits(run.step_snapshot().to_numpy(), -module_values(18))


# ----------------------------------------------------------------------------------------
# Another process writing: a live reader, and kill -9
# ----------------------------------------------------------------------------------------

WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fp8ops.telemetry import TelemetryWriter
    sys.path.insert(0, sys.argv[3])
    from test_telemetry_store import MODULES, module_values, step_values
    path, seconds, stop = sys.argv[1], float(sys.argv[2]), Path(sys.argv[4])
    writer = TelemetryWriter(path, rank=0, modules=MODULES, flush_every=8, steps_per_shard=32)
    print("ready", flush=True)
    step, deadline = 1, time.monotonic() + seconds
    while time.monotonic() < deadline and step < 9000 and not stop.exists():
        writer.append(step, module_values(step), step_values(step))
        if step % 13 == 0:
            writer.flush()  # partial blocks: chunk files replaced under the reader
        step += 1
        time.sleep(0.0005)
    writer.close()
    print("committed", writer.committed_steps, flush=True)
""")


def start_writer(path: Path, seconds: float, stop: Path | None = None) -> subprocess.Popen:
    """A process appending steps to the store at ``path`` for ``seconds``, or until the file
    ``stop`` appears."""
    stop = stop or path.parent / "never"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER_SCRIPT,
            str(path),
            str(seconds),
            str(Path(__file__).parent),
            str(stop),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def check_committed(run, full: bool) -> int:
    """Everything readable must be exactly what was written: no NaN fill, no stale value."""
    n = run.committed_steps[0]
    if n == 0:
        return 0
    recent = range(max(1, n - 19), n + 1)
    assert same_bits(run.step_snapshot().to_numpy(), module_values(n))
    window = run.metric_window("weight.scale", start=recent[0]).to_numpy()
    k = MODULE_METRIC_NAMES.index("weight.scale")
    assert same_bits(window, np.stack([module_values(s)[:, k] for s in recent]))
    assert same_bits(
        run.step_metrics(start=recent[0]).to_numpy(), np.stack([step_values(s) for s in recent])
    )
    modules = range(N_MOD) if full else [n % N_MOD]
    for m in modules:
        history = run.module_history(MODULES[m]).to_numpy()
        assert same_bits(history, expected_history(range(1, n + 1), m)), f"module {m}, n={n}"
    return n


@pytest.mark.slow
def test_a_reader_beside_a_live_writer_sees_only_whole_steps(tmp_path):
    stop = tmp_path / "stop"
    writer = start_writer(tmp_path / STORE_NAME, seconds=300.0, stop=stop)  # 300: a hang guard
    reads, merged, seen = 0, 0, set()
    # Three seconds of reads at least, and on until there are enough of them, then the writer
    # stops: a count, not a time, since a slower or busier machine reads less often in three
    # seconds (here 260 reads in them, 38 steps seen, 149 from both arrays; with the tests'
    # other processes beside it).
    least = time.monotonic() + 3.0
    while writer.poll() is None:
        if time.monotonic() > least and reads > 50 and len(seen) > 10 and merged > 10:
            stop.touch()
        run = open_run(tmp_path)  # a new reader now and then, a refreshed one otherwise
        for _ in range(20):
            run.refresh()
            n = check_committed(run, full=False)
            merged += n > 32 and n % 32 != 0  # the history came from both arrays
            seen.add(n)
            reads += 1
    assert writer.wait() == 0
    final = int(writer.stdout.read().split()[-1])
    run = open_run(tmp_path)
    assert run.committed_steps == {0: final}
    check_committed(run, full=True)
    assert reads > 50 and len(seen) > 10 and merged > 10, (reads, len(seen), merged)


@pytest.mark.slow
def test_kill_9_leaves_everything_up_to_the_last_commit(tmp_path):
    path = tmp_path / STORE_NAME
    writer = start_writer(path, seconds=60.0)
    wait_for(lambda: open_run(tmp_path).committed_steps.get(0, 0) >= 300, timeout=30)
    os.kill(writer.pid, signal.SIGKILL)  # mid-flush, mid-append: wherever it is
    assert writer.wait() == -signal.SIGKILL

    run = open_run(tmp_path)
    n = check_committed(run, full=True)
    assert n >= 300
    resumed = TelemetryWriter.resume(path, rank=0)  # and the run can go on from there
    for step in range(n + 1, n + 41):
        resumed.append(step, module_values(step), step_values(step))
    resumed.close()
    run.refresh()
    assert check_committed(run, full=True) == n + 40


# ----------------------------------------------------------------------------------------
# Missing and damaged stores, unknown names
# ----------------------------------------------------------------------------------------


def test_a_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(TelemetryError, match=r"no telemetry store at .*telemetry\.zarr"):
        open_run(tmp_path / "no-such-run")
    write(tmp_path / STORE_NAME, range(1, 2)).close()
    with pytest.raises(TelemetryError, match="cannot resume .* missing"):
        TelemetryWriter.resume(tmp_path / STORE_NAME, rank=3)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "zarr.json").write_text("{not json"), "cannot be read as a Zarr v3"),
        (lambda p: zarr.open_group(p, mode="r+").attrs.put({"other": 1}), "not an fp8ops"),
        (
            lambda p: zarr.open_group(p, mode="r+").attrs.put(
                {"fp8ops_telemetry": {"schema_version": 99}}
            ),
            "schema version 99",
        ),
        (
            lambda p: zarr.open_group(p, mode="r+").attrs.put(
                {"fp8ops_telemetry": {"schema_version": 1}}
            ),
            "damaged telemetry schema",
        ),
        (lambda p: (p / "rank_00000" / "zarr.json").write_text("[]"), "rank_00000/zarr.json"),
    ],
    ids=["bad-json", "foreign-group", "schema-version", "schema-fields", "rank-metadata"],
)
def test_a_damaged_store_is_a_clear_error(tmp_path, damage, message):
    path = tmp_path / STORE_NAME
    write(path, range(1, 10)).close()
    damage(path)
    with pytest.raises(TelemetryError, match=message):
        open_run(tmp_path)


def test_a_missing_array_is_named(tmp_path):
    path = tmp_path / STORE_NAME
    write(path, range(1, 10)).close()
    shutil.rmtree(path / "rank_00000" / "module_metrics")
    run = open_run(tmp_path)
    with pytest.raises(TelemetryError, match=r"rank_00000/module_metrics cannot be read"):
        run.step_snapshot()
    run.module_history(MODULES[0], stop=9)  # steps 1-8 live in module_history, still there


def test_a_missing_chunk_file_is_named_instead_of_read_as_nan(tmp_path):
    """Zarr reads a missing chunk as NaN, which in this store means "nothing to report"."""
    path = tmp_path / STORE_NAME
    write(path, range(1, 21)).close()  # blocks of 4 steps, shards of 8: history holds 1-16
    rank = path / "rank_00000"
    (rank / "module_metrics" / "c" / "4" / "0" / "0").unlink()  # steps 17-20
    (rank / "step_metrics" / "c" / "1" / "0").unlink()  # steps 9-16
    (rank / "module_history" / "c" / "0" / "0" / "0").unlink()  # steps 1-8
    run = open_run(tmp_path)
    missing = r"rank_00000/{}/c/{} is missing: it holds committed steps {}\.\.{}"
    with pytest.raises(TelemetryError, match=missing.format("module_metrics", "4/0/0", 17, 20)):
        run.step_snapshot()
    with pytest.raises(TelemetryError, match=missing.format("step_metrics", "1/0", 9, 16)):
        run.step_metrics(start=12)
    with pytest.raises(TelemetryError, match=missing.format("module_history", "0/0/0", 1, 8)):
        run.module_history(MODULES[1])
    # What the files still there hold reads as before.
    assert same_bits(run.step_snapshot(16).to_numpy(), module_values(16))
    assert same_bits(
        run.step_metrics(stop=9).to_numpy(), np.stack([step_values(s) for s in range(1, 9)])
    )
    assert same_bits(
        run.module_history(MODULES[1], start=9, stop=17).to_numpy(),
        expected_history(range(9, 17), 1),
    )
    # A store written before the marker existed is read as zarr reads it.
    zarr.open_group(rank, mode="r+").attrs.__delitem__(WRITTEN_FROM)
    assert np.isnan(open_run(tmp_path).step_snapshot().to_numpy()).all()


def test_blocks_with_nothing_to_report_are_written_and_read_as_nan(tmp_path):
    """A block that is all NaN (a caller's own metrics, nothing measured) still gets its file,
    also after a resume: the reader takes a missing one for damage."""
    path = tmp_path / STORE_NAME
    writer = TelemetryWriter(path, rank=0, modules=MODULES, **SMALL)
    nothing = np.full(N_STEP, np.nan, np.float32)
    for step in range(1, 13):
        writer.append(step, module_values(step), nothing if 5 <= step <= 8 else step_values(step))
    writer.close()
    writer = TelemetryWriter.resume(path, rank=0)
    for step in range(13, 17):
        writer.append(step, np.full((N_MOD, N_MET), np.nan, np.float32), nothing)
    writer.close()
    run = open_run(tmp_path)
    assert np.isnan(run.step_metrics(start=5, stop=9).to_numpy()).all()
    assert np.isnan(run.step_snapshot(16).to_numpy()).all()
    assert np.isnan(run.module_history(MODULES[0], start=13).to_numpy()).all()
    # A step number that is a numpy integer (from an array of steps) reads like an int.
    assert same_bits(run.step_snapshot(np.int64(12)).to_numpy(), module_values(12))


def test_a_rank_that_joined_mid_run_reads_empty_steps_before_it_joined(tmp_path):
    path = tmp_path / STORE_NAME
    write(path, range(1, 21)).close()
    joined = TelemetryWriter.join(path, rank=1, next_step=11, **SMALL)  # no files for 1-10
    for step in range(11, 21):
        joined.append(step, module_values(step, 1), step_values(step, 1))
    joined.close()
    run = open_run(tmp_path)
    history = run.module_history(MODULES[2], rank=1).to_numpy()
    assert np.isnan(history[:10]).all()
    assert same_bits(history[10:], expected_history(range(11, 21), 2, rank=1))
    assert np.isnan(run.step_metrics(rank=1).to_numpy()[:10]).all()
    # Resumed from before it joined: the steps from there on are written, and checked.
    rewound = TelemetryWriter.resume(path, rank=1, next_step=6)
    for step in range(6, 13):
        rewound.append(step, module_values(step, 1), step_values(step, 1))
    rewound.close()
    assert zarr.open_group(path / "rank_00001", mode="r").attrs[WRITTEN_FROM] == 5
    run = open_run(tmp_path)
    assert same_bits(
        run.step_metrics(start=6, rank=1).to_numpy(),
        np.stack([step_values(s, 1) for s in range(6, 13)]),
    )
    (path / "rank_00001" / "step_metrics" / "c" / "1" / "0").unlink()  # steps 9-12
    # A new reader: one remembers the files it has seen, and does not look for them again.
    with pytest.raises(TelemetryError, match="rank_00001/step_metrics/c/1/0 is missing"):
        open_run(tmp_path).step_metrics(rank=1)


def test_unknown_names_and_steps(tmp_path):
    write(tmp_path / STORE_NAME, range(1, 6)).close()
    run = open_run(tmp_path / STORE_NAME)  # the store itself is accepted too
    with pytest.raises(TelemetryError, match="no module 'decoder.layers.0.qvk'.*did you mean"):
        run.module_history("decoder.layers.0.qvk")
    with pytest.raises(TelemetryError, match="no metric 'input.amx'.*input.amax"):
        run.metric_window("input.amx")
    with pytest.raises(TelemetryError, match="no metric"):
        run.module_history(MODULES[0], ["input.amax", "loss"])  # a step metric
    with pytest.raises(
        TelemetryError, match=r"no metric 'bogus' .*; the metrics are input\.amax, "
    ):
        run.metric_window("bogus")  # nothing close: every name
    with pytest.raises(TelemetryError, match="step 0 is not committed"):
        run.step_snapshot(0)


def test_steps_a_resume_withdrew_under_a_reader_are_not_called_damage(tmp_path):
    """A reader whose marker predates a resume from an earlier step asks for rows whose files
    are gone: they were withdrawn, not lost, and read as NaN as they always did."""
    path = tmp_path / STORE_NAME
    write(path, range(1, 21)).close()
    run = open_run(tmp_path)  # marker: 20 committed, 16 in module_history
    run.step_snapshot(19), run.module_history(MODULES[0], start=9, stop=17)  # arrays opened
    TelemetryWriter.resume(path, rank=0, next_step=6).close()  # keeps 1-5, shard 1-8 withdrawn
    assert not (path / "rank_00000" / "module_metrics" / "c" / "4" / "0" / "0").exists()
    assert np.isnan(run.step_snapshot(20).to_numpy()).all()
    assert np.isnan(run.module_history(MODULES[0], stop=9).to_numpy()).all()


def test_inspect_worst_ranks_low_block_exponents_first_and_high_saturation_first(tmp_path):
    """The worst end of a metric: a block exponent nearest the floor is the lowest, a
    saturation the highest (``catalogue.worst_end``, which the console pools by too)."""
    from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES, worst_end

    modules = ["a", "b", "c"]
    with TelemetryWriter(tmp_path / STORE_NAME, rank=0, modules=modules) as writer:
        for step in (1, 2):
            values = np.full((3, len(MODULE_METRIC_NAMES)), np.nan, np.float32)
            values[:, COLUMN["input.block_exp_min"]] = [-7, -12, -5]
            values[:, COLUMN["input.saturation"]] = [1e-3, 0.0, 1e-4]
            writer.append(step, values, np.zeros(len(STEP_METRIC_NAMES), np.float32))
    assert [worst_end(m) for m in ("input.block_exp_min", "weight.scale", "input.amax")] == [
        "min",
        "min",
        "max",
    ]

    def order(metric: str) -> list[str]:  # what `fp8ops inspect RUN --worst METRIC` prints
        import io

        from rich.console import Console

        from fp8ops.telemetry.cli import _print_worst

        printed = io.StringIO()
        _print_worst(Console(file=printed, width=200), tmp_path, metric, top=5, rank=0)
        lines = [line.split() for line in printed.getvalue().splitlines()]
        return [words[0] for words in lines if words and words[0] in modules]

    assert order("input.block_exp_min") == ["b", "a", "c"]
    assert order("input.saturation") == ["a", "c", "b"]
