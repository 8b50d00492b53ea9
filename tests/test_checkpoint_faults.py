"""Checkpoints under real faults, no mocks: ``kill -9`` in the middle of saves, damaged files
(truncated, changed bytes, missing, extra), a damaged ``fp8ops_checkpoint.json``, a
``.metadata`` pickle that would run code, ``latest`` naming a checkpoint that is gone, and drift
(manifest, environment) refused before any model is built.

Each fault is made on disk as a crash, a bad disk or a person would make it, and met through the
command line (``fp8ops resume``, ``fp8ops train --resume``, ``fp8ops checkpoints list``). The
model is the small one of tests/support/small_model.py, fine-tuned from the shared small base
(the ``small_base`` fixture); its fine-tuning
checkpoints after every step and keeps two, so a run spends about half its time saving.
"""

import contextlib
import gc
import importlib.util
import json
import os
import pickle
import pickletools
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.checkpoint_surgery import edit_meta, rehash
from support.small_model import write_small_finetune

from fp8ops.checkpoint import CheckpointDir, read_meta
from fp8ops.checkpoint.consistency import SEAL_FILE, read_consistent
from fp8ops.checkpoint.directory import (
    META_FILE,
    CheckpointError,
    checkpoint_name,
    checkpoint_step,
    verify_files,
)
from fp8ops.checkpoint.weights import META_FILE as WEIGHTS_META
from fp8ops.files import read_jsonl
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.manifest.canonical import to_yaml
from fp8ops.run import RunDir, locked_manifest, read_metrics
from fp8ops.start.checks import check_unedited
from fp8ops.start.drift import DriftRefused
from fp8ops.train import run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

WORKER = Path(__file__).parent / "workers" / "checkpoint_saver.py"
STEPS = 14
# The damaged-checkpoint tests start from a run paused here: checkpoints step 1 and step 2.
PAUSED_AT = 2
LATEST, PREVIOUS = checkpoint_name(PAUSED_AT), checkpoint_name(PAUSED_AT - 1)


@pytest.fixture(scope="module")
def saver():
    """The fork server that runs the killed ``fp8ops`` processes. First in the kill test's
    arguments, so its imports overlap the base run's training (when it is not cached)."""
    server = Saver()
    yield server
    server.close()


@pytest.fixture(scope="module")
def manifest(small_base, tmp_path_factory) -> Path:
    # One evaluation, at the end: a kill lands in a step or a save, not in an evaluation.
    return write_small_finetune(
        tmp_path_factory.mktemp("manifests") / "finetune.yaml",
        small_base,
        {"schedule.train_steps": STEPS, "schedule.eval_interval": 1000},
    )


@pytest.fixture(scope="module")
def reference(manifest, tmp_path_factory) -> Path:
    """The same run, never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    run_training(manifest, run, progress=False)
    return run


@pytest.fixture(scope="module")
def paused(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("paused") / "run"
    run_training(manifest, run, progress=False, stop_at=PAUSED_AT)
    assert [p.name for p in CheckpointDir(run).complete()] == [PREVIOUS, LATEST]
    return run


@pytest.fixture
def run(paused, tmp_path) -> Path:
    """A copy of the paused run to damage."""
    return Path(shutil.copytree(paused, tmp_path / "run"))


# -- kill -9 during saves --------------------------------------------------------------------

# Where each kill lands: (steps past the checkpoint the process resumes from, what it waits for,
# then seconds more). "logged": the step's metrics line, written just before its save; "saved":
# the step's checkpoint renamed into place (`latest` not yet moved, or the oldest being deleted).
# Measured here in a forked process: a save's first 10 ms flush telemetry and make the .partial,
# the next ~110 ms write and hash the shards and fsync, then the rename, `latest` and the
# deletion take 1-2 ms; the next step's line comes ~60 ms later. A process's first save takes
# ~1.7 s more: Megatron's writer starts a multiprocessing manager (a new interpreter).
KILLS = [
    (2, "logged", 0.0),  # the save's start: telemetry flushed, .partial made
    (1, "logged", 0.3),  # the first save of a process: the writer's manager starting
    (2, "logged", 0.04),  # shards being written into the .partial
    (3, "logged", 0.09),  # hashing, fsync
    (2, "saved", 0.0),  # just renamed: `latest` being replaced, the oldest being deleted
    (1, "logged", 0.125),  # about the end of a save, or just after
]


@pytest.mark.slow
def test_kill_9_during_saves_leaves_a_whole_latest_and_the_resumed_run_is_bit_identical(
    saver, manifest, reference, tmp_path, cli
):
    """kill, resume, kill, resume... with the same command each time (a requeued batch job's),
    then a last resume that runs to the end."""
    run = tmp_path / "run"
    command = ["train", manifest, "--resume", "--run-dir", run, "--no-progress"]
    store = CheckpointDir(run)
    resumed_from, after_kills = [], []
    for number, (ahead, trigger, delay) in enumerate(KILLS):
        start = _latest_step(run)  # 0: no checkpoint yet, the command starts the run
        target = start + ahead
        logged = len(_logged(run))
        # A checkpoint of this step left by an earlier process does not count as saved.
        stale = _inode(store.path / checkpoint_name(target))
        log = tmp_path / f"segment{number}.log"
        pid = saver.start(log, *command)
        _wait_until(pid, log, run, trigger, target, logged=logged, stale=stale)
        time.sleep(delay)
        assert saver.kill(pid) == -signal.SIGKILL, log.read_text()[-3000:]

        # It trained on from where `latest` said (after a fresh start: from step 1).
        assert _logged(run)[logged]["step"] == start + 1
        if start:
            resumed_from.append(start)
        _assert_every_checkpoint_whole(run, cli)
        hidden = sorted(p.name for p in store.path.iterdir() if p.name.startswith("."))
        newest = store.complete()[-1].name
        after_kills.append(
            (f"step {target} {trigger} +{delay:.3f} s", store.latest().name, newest, hidden)
        )

    print("\nkilled at: latest, newest complete, hidden leftovers")
    for when, latest, newest, hidden in after_kills:
        print(f"  {when:<26} {latest}, {newest}, {hidden or '-'}")
    # At least one kill really cut a save short (each aims at one; a save takes 0.1 s or more).
    assert any(name.endswith(".partial") for *_, hidden in after_kills for name in hidden)

    last = _latest_step(run)
    pid = saver.start(tmp_path / "last.log", *command)
    assert saver.wait(pid, timeout=300) == 0, (tmp_path / "last.log").read_text()[-3000:]
    resumed_from.append(last)
    print("after the last resume:", [p.name for p in store.path.iterdir()])

    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    events = read_jsonl(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resumed"] == resumed_from
    # Every step logged, including steps a killed process logged and a resume then trained
    # again, has the uninterrupted run's loss and gradient norm, bit for bit.
    expected = {m.step: (m.loss, m.grad_norm) for m in read_metrics(reference)}
    lines = read_jsonl(run / "metrics.jsonl")
    assert [(m["loss"], m["grad_norm"]) for m in lines] == [expected[m["step"]] for m in lines]
    assert [m.step for m in read_metrics(run)] == list(range(1, STEPS + 1))
    final = json.loads((run / "final" / WEIGHTS_META).read_text())["fingerprint"]
    assert final == json.loads((reference / "final" / WEIGHTS_META).read_text())["fingerprint"]


def _latest_step(run: Path) -> int:
    latest = CheckpointDir(run).latest()
    return 0 if latest is None else checkpoint_step(latest.name)


def _logged(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _wait_until(
    pid: int, log: Path, run: Path, trigger: str, step: int, *, logged: int, stale: int | None
) -> None:
    """Poll every millisecond, while the process ``pid`` runs (up to 120 s), until it has
    logged ``step`` (a metrics line after the first ``logged``) or saved it (a checkpoint
    directory other than ``stale``)."""
    checkpoint = run / "checkpoints" / checkpoint_name(step)
    deadline = time.monotonic() + 120
    while not (
        any(record["step"] == step for record in _logged(run)[logged:])
        if trigger == "logged"
        else _inode(checkpoint) not in (None, stale)
    ):
        if not _running(pid):
            pytest.fail(
                f"the training process ended before step {step} was {trigger}:\n"
                f"{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"step {step} not {trigger} within 120 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.001)


def _running(pid: int) -> bool:
    """Whether ``pid`` is still running (the fork server, not this process, reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state, after "pid (name)"


def _assert_every_checkpoint_whole(run: Path, cli) -> None:
    store = CheckpointDir(run)
    latest = store.latest()
    assert latest is not None and latest in store.complete()
    for checkpoint in store.complete():  # hidden .partial and .deleting are not among them
        verify_files(checkpoint, read_meta(checkpoint).files)
    listed = cli("checkpoints", "list", run, "--verify")
    assert listed.code == 0, listed.err
    rows = [line.split() for line in listed.out.splitlines() if "step_" in line]
    assert [row[1] for row in rows if row[0] == "*"] == [latest.name]
    assert [row[-1] for row in rows] == ["ok"] * len(store.complete())


class Saver:
    """tests/workers/checkpoint_saver.py: ``fp8ops`` commands in child processes to kill."""

    def __init__(self):
        self.server = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.children: set[int] = set()

    def start(self, log: Path, *args) -> int:
        """Start ``fp8ops ARGS`` (output to ``log``); the child's pid is its process group."""
        # The first answer waits for the server's imports.
        pid = int(self._ask(shlex.join(["start", str(log), *map(str, args)]), 120).split()[1])
        self.children.add(pid)
        return pid

    def kill(self, pid: int) -> int:
        """SIGKILL the child and every process it started; its exit code."""
        os.killpg(pid, signal.SIGKILL)
        return self.wait(pid, timeout=30)

    def wait(self, pid: int, timeout: float) -> int:
        code = int(self._ask(f"wait {pid}", timeout).split()[1])
        self.children.discard(pid)
        return code

    def close(self) -> None:
        for pid in self.children:  # left running by a failed test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()

    def _ask(self, line: str, timeout: float) -> str:
        self.server.stdin.write(line + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        answer = self.server.stdout.readline().strip() if ready else ""
        if not answer.startswith(("pid ", "exit ")):
            pytest.fail(f"the fork server answered {answer!r} to {line!r} (within {timeout} s)")
        return answer


# -- damaged files in the latest checkpoint -------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))  # same size: only the hash can tell


@pytest.mark.parametrize(
    ("pattern", "damage", "problem"),
    [
        ("*.distcp", _truncate, r"\d+ bytes, but it was saved with \d+ \(truncated or replaced\)"),
        ("*.distcp", _flip_bytes, r"its content changed since it was saved \(sha256 mismatch\)"),
        ("metadata.json", Path.unlink, "missing"),  # Megatron's (0.19 writes no common.pt)
        (
            "stray.bin",
            lambda path: path.write_text("left by hand\n"),
            "not part of the checkpoint as saved",
        ),
    ],
    ids=["truncated", "changed-bytes", "missing", "extra"],
)
@pytest.mark.slow
def test_a_damaged_file_is_named_with_the_previous_checkpoint_to_resume_from(
    run, reference, cli, pattern, damage, problem
):
    latest = run / "checkpoints" / LATEST
    file = next(iter(sorted(latest.glob(pattern))), latest / pattern)
    damage(file)

    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert re.search(f"{re.escape(str(file))}: {problem}", refused.err), refused.err
    assert f"The previous one is {PREVIOUS}: resume from it with --checkpoint {PREVIOUS}" in (
        refused.err
    )
    listed = cli("checkpoints", "list", run, "--verify")
    assert re.search(rf"^\*\s+{LATEST}\s.*DAMAGED", listed.out, re.MULTILINE), listed.out

    # The refused resume's Trainer still holds run.lock (RunDir keeps it open until the process
    # ends), reachable only through reference cycles from the exception pytest kept: collect it,
    # as the end of a real `fp8ops resume` process would.
    gc.collect()
    resumed = cli("resume", run, "--checkpoint", PREVIOUS, "--stop-at", PAUSED_AT, "--no-progress")
    assert resumed.code == 0, resumed.err
    verify_files(latest, read_meta(latest).files)  # saved again, whole
    assert read_metrics(run)[-1].loss == read_metrics(reference)[PAUSED_AT - 1].loss


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda path: path.write_text(path.read_text()[:200]), "not valid JSON"),
        (
            lambda path: edit_meta(path.parent, lambda meta: meta.pop("sampler")),
            "sampler: Field required",
        ),
    ],
    ids=["not-json", "missing-field"],
)
def test_a_damaged_checkpoint_record_is_named(run, cli, damage, problem):
    record = run / "checkpoints" / LATEST / META_FILE
    damage(record)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert f"{record}: {problem}" in refused.err
    listed = cli("checkpoints", "list", run)
    assert re.search(rf"^\s+{LATEST}\s+damaged:", listed.out, re.MULTILINE), listed.out


# -- a checkpoint record that disagrees with itself ---------------------------------------------

AHEAD = PAUSED_AT + 2  # the step an edit claims: the 4 -> 6


def _claim_step(checkpoint: Path, step: int) -> None:
    edit_meta(checkpoint, lambda meta: meta.update(step=step))


def _rename(checkpoint: Path, step: int) -> Path:
    """Move ``checkpoint`` to ``step``'s name, and `latest` with it: edited by someone careful."""
    renamed = checkpoint.rename(checkpoint.with_name(checkpoint_name(step)))
    (checkpoint.parent / "latest").write_text(renamed.name + "\n")
    return renamed


def _unseal(checkpoint: Path) -> None:
    """Make it a checkpoint saved before the seal existed (no fp8ops_progress.json)."""
    (checkpoint / SEAL_FILE).unlink()
    edit_meta(checkpoint, lambda meta: meta["files"].pop(SEAL_FILE))


def _step_edited(checkpoint: Path) -> tuple[Path, str]:
    _claim_step(checkpoint, AHEAD)
    return checkpoint, f"it says step {AHEAD}, but its directory {LATEST} is step {PAUSED_AT}'s"


def _step_edited_and_renamed(checkpoint: Path) -> tuple[Path, str]:
    _claim_step(checkpoint, AHEAD)
    return _rename(checkpoint, AHEAD), (
        f"it says step {AHEAD}, but the record sealed with its files ({SEAL_FILE}) says {PAUSED_AT}"
    )


def _cursor_edited(checkpoint: Path) -> tuple[Path, str]:
    edit_meta(checkpoint, lambda meta: meta["sampler"].update(cursor=meta["sampler"]["cursor"] + 8))
    return checkpoint, f"it says sampler {{'epoch': 0, 'cursor': {8 * PAUSED_AT + 8}"


def _unsealed_step_edited_and_renamed(checkpoint: Path) -> tuple[Path, str]:
    _unseal(checkpoint)
    _claim_step(checkpoint, AHEAD)
    # The small fine-tuning's global batch is 8 sequences.
    return _rename(checkpoint, AHEAD), (
        f"its data position (sampler epoch 0, cursor {8 * PAUSED_AT}) is not where {AHEAD} "
        f"steps of 8 sequences end (epoch 0, cursor {8 * AHEAD})"
    )


def _unsealed_optimizer_ahead(checkpoint: Path) -> tuple[Path, str]:
    _unseal(checkpoint)
    edit_meta(checkpoint, lambda meta: meta.update(optimizer_steps=AHEAD))
    return checkpoint, f"it says the optimizer took {AHEAD} steps in {PAUSED_AT} training steps"


def _ledger_anchor_dropped(checkpoint: Path) -> tuple[Path, str]:
    """The anchor says what of the ledger the checkpoint saw: dropped, a rewritten ledger
    would pass (the ledger's rules are read from the record, fp8ops.overrides.anchors)."""
    anchor = {"records": 3, "head": "a" * 64}
    seal = checkpoint / SEAL_FILE
    seal.write_text(json.dumps({**json.loads(seal.read_text()), "ledger": anchor}))
    rehash(checkpoint, SEAL_FILE)  # as if the save had seen three records
    edit_meta(checkpoint, lambda meta: meta.update(ledger=anchor))
    edit_meta(checkpoint, lambda meta: meta.update(ledger=None))
    return checkpoint, f"it says ledger None, but the record sealed with its files ({SEAL_FILE})"


@pytest.mark.parametrize(
    "edit",
    [
        _step_edited,
        _step_edited_and_renamed,
        _cursor_edited,
        _unsealed_step_edited_and_renamed,
        _unsealed_optimizer_ahead,
        _ledger_anchor_dropped,
    ],
    ids=[
        "step",
        "step-and-name",
        "cursor",
        "unsealed-step-and-name",
        "unsealed-optimizer",
        "ledger-anchor",
    ],
)
def test_a_checkpoint_record_that_disagrees_with_itself_is_refused_as_damaged(
    run, tmp_path, cli, edit
):
    """Issue 49.3: ``fp8ops_checkpoint.json`` is in no hash list. Its step set from 4 to 6, a
    resume was refused for the telemetry store ("the checkpoint is not affected ... move it
    aside"), and once the store was moved it trained steps 7-8, skipping 5-6, and completed.
    Every reader now refuses a record that disagrees with the rest of its checkpoint first,
    as a damaged checkpoint, naming the previous one."""
    checkpoint, problem = edit(run / "checkpoints" / LATEST)
    said = f"{checkpoint / META_FILE}: {problem}"
    advice = f"The previous one is {PREVIOUS}: resume from it with --checkpoint {PREVIOUS}"
    before = _files(run)
    for command in (
        ["resume", run],
        ["train", run / "manifest.yaml", "--resume", "--run-dir", run],
    ):
        refused = cli(*command, "--no-progress")
        assert refused.code == 2, refused.err
        assert said in refused.err and "the checkpoint disagrees with itself" in refused.err, (
            refused.err
        )
        assert advice in refused.err
        assert "move it aside" not in refused.err and "not affected" not in refused.err
    assert _files(run) == before  # refused before anything was written
    listed = cli("checkpoints", "list", run)
    assert listed.code == 1
    # (the message itself is folded into the column)
    assert re.search(rf"^\s+{checkpoint.name}\s+damaged: ", listed.out, re.MULTILINE), listed.out
    exported = cli("checkpoints", "export", run, "--out", tmp_path / "weights")
    assert exported.code == 2 and said in exported.err, exported.err
    assert not (tmp_path / "weights").exists()


def test_a_data_position_past_an_epoch_is_checked_as_far_as_the_record_tells(run):
    """Past the first epoch the number of steps in one is not in the record (it is the data's),
    so a position is checked to be whole batches, at least one into its epoch, after passes of
    one length: step 103 at epoch 1, cursor 24 (8-sequence batches) fits passes of 100 steps,
    at epoch 2 passes of 50; at epoch 2, cursor 32 fits none (99 steps in two passes)."""
    checkpoint = run / "checkpoints" / LATEST
    _unseal(checkpoint)
    edit_meta(checkpoint, lambda meta: meta.update(step=103, optimizer_steps=103))
    checkpoint = _rename(checkpoint, 103)
    cases = [(1, 24, True), (2, 24, True), (2, 32, False), (1, 20, False), (1, 0, False)]
    for epoch, cursor, fits in cases:
        edit_meta(checkpoint, lambda meta: meta["sampler"].update(epoch=epoch, cursor=cursor))  # noqa: B023
        if fits:
            read_consistent(checkpoint)
        else:
            with pytest.raises(CheckpointError, match=rf"sampler epoch {epoch}, cursor {cursor}\)"):
                read_consistent(checkpoint)


@pytest.mark.slow
def test_the_previous_checkpoint_an_inconsistent_one_names_resumes_the_run(run, reference, cli):
    """The advice works: from the previous checkpoint the run trains every step, as the
    straight run did."""
    _step_edited(run / "checkpoints" / LATEST)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2 and f"--checkpoint {PREVIOUS}" in refused.err, refused.err
    resumed = cli("resume", run, "--checkpoint", PREVIOUS, "--stop-at", AHEAD, "--no-progress")
    assert resumed.code == 0, resumed.err
    assert [m.step for m in read_metrics(run)] == list(range(1, AHEAD + 1))
    # The same steps as the straight run, bit for bit (the same operations from the same state).
    assert read_metrics(run)[-1].loss == read_metrics(reference)[AHEAD - 1].loss
    assert read_meta(run / "checkpoints" / checkpoint_name(AHEAD)).step == AHEAD


# -- a .metadata pickle that would run code -------------------------------------------------

MARKER = "fp8ops test: the pickled payload ran"


class _Payload:
    """Unpickled, calls ``print(MARKER)``: a harmless stand-in for ``os.system``."""

    def __reduce__(self):
        return print, (MARKER,)


def test_a_metadata_pickle_that_would_run_code_is_refused_unread(run, cli, capsys):
    latest = run / "checkpoints" / LATEST
    index = latest / ".metadata"
    # The real index with a call in front whose result is thrown away (POP): torch would load
    # this file as the same checkpoint index, and run the call on the way.
    real = index.read_bytes()
    # Protocol 3: GLOBAL "builtins print", no frames; optimize() drops its memo entries, which
    # would shift the indices the real pickle's own memo lookups use.
    call = pickletools.optimize(pickle.dumps(_Payload(), protocol=3))
    assert real[:1] == pickle.PROTO and call.endswith(pickle.STOP)
    payload = real[:2] + call[2:-1] + pickle.POP + real[2:]
    assert type(pickle.loads(payload)) is type(pickle.loads(real))
    assert MARKER in capsys.readouterr().out  # the payload is live
    index.write_bytes(payload)
    rehash(latest, ".metadata")  # the hashes agree: only the allow-list stands in the way

    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert f"{index}: not a plain torch checkpoint index" in refused.err
    assert "builtins.print is not checkpoint metadata" in refused.err
    listed = cli("checkpoints", "list", run, "--verify")
    assert re.search(rf"^\*\s+{LATEST}\s.*DAMAGED", listed.out, re.MULTILINE), listed.out
    assert MARKER not in refused.out + refused.err + listed.out + listed.err


def test_a_metadata_pickle_naming_a_class_a_metadata_module_only_imports_is_refused(run, cli):
    latest = run / "checkpoints" / LATEST
    index = latest / ".metadata"
    # pathlib.Path("/tmp"), named through torch.distributed.checkpoint.filesystem, which imports
    # it: a class, found in an allowed module, and no checkpoint metadata.
    path = b"/tmp"
    index.write_bytes(
        pickle.PROTO
        + b"\x03"
        + pickle.GLOBAL
        + b"torch.distributed.checkpoint.filesystem\nPath\n"
        + pickle.BINUNICODE
        + struct.pack("<I", len(path))
        + path
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    rehash(latest, ".metadata")
    listed = cli("checkpoints", "list", run, "--verify")
    assert re.search(rf"^\*\s+{LATEST}\s.*DAMAGED", listed.out, re.MULTILINE), listed.out
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert "torch.distributed.checkpoint.filesystem.Path is not checkpoint metadata" in refused.err


# -- latest naming a checkpoint that is gone ----------------------------------------------------


@pytest.mark.slow
def test_latest_naming_a_checkpoint_that_is_gone_says_so_and_the_advice_works(
    run, manifest, reference, cli
):
    shutil.rmtree(run / "checkpoints" / LATEST)
    for command in (["resume", run], ["train", manifest, "--resume", "--run-dir", run]):
        refused = cli(*command, "--no-progress")
        assert refused.code == 2
        assert f"names {LATEST!r}, which is not a checkpoint here" in refused.err
        assert "--checkpoint NAME" in refused.err
    gc.collect()  # the refused Trainer's run.lock (see the damaged-file test)
    resumed = cli("resume", run, "--checkpoint", PREVIOUS, "--stop-at", PAUSED_AT, "--no-progress")
    assert resumed.code == 0, resumed.err
    assert CheckpointDir(run).latest().name == LATEST
    assert read_metrics(run)[-1].loss == read_metrics(reference)[PAUSED_AT - 1].loss


def test_a_second_rewind_past_a_step_keeps_both_abandoned_checkpoints(tmp_path):
    store = CheckpointDir(tmp_path)

    def save(step: int, text: str) -> None:
        (store.path / checkpoint_name(step)).mkdir(parents=True)
        (store.path / checkpoint_name(step) / "what").write_text(text)

    save(1, "first")
    save(2, "abandoned once")
    store.rewind(store.path / checkpoint_name(1))
    save(2, "abandoned twice")
    moved = store.rewind(store.path / checkpoint_name(1))
    superseded = store.path / "superseded"
    assert moved == [superseded / f"{checkpoint_name(2)}.2"]
    assert sorted((p.name, (p / "what").read_text()) for p in superseded.iterdir()) == [
        (checkpoint_name(2), "abandoned once"),
        (f"{checkpoint_name(2)}.2", "abandoned twice"),
    ]
    assert store.latest() == store.path / checkpoint_name(1)


@pytest.mark.slow
def test_a_save_cut_between_its_two_renames_keeps_the_previous_copy(run, reference, cli):
    """Saving a step again renames the old copy aside, then the new one into place; a crash in
    between leaves `latest` naming nothing. The old copy is named, not swept away."""
    checkpoints = run / "checkpoints"
    aside = checkpoints / f".{LATEST}.replaced"
    (checkpoints / LATEST).rename(aside)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert f"the previous {LATEST} is whole in {aside}. Put it back with `mv {aside} " in (
        refused.err
    ), refused.err
    # Resumed from the one before instead, the next save keeps the copy in superseded/.
    gc.collect()
    resumed = cli("resume", run, "--checkpoint", PREVIOUS, "--stop-at", PAUSED_AT, "--no-progress")
    assert resumed.code == 0, resumed.err
    kept = checkpoints / "superseded" / LATEST
    assert not aside.exists() and kept.is_dir()
    verify_files(kept, read_meta(kept).files)
    assert read_metrics(run)[-1].loss == read_metrics(reference)[PAUSED_AT - 1].loss


# -- records of earlier attempts ----------------------------------------------------------------


@pytest.mark.slow
def test_torn_log_tails_are_cut_and_stale_status_fields_dropped_on_resume(run, reference, cli):
    """A crash or a full disk left metrics.jsonl and events.jsonl ending mid-line, and the
    failed attempt's error in status.json. The resume appends after whole lines only, so
    every log still reads, and its status is its own."""
    for name in ("metrics.jsonl", "events.jsonl"):
        log = run / name
        log.write_bytes(log.read_bytes()[:-20])
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(
        json.dumps(
            {**status, "state": "failed", "error": "OSError: [Errno 28] No space left on device"}
        )
    )
    resumed = cli("resume", run, "--stop-at", PAUSED_AT + 1, "--no-progress")
    assert resumed.code == 0, resumed.err
    for name in ("metrics.jsonl", "events.jsonl"):
        assert all(json.loads(line) for line in (run / name).read_text().splitlines())
    # Step 2's torn line is gone; step 3 trained as in the straight run.
    assert [r.step for r in read_metrics(run)] == [1, PAUSED_AT + 1]
    assert read_metrics(run)[-1].loss == read_metrics(reference)[PAUSED_AT].loss
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"], "error" in status) == ("paused", PAUSED_AT + 1, False)


@pytest.mark.slow
def test_a_run_killed_between_its_final_checkpoint_and_final_weights_is_finished(
    reference, tmp_path, cli
):
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    shutil.rmtree(run / "final")
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "running"}))

    finished = cli("resume", run, "--no-progress")
    assert finished.code == 0, finished.err
    assert f"final weights written from its step {STEPS} checkpoint" in finished.out
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    written = json.loads((run / "final" / WEIGHTS_META).read_text())
    straight = json.loads((reference / "final" / WEIGHTS_META).read_text())
    assert written == straight  # the same weights (fingerprint), manifest, steps and last loss
    assert [r.step for r in read_metrics(run)] == list(range(1, STEPS + 1))  # nothing trained
    again = cli("resume", run, "--no-progress")
    assert again.code == 0 and "nothing to train" in again.err


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 16 MiB tmpfs mounted for the test: a disk that fills up for real."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path, name: str, leave: int) -> None:
    """Write a file onto ``disk`` that leaves ``leave`` bytes free (all of it, when 0)."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / name, "wb") as filler, contextlib.suppress(OSError):  # ENOSPC: full
        filler.write(b"\0" * max(0, free - leave))


@pytest.mark.slow
def test_a_full_disk_is_said_once_with_what_was_kept_and_the_run_resumes_after(
    paused, reference, small_disk, cli
):
    """Issue 49, 5: a checkpoint save on a full disk ended in a chained OSError 28 traceback
    (exit 1), status.json still said running at step 0 though step 2 was checkpointed, and a
    resume on the still-full disk failed the same way."""
    run = Path(shutil.copytree(paused, small_disk / "run"))
    size = sum(f.stat().st_size for f in (run / "checkpoints" / LATEST).iterdir())
    _fill(small_disk, "filler", leave=size // 2)  # the next save cannot fit

    failed = cli("resume", run, "--no-progress")
    assert failed.code == 74, failed.err
    assert "Traceback" not in failed.err and failed.err.count("no space left") == 1
    assert re.search(
        f"{run}: no space left on the device .*after step {PAUSED_AT + 1} ", failed.err
    )
    assert f"checkpoints/{LATEST} is the latest whole checkpoint" in failed.err
    assert f"fp8ops resume {run}" in failed.err and "(status.json says failed)" in failed.err
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("failed", PAUSED_AT + 1)
    assert status["error"].startswith("StorageFull: ")
    assert read_jsonl(run / "events.jsonl")[-1]["event"] == "failed"
    assert CheckpointDir(run).latest().name == LATEST
    assert not list((run / "checkpoints").glob(".*.partial"))  # its space handed back

    # Full to the last byte, a resume fails at its first write, the same clear way.
    _fill(small_disk, "filler2", leave=0)
    again = cli("resume", run, "--no-progress")
    assert again.code == 74, again.err
    assert "Traceback" not in again.err
    assert f"checkpoints/{LATEST} is the latest whole checkpoint" in again.err

    # With space again, the resume continues as the straight run did.
    for name in ("filler", "filler2"):
        (small_disk / name).unlink()
    resumed = cli("resume", run, "--stop-at", PAUSED_AT + 2, "--no-progress")
    assert resumed.code == 0, resumed.err
    losses = [r.loss for r in read_metrics(run)]
    assert losses == [r.loss for r in read_metrics(reference)][: PAUSED_AT + 2]  # bit for bit


def _free_space(monkeypatch, free: int, size: int) -> None:
    """The file systems' free space and size as ``os.statvfs`` reports them (1 KiB blocks)."""
    found = SimpleNamespace(
        f_bavail=free // 1024,
        f_frsize=1024,
        f_blocks=size // 1024,
        f_files=10**6,
        f_favail=10**5,
        f_flag=0,
    )
    monkeypatch.setattr(os, "statvfs", lambda path: found)


def test_what_a_full_disk_is_taken_for(run, monkeypatch):
    """The failures the run reports as a full disk: an OSError saying so anywhere in the chain;
    an error that says nothing, on a full file system; never a user error, which says what it
    is, an interrupt, nor anything on a disk with room."""
    import errno

    from fp8ops.errors import StorageFull
    from fp8ops.train import ending

    _free_space(monkeypatch, free=2**40, size=2**42)  # room, whatever this machine's disk has

    full = OSError(errno.EDQUOT, "Disk quota exceeded", str(run / "metrics.jsonl"))
    assert ending.storage_cause(run, full) == (
        str(run / "metrics.jsonl"),
        "disk quota exceeded",
        f"OSError: [Errno {errno.EDQUOT}] Disk quota exceeded: '{run / 'metrics.jsonl'}'",
    )
    silent = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert ending.storage_cause(run, silent) is None  # this disk has room
    assert ending.storage_cause(run, StorageFull("said already")) is None
    monkeypatch.setattr(ending, "disk_full", lambda path, need: "no space left on the device")
    cause = ending.storage_cause(run, silent)
    assert cause == (str(run), "no space left on the device", f"RuntimeError: {silent}")
    assert ending.storage_cause(run, DriftRefused("a drift")) is None
    assert ending.storage_cause(run, KeyboardInterrupt()) is None  # Ctrl-C is not the disk
    message = ending.storage_message(run, cause, 3, [".step_00000003.partial"])
    assert message.startswith(f"{run}: no space left on the device after step 3 (RuntimeError")
    assert (
        f"checkpoints/{LATEST} is the latest whole checkpoint (the failed save "
        ".step_00000003.partial was removed)"
    ) in message


def test_a_save_cut_short_by_something_else_on_a_disk_with_room_is_not_a_full_disk(
    run, monkeypatch
):
    """A peer's crash late in a save, on a disk with room for 1.5 checkpoints: the `.partial`
    holds 0.9 of a checkpoint, so 0.6 is left free, less than a checkpoint takes. That was said
    as "no space left", the `.partial` removed and the real error dropped; the save had room."""
    from fp8ops.train import ending

    size = sum(f.stat().st_size for f in (run / "checkpoints" / LATEST).rglob("*"))
    partial = run / "checkpoints" / f".{checkpoint_name(PAUSED_AT + 1)}.partial"
    partial.mkdir()
    (partial / "shard").write_bytes(b"\0" * int(0.9 * size))
    crash = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    disk = 10 * size  # 1% of it is a tenth of a checkpoint: not full by that rule
    _free_space(monkeypatch, free=int(0.6 * size), size=disk)
    assert ending.storage_cause(run, crash) is None

    # A save that failed for space early: what it wrote and what is free fall short of a
    # checkpoint.
    (partial / "shard").write_bytes(b"\0" * int(0.1 * size))
    _free_space(monkeypatch, free=int(0.6 * size), size=disk)
    assert ending.storage_cause(run, crash)[1].startswith("no space left on the device")


def test_a_full_disk_keeps_the_failure_it_was_found_in_as_its_cause(run):
    """The StorageFull said instead of a failure chains it: the real traceback is not lost."""
    import errno

    from fp8ops.errors import StorageFull
    from fp8ops.run import RunDir
    from fp8ops.train import ending

    full = OSError(errno.ENOSPC, "No space left on device", str(run / "checkpoints"))

    def save_checkpoint(step, reason):
        raise full

    stop = ending.StopRun("a Stop", [{"step": 3, "rule": "nonfinite", "message": "NaN"}])
    with pytest.raises(StorageFull, match="no space left on the device") as said:
        ending.stop(RunDir(run), None, save_checkpoint, stop)
    assert said.value.__cause__ is full


@pytest.mark.slow
def test_a_damaged_telemetry_store_says_how_to_resume_without_it(run, reference, cli):
    store = run / "telemetry.zarr"
    (store / "zarr.json").unlink()
    refused = cli("resume", run, "--stop-at", PAUSED_AT + 1, "--no-progress")
    assert refused.code == 2
    assert f"move it aside (mv {store} {store}.damaged)" in refused.err, refused.err
    gc.collect()  # the refused Trainer's run.lock (see the damaged-file test)
    store.rename(store.with_name("telemetry.zarr.damaged"))
    resumed = cli("resume", run, "--stop-at", PAUSED_AT + 1, "--no-progress")
    assert resumed.code == 0, resumed.err
    assert read_metrics(run)[-1].loss == read_metrics(reference)[PAUSED_AT].loss
    assert (store / "zarr.json").is_file()
    # The store it started again is said, not started quietly.
    assert f"warning: {store} is missing, though the checkpoint's run had committed" in resumed.err
    restarted = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "telemetry_restarted"]
    assert len(restarted) == 1 and f"records from step {PAUSED_AT + 1}" in restarted[0]["message"]


def test_train_into_a_run_being_trained_now_is_refused_as_such(run, manifest, cli):
    holder = RunDir(run)
    holder._hold()  # what the training process holds while it trains
    try:
        refused = cli("train", manifest, "--run-dir", run, "--no-progress")
    finally:
        holder.release()
    assert refused.code == 2
    assert "is being trained by another fp8ops process right now" in refused.err


# -- a resume beside a live run that rotates its checkpoints ------------------------------------

# Holds the run's lock as a training process does, until its stdin closes.
HOLDER = (
    "import sys; from fp8ops.run import RunDir; run = RunDir(sys.argv[1]); run._hold(); "
    "print('holding', flush=True); sys.stdin.read()"
)


@contextlib.contextmanager
def _trained_by_another_process(run: Path):
    """A live process that holds ``run``'s lock (another job training it); yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"holding\n"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _rotate(run: Path, *, saved: list[int], keep: int = 2) -> None:
    """What a live run's saves do to ``checkpoints/``: each new step renamed into place,
    `latest` moved to it, the oldest beyond ``keep`` renamed away and deleted (their content
    here is the paused checkpoint's: nothing reads them)."""
    store = CheckpointDir(run)
    for step in saved:
        shutil.copytree(store.latest(), store.path / f".{checkpoint_name(step)}.partial")
        (store.path / f".{checkpoint_name(step)}.partial").rename(
            store.path / checkpoint_name(step)
        )
        (store.path / "latest").write_text(checkpoint_name(step) + "\n")
        for old in store.complete()[:-keep]:
            doomed = old.rename(old.with_name(f".{old.name}.deleting"))
            shutil.rmtree(doomed)


@pytest.mark.parametrize("other_job", ["training", "ended"])
def test_a_resume_whose_checkpoint_a_live_run_rotated_away_blames_that_run(
    run, cli, monkeypatch, other_job
):
    """Issue 49.9, made deterministic: this resume planned from step 2 while nobody trained
    the run; before it read the checkpoint's files, another job took the run, saved steps 3 and
    4 and deleted steps 1 and 2 (keep_checkpoints 2). It called step 2 damaged with no earlier
    checkpoint ("…/.metadata: missing"); it says the other job trains the run (exit 2, as the
    lock's own refusal) or, that job ended, moved it on (exit 4)."""
    from fp8ops.train.trainer import Trainer

    load, holder = Trainer.restore, {}
    with contextlib.ExitStack() as other:

        def rotated_first(self, plan):
            holder["pid"] = other.enter_context(_trained_by_another_process(run))
            _rotate(run, saved=[PAUSED_AT + 1, PAUSED_AT + 2])
            if other_job == "ended":
                other.close()  # the lock released: the process is gone
            return load(self, plan)

        monkeypatch.setattr(Trainer, "restore", rotated_first)
        refused = cli("resume", run, "--no-progress")
    assert "damaged" not in refused.err, refused.err
    if other_job == "training":
        assert refused.code == 2, refused.err
        assert (
            f"refusing to resume: {run} is being trained by another fp8ops process right now "
            f"(pid {holder['pid']} on {os.uname().nodename}): wait for it to finish, or stop it "
            f"first (it replaced or removed {LATEST} as this resume read it); then resume"
        ) in refused.err
    else:
        assert refused.code == 4, refused.err
        assert (
            f"refusing to resume {run}: it moved on while this resume read {LATEST} (latest "
            f"checkpoint {LATEST} -> {checkpoint_name(PAUSED_AT + 2)}"
        ) in refused.err


def test_a_resume_of_a_run_another_process_trains_is_refused_before_reading_it(run, manifest, cli):
    """A live run moves `latest` and deletes old checkpoints as it saves: a resume beside it
    refuses before it reads any, naming the process that holds the lock."""
    with _trained_by_another_process(run) as pid:
        for command in (["resume", run], ["train", manifest, "--resume", "--run-dir", run]):
            refused = cli(*command, "--no-progress")
            assert refused.code == 2, refused.err
            assert (
                f"{run} is being trained by another fp8ops process right now (pid {pid} on "
                f"{os.uname().nodename}): wait for it to finish, or stop it first; then resume"
            ) in refused.err


@pytest.mark.slow
def test_resumes_beside_a_live_run_rotating_its_checkpoints_say_it_trains(
    saver, small_base, tmp_path, cli
):
    """The issue's reproduction: a run trains in the background, saving every step and keeping
    two, and `fp8ops resume` is called on it again and again while it rotates them."""
    long = write_small_finetune(
        tmp_path / "long.yaml",
        small_base,
        {"schedule.train_steps": 5000, "schedule.eval_interval": 5000, "capability.enabled": False},
    )
    run, log = tmp_path / "run", tmp_path / "live.log"
    pid = saver.start(log, "train", long, "--run-dir", run, "--no-progress")
    try:
        seen = set()
        deadline = time.monotonic() + 300
        while len(seen) < 4:  # resumes across four of its saves
            latest = _latest_step(run) if (run / "checkpoints" / "latest").exists() else 0
            assert _running(pid), log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            if latest == 0:
                time.sleep(0.05)
                continue
            seen.add(latest)
            refused = cli("resume", run, "--no-progress")
            assert refused.code == 2, refused.err
            assert "damaged" not in refused.err
            assert (
                f"is being trained by another fp8ops process right now (pid {pid} on "
                f"{os.uname().nodename})"
            ) in refused.err, refused.err
    finally:
        saver.kill(pid)


def test_an_unreadable_base_checkpoint_is_named_with_its_field(manifest, tmp_path, cli):
    base = Path(load_manifest(manifest).model.init_checkpoint)
    damaged = Path(shutil.copytree(base, tmp_path / "base"))
    shard = max(
        (p for p in damaged.rglob("*") if p.is_file() and p.suffix == ".distcp"),
        key=lambda p: p.stat().st_size,
    )
    shard.write_bytes(shard.read_bytes()[:100])
    edited = write_manifest(
        derive(load_manifest(manifest), {"model.init_checkpoint": str(damaged)}, "test"),
        tmp_path / "edited.yaml",
    )
    refused = cli("train", edited, "--run-dir", tmp_path / "run", "--no-progress")
    assert refused.code == 2, refused.err
    # What torch's reader raises for a cut shard depends on the megatron-core version.
    unreadable = r"(EOFError|RuntimeError: PytorchStreamReader failed reading zip archive)"
    assert re.search(
        f"model.init_checkpoint '{re.escape(str(damaged))}': its weights cannot be "
        f"read \\({unreadable}",
        refused.err,
    ), refused.err
    assert "Traceback" not in refused.err


def test_resume_of_what_is_not_a_resumable_run_says_what_it_is(tmp_path, cli):
    file = tmp_path / "a-file"
    file.write_text("x\n")
    early = tmp_path / "early"
    early.mkdir()
    (early / "status.json").write_text(json.dumps({"state": "failed", "step": 0}))
    for path, says in [
        (tmp_path / "typo", "does not exist: give the run directory to resume"),
        (file, "is a file: give the run directory to resume"),
        (
            early,
            f"stopped before its first one. Start it over with `fp8ops train MANIFEST "
            f"--resume --run-dir {early}`",
        ),
    ]:
        refused = cli("resume", path, "--no-progress")
        assert refused.code == 2 and says in refused.err, refused.err


@pytest.mark.slow
def test_a_stop_alert_at_the_last_step_is_finished_with_its_evaluations(reference, tmp_path, cli):
    """A Stop alert at the last step checkpoints before the step's evaluations (the checkpoint's
    reason says so). Simulated on the straight run: its final checkpoint relabelled, the
    final evaluation and weights removed."""
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    last = run / "checkpoints" / checkpoint_name(STEPS)
    edit_meta(last, lambda meta: meta.update(reason="alert-stop: saturation"))
    shutil.rmtree(run / "final")
    evals = (run / "eval.jsonl").read_text().splitlines()
    (run / "eval.jsonl").write_text("".join(line + "\n" for line in evals[:-1]))
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "stopped"}))

    before = _files(run)
    refused = cli("resume", run, "--no-progress")  # nothing answers the Stop (next test)
    assert refused.code == 3, refused.err
    assert "it would write the final weights of a run whose last step stopped" in refused.err
    assert _files(run) == before
    finished = cli("resume", run, "--after-stop", "the last step: keep it", "--no-progress")
    assert finished.code == 0, finished.err
    straight_eval = json.loads(evals[-1])
    assert json.loads((run / "eval.jsonl").read_text().splitlines()[-1]) == straight_eval
    assert f"eval loss {straight_eval['loss']:.4f}" in finished.out
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    written = json.loads((run / "final" / WEIGHTS_META).read_text())
    assert written == json.loads((reference / "final" / WEIGHTS_META).read_text())


def _stop(run: Path, step: int = PAUSED_AT) -> None:
    """Mark ``run`` as a Stop alert halts it: a checkpoint of the step, status ``stopped``."""
    alert = {
        "step": step,
        "level": "stop",
        "rule": "saturation",
        "module": "decoder.layers.0.mlp.linear_fc1",
        "metric": "input.saturation",
        "message": "input.saturation 0.05 > 0.01 for 3 consecutive measured steps",
    }
    last = run / "checkpoints" / checkpoint_name(step)
    edit_meta(last, lambda meta: meta.update(reason="alert-stop: saturation"))
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(
        json.dumps(
            {**status, "state": "stopped", "step": step, "alert": alert, "checkpoint": last.name}
        )
    )


def test_a_stopped_run_resumes_only_when_something_answers_the_stop(run, manifest, cli):
    """A chain's next job or a requeue would otherwise train up to the same Stop again."""
    from fp8ops.overrides import Ledger
    from fp8ops.start import StopUnanswered, plan_resume

    _stop(run)
    before = _files(run)
    for command in (("resume", run), ("train", manifest, "--resume", "--run-dir", run)):
        refused = cli(*command, "--no-progress")
        assert refused.code == 3, refused.err
        assert (
            f"a Stop alert halted it at step {PAUSED_AT} (input.saturation 0.05 > 0.01"
            in refused.err
            and "--after-stop" in refused.err
        ), refused.err
    assert cli("resume", run, "--after-stop", " ", "--no-progress").code == 2
    assert _files(run) == before
    # From an older checkpoint too: it would train up to the same Stop.
    with pytest.raises(StopUnanswered):
        plan_resume(run, checkpoint=PREVIOUS)
    # Another node (environment drift, accepted) changes nothing the Stop was about.
    elsewhere = {**read_meta(run / "checkpoints" / LATEST).environment, "torch": "9.9.9"}
    with pytest.raises(StopUnanswered, match="the resume would change nothing"):
        plan_resume(run, accept_drift="another node", environment=elsewhere)
    # What answers it: a reason to go on as it is, a manifest change, an approved override.
    assert plan_resume(run, after_stop="a transient spike").after_stop == "a transient spike"
    drifted = plan_resume(run, assignments={"optimizer.weight_decay": 0.05}, accept_drift="why")
    assert drifted.new_revisions and drifted.after_stop is None
    ledger = Ledger(run)
    staged = ledger.stage("decoder.layers.0.mlp.linear_fc1", "saturates", who="ana")
    with pytest.raises(StopUnanswered):  # staged is not approved
        plan_resume(run)
    ledger.approve(staged.id, who="ben")
    assert [o.module for o in plan_resume(run).applied_overrides] == [staged.module]
    # Resumed with a reason, the run records it and trains on.
    resumed = cli(
        "resume",
        run,
        "--after-stop",
        "a transient spike",
        "--stop-at",
        PAUSED_AT + 1,
        "--no-progress",
    )
    assert resumed.code == 0, resumed.err
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resumed"]
    assert event["after_stop"] == "a transient spike"
    assert event["overrides_applied"] == [staged.module]


def test_data_pad_to_may_change_on_a_resume(run):
    """How far batches are padded changes neither the rows nor their order (docs/data.md)."""
    from fp8ops.start import plan_resume

    with pytest.raises(DriftRefused, match=r"data\.pad_to: 'seq_length' -> 'longest'"):
        plan_resume(run, assignments={"data.pad_to": "longest"})
    plan = plan_resume(run, assignments={"data.pad_to": "longest"}, accept_drift="narrower")
    assert plan.manifest.data.pad_to == "longest"
    with pytest.raises(DriftRefused, match="would change the training set"):  # other data fields
        plan_resume(run, assignments={"data.eval_fraction": 0.2}, accept_drift="more held out")


def test_a_resume_past_a_shortened_schedule_trains_and_overwrites_nothing(run, cli):
    before = _files(run)
    result = cli(
        "resume",
        run,
        "--set",
        "schedule.train_steps=1",
        "--accept-drift",
        "shorter",
        "--no-progress",
    )
    assert result.code == 0 and "nothing to train" in result.err, result.err
    assert _files(run) == before


def test_a_resume_on_other_data_is_refused(run, cli):
    info = json.loads((run / "run.json").read_text())
    info["data"]["fingerprint"] = "0" * 64  # the data the run started on, as far as it knows
    (run / "run.json").write_text(json.dumps(info))
    before = _files(run)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 4
    assert (
        "the training data changed since the run started (data.kind tasks: run.json "
        "records data fingerprint 000000000000, the data now hash to "
    ) in refused.err
    assert _files(run) == before


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda record: record.unlink(), "run.json: no such file"),
        (lambda record: record.write_text("{"), "run.json: cannot be read: not valid JSON"),
        (
            lambda record: record.write_text(
                json.dumps({**json.loads(record.read_text()), "tokenizer": {"kind": "byte"}})
            ),
            "run.json records no tokenizer fingerprint",
        ),
        (
            lambda record: record.write_text(
                json.dumps({**json.loads(record.read_text()), "data": {"kind": "tasks"}})
            ),
            "run.json records no data fingerprint",
        ),
    ],
    ids=["missing", "damaged", "no-tokenizer-fingerprint", "no-data-fingerprint"],
)
def test_a_resume_whose_run_json_cannot_say_what_it_started_from_is_refused(run, cli, damage, said):
    """The tokenizer and data checks fail closed: what run.json cannot vouch for is refused,
    not taken as unchanged."""
    damage(run / "run.json")
    before = _files(run)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 4, refused.err
    assert said in refused.err and "Restore the run's run.json" in refused.err, refused.err
    assert _files(run) == before


def test_a_resume_refuses_an_edited_run_manifest_instead_of_writing_over_it(run, cli):
    file = run / "manifest.yaml"
    original = file.read_text()
    assert "\n  lr: 0.002\n" in original
    file.write_text(original.replace("\n  lr: 0.002\n", "\n  lr: 0.001\n"))
    before = _files(run)
    other = run.parent / "other.yaml"  # the SLURM way: the manifest file the run started from
    shutil.copy(CheckpointDir(run).latest() / "manifest.yaml", other)
    for command in (
        ["resume", run],
        ["train", other, "--run-dir", run, "--resume"],
        ["resume", run, "--set", "optimizer.lr=0.003", "--accept-drift", "x"],
    ):
        refused = cli(*command, "--no-progress")
        assert refused.code == 4, refused.err
        assert f"refusing to resume: {file} was edited after the run wrote it:" in refused.err
        assert "manifest    optimizer.lr: 0.002 -> 0.001" in refused.err
        assert "then resume; to change the run, add --set FIELD=VALUE" in refused.err
        assert _files(run) == before  # the edit is still there to restore or redo
    # The edited file given as the manifest is a request: diffed as drift, as any other file.
    as_request = cli("train", file, "--run-dir", run, "--resume", "--no-progress")
    assert as_request.code == 4 and "refusing to resume from " in as_request.err
    assert "optimizer.lr: 0.002 -> 0.001" in as_request.err
    assert _files(run) == before
    restore = refused.err.split("Restore the file (")[1].split(")")[0].split()
    assert restore[0] == "cp" and restore[2] == str(file)
    shutil.copy(restore[1], restore[2])
    assert file.read_text() == original
    file.write_text("optimizer: [")  # an edit that no longer loads is refused the same way
    broken = cli("resume", run, "--no-progress")
    assert broken.code == 4 and "was edited after the run wrote it and no longer loads" in (
        broken.err
    )


def test_a_resume_refuses_a_run_another_job_moved_on_while_it_loaded(run, cli, monkeypatch):
    """Two SLURM jobs on one run directory: this one planned from the paused checkpoint, and
    while it loaded the other finished the run. Taking the lock after loading, it would rewind
    that work (the SLURM review's race); it refuses instead, having written nothing."""
    from fp8ops.train.trainer import Trainer

    load, after_the_other_job = Trainer.restore, {}

    def meanwhile(self, plan):
        load(self, plan)
        status = json.loads((run / "status.json").read_text())
        (run / "status.json").write_text(json.dumps({**status, "state": "completed"}))
        after_the_other_job.update(_files(run))

    monkeypatch.setattr(Trainer, "restore", meanwhile)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 4, refused.err
    assert (
        f"refusing to resume {run}: it moved on while this resume loaded {LATEST} (latest "
        f"checkpoint {LATEST} -> {LATEST}, status paused -> completed)"
    ) in refused.err
    assert _files(run) == after_the_other_job  # nothing written by the refused resume


def test_a_run_manifest_holding_any_stored_revision_is_not_an_edit(run):
    """A resume killed between writing manifest.yaml (its new revision, stored first) and
    status.json leaves a file that is not the locked revision but is one of the run's."""
    child = derive(load_manifest(run / "manifest.yaml"), {"optimizer.lr": 1e-3}, "test: next")
    ManifestStore(run / "manifests").put(child)
    (run / "manifest.yaml").write_text(to_yaml(child))
    check_unedited(run)  # no refusal
    (run / "manifest.yaml").write_text(to_yaml(child).replace("lr: 0.001", "lr: 0.0011"))
    with pytest.raises(DriftRefused, match="was edited after the run wrote it"):
        check_unedited(run)


@pytest.mark.slow
def test_a_rewind_to_an_earlier_revision_moves_the_lock_back(run, manifest, cli):
    first = manifest_hash(load_manifest(run / "manifest.yaml"))
    drifted = cli(
        "resume",
        run,
        "--set",
        "optimizer.lr=0.001",
        "--accept-drift",
        "lower lr",
        "--stop-at",
        PAUSED_AT + 1,
        "--no-progress",
    )
    assert drifted.code == 0, drifted.err
    assert manifest_hash(locked_manifest(run)) != first
    back = cli(
        "resume", run, "--checkpoint", PAUSED_AT, "--stop-at", PAUSED_AT + 1, "--no-progress"
    )
    assert back.code == 0, back.err
    assert manifest_hash(locked_manifest(run)) == first  # the file moved back with the lock


# -- a checkpoint that is not this run's --------------------------------------------------------


def test_a_checkpoint_from_another_run_is_refused(run, manifest, tmp_path, cli):
    latest = run / "checkpoints" / LATEST
    other = derive(load_manifest(manifest), {"optimizer.lr": 1e-3}, "test: another run")
    (latest / "manifest.yaml").unlink()
    write_manifest(other, latest / "manifest.yaml")
    rehash(latest, "manifest.yaml")
    # As another run saved it: its own revision chain, sealed with it (consistent in itself).
    chain = {"manifest": manifest_hash(other), "revisions": [manifest_hash(other)]}
    seal = latest / SEAL_FILE
    seal.write_text(json.dumps({**json.loads(seal.read_text()), **chain}))
    rehash(latest, SEAL_FILE)
    edit_meta(latest, lambda meta: meta.update(chain))
    before = _files(run)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert f"{latest}: saved under manifest {manifest_hash(other)[:12]}, which is not one of " in (
        refused.err
    )
    assert "belongs to another run" in refused.err
    assert _files(run) == before


def test_an_edited_revision_is_refused_before_training(run, cli):
    (stored,) = (run / "manifests").glob("*.yaml")
    stored.write_text(stored.read_text().replace("margin: 0", "margin: 2"))
    before = _files(run)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 2
    assert str(stored) in refused.err
    assert _files(run) == before  # refused before anything trained or was written


def test_a_new_telemetry_block_size_needs_a_new_store(run, cli):
    blocks = load_manifest(run / "manifest.yaml").telemetry.flush_steps
    other = 1 if blocks != 1 else 2
    args = (
        "--set",
        f"telemetry.flush_steps={other}",
        "--accept-drift",
        "fresher reads",
        "--stop-at",
        PAUSED_AT + 1,
        "--no-progress",
    )
    refused = cli("resume", run, *args)
    assert refused.code == 4
    store = run / "telemetry.zarr"
    assert f"telemetry.flush_steps changed ({blocks} -> {other}), but {store} " in refused.err
    assert "move the store aside" in refused.err
    store.rename(run / "telemetry.zarr.old")
    resumed = cli("resume", run, *args)
    assert resumed.code == 0, resumed.err
    assert zarr_chunk_steps(store) == other


def zarr_chunk_steps(store: Path) -> int:
    """Steps per block of rank 0's per-module metrics (the array chunked by flush_steps)."""
    import zarr

    from fp8ops.telemetry.store import MODULE_METRICS, rank_group

    return zarr.open_group(store / rank_group(0), mode="r")[MODULE_METRICS].chunks[0]


def test_an_empty_drift_reason_is_refused(run, cli):
    refused = cli(
        "resume", run, "--set", "optimizer.lr=0.001", "--accept-drift", " ", "--no-progress"
    )
    assert refused.code == 2
    assert "--accept-drift: give the reason" in refused.err


# -- drift: refused from the JSON, before any model ---------------------------------------------


def test_manifest_drift_is_refused_before_any_model_is_built(run, manifest, tmp_path):
    edited = write_manifest(
        derive(load_manifest(manifest), {"optimizer.lr": 1e-3}, "test: another learning rate"),
        tmp_path / "edited.yaml",
    )
    before = _files(run)
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "fp8ops",
            "train",
            str(edited),
            "--resume",
            "--run-dir",
            str(run),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    seconds = time.perf_counter() - started
    print(f"refused in {seconds:.2f} s (with -X importtime)")
    assert done.returncode == 4, done.stderr[-3000:]
    assert "manifest    optimizer.lr: 0.002 -> 0.001" in done.stderr
    assert "--accept-drift" in done.stderr
    imported = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported and not [line for line in imported if "megatron" in line]  # no model
    assert _files(run) == before  # no event, no status change, nothing written


def test_a_requeue_on_another_node_is_refused_without_importing_torch(run, manifest):
    """What a SLURM requeue runs (the run's own manifest, --resume) on a node with another torch:
    refused for drift from the checkpoint's JSON, before torch or Megatron load."""
    edit_meta(run / "checkpoints" / LATEST, lambda m: m["environment"].update(torch="0.0.1"))
    before = _files(run)
    command = ["train", str(manifest), "--resume", "--run-dir", str(run), "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fp8ops", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 4 and "environment torch: '0.0.1' -> " in done.stderr, done.stderr
    loaded = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "torch" not in loaded and not any(m.startswith("megatron") for m in loaded)
    assert _files(run) == before


@pytest.mark.slow
def test_environment_drift_is_refused_and_recorded_when_accepted(run, cli):
    latest = run / "checkpoints" / LATEST
    edit_meta(latest, lambda meta: meta["environment"].update(torch="2.0.0+elsewhere"))
    before = _files(run)
    refused = cli("resume", run, "--no-progress")
    assert refused.code == 4
    assert f"environment torch: '2.0.0+elsewhere' -> {torch.__version__!r}" in refused.err
    assert _files(run) == before

    reason = "test: the same numerics on this torch"
    accepted = cli(
        "resume", run, "--accept-drift", reason, "--stop-at", PAUSED_AT + 1, "--no-progress"
    )
    assert accepted.code == 0, accepted.err
    assert f"accepted drift: environment torch ({reason})" in accepted.out
    resumed = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resumed"]
    assert len(resumed) == 1
    assert resumed[0]["drift"] == [
        {"what": "environment", "path": "torch", "old": "2.0.0+elsewhere", "new": torch.__version__}
    ]
    assert resumed[0]["accepted"] == reason
    assert resumed[0]["new_revisions"] == []  # the manifest did not change
    saved = read_meta(run / "checkpoints" / checkpoint_name(PAUSED_AT + 1))
    assert saved.environment["torch"] == torch.__version__


def _files(run: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``run`` with its size and modification time."""
    return {
        str(path.relative_to(run)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in run.rglob("*")
        if path.is_file()
    }
