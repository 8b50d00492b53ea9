"""fp8ops.files: logs that survive a torn last line, the CLI's answer to paths that fail, and
how a full, over-quota or read-only disk is recognised (fp8ops.errors.storage_error,
fp8ops.files.disk_full)."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from types import SimpleNamespace

import pytest
from support.fifo import without_waiting

from fp8ops.errors import Fp8opsError, StorageFull, storage_error
from fp8ops.files import (
    NONFINITE,
    append_lines,
    disk_full,
    json_line,
    open_regular,
    read_jsonl,
)
from fp8ops.run import read_status


@pytest.mark.parametrize("torn", [b'{"step": 3, "lo', b"x" * 70_000], ids=["short", "over-a-block"])
def test_append_lines_cuts_a_torn_last_line_first(tmp_path, torn):
    log = tmp_path / "metrics.jsonl"
    whole = b"".join(json.dumps({"step": s}).encode() + b"\n" for s in (1, 2))
    log.write_bytes(whole + torn)
    assert [r["step"] for r in read_jsonl(log)] == [1, 2]  # the reader skips the torn line
    append_lines(log, json.dumps({"step": 3}) + "\n")
    assert log.read_bytes() == whole + b'{"step": 3}\n'
    assert [r["step"] for r in read_jsonl(log)] == [1, 2, 3]


def test_append_lines_keeps_a_whole_last_record_that_lost_only_its_newline(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}')
    assert [r["step"] for r in read_jsonl(log)] == [1, 2]
    append_lines(log, '{"step": 3}\n')
    assert [r["step"] for r in read_jsonl(log)] == [1, 2, 3]


def test_append_lines_on_a_file_that_is_all_torn_line_or_new(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"event": "run_sta')
    append_lines(log, '{"a": 1}\n')
    assert log.read_text() == '{"a": 1}\n'
    fresh = tmp_path / "new.jsonl"
    append_lines(fresh, '{"b": 2}\n')
    append_lines(fresh, '{"c": 3}\n')
    assert fresh.read_text() == '{"b": 2}\n{"c": 3}\n'


def test_a_binary_log_is_named_as_damaged(tmp_path):
    log = tmp_path / "alerts.jsonl"
    log.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(Fp8opsError, match=rf"{log}: not text \(not UTF-8\); the file is damaged"):
        read_jsonl(log)


@pytest.mark.parametrize("content", ["[]", "\udcff"], ids=["not-an-object", "not-text"])
def test_a_damaged_status_file_is_named(tmp_path, content):
    (tmp_path / "status.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(Fp8opsError, match=rf"{tmp_path / 'status.json'}: .*the file is damaged"):
        read_status(tmp_path)


def test_an_output_path_that_cannot_be_written_is_named_without_a_traceback(tmp_path, cli):
    from support.example_manifests import TINY

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    out = blocker / "child.yaml"
    result = cli(
        "manifest", "derive", TINY, "--set", "precision.margin=1", "--reason", "why", "--out", out
    )
    assert result.code == 2
    assert result.err.strip() == f"{out}: {blocker} is a file, not a directory; choose another path"
    # Any other OSError is named by its path too, not shown as a traceback.
    long = tmp_path / ("x" * 300 + ".yaml")
    result = cli(
        "manifest", "derive", TINY, "--set", "precision.margin=1", "--reason", "why", "--out", long
    )
    assert result.code == 2
    assert result.err.startswith(str(tmp_path)) and "File name too long" in result.err, result.err


def test_a_manifest_written_to_a_directory_is_refused_as_such(tmp_path, cli):
    from support.example_manifests import TINY

    result = cli(
        "manifest",
        "derive",
        TINY,
        "--set",
        "precision.margin=1",
        "--reason",
        "why",
        "--out",
        tmp_path,
    )
    assert result.code == 2
    assert result.err.strip() == f"{tmp_path}: is a directory; give the manifest file's path"


def _strict(text: str):
    """JSON as jq and JavaScript read it: NaN, Infinity and -Infinity are not JSON."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_null_with_what_they_were_and_read_back(tmp_path):
    record = {
        "step": 3,
        "loss": math.nan,
        "buckets": {"a/b": math.inf, "ok": 1.5},
        "seq": [1.0, -math.inf],
    }
    line = json_line(record)
    strict = _strict(line)  # a strict reader takes it
    assert strict["loss"] is None and strict["buckets"]["a/b"] is None and strict["seq"][1] is None
    assert strict[NONFINITE] == {"/loss": "nan", "/buckets/a~1b": "inf", "/seq/1": "-inf"}
    log = tmp_path / "metrics.jsonl"
    append_lines(log, line + json_line({"step": 4, "loss": 2.0}))
    first, second = read_jsonl(log)
    assert math.isnan(first["loss"]) and first["buckets"] == {"a/b": math.inf, "ok": 1.5}
    assert first["seq"] == [1.0, -math.inf] and NONFINITE not in first
    assert second == {"step": 4, "loss": 2.0}


def test_a_nonfinite_entry_naming_nothing_is_damage_by_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "nonfinite": {"/buckets/x": "nan"}}\n')
    with pytest.raises(Fp8opsError, match=r"metrics.jsonl:2: its 'nonfinite' entry names"):
        read_jsonl(log)


def test_json_nested_past_the_recursion_limit_is_named_damage_not_a_traceback(tmp_path):
    """JSON nested 100,000 deep makes Python's parser raise RecursionError, which handlers of
    JSONDecodeError miss: every reader of a file someone else may write names the file."""
    from fp8ops.checkpoint.meta import read_meta
    from fp8ops.hf.config import read_config
    from fp8ops.run import read_run_record

    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for name in ("run.json", "config.json", "fp8ops_checkpoint.json", "log.jsonl"):
        (tmp_path / name).write_text(deep + "\n")
    (tmp_path / "status.json").write_text("{}")  # a run directory
    readers = [
        (lambda: read_run_record(tmp_path), "run.json"),
        (lambda: read_config(tmp_path), "config.json"),
        (lambda: read_meta(tmp_path), "fp8ops_checkpoint.json"),
        (lambda: read_jsonl(tmp_path / "log.jsonl"), "log.jsonl"),
    ]
    for read, name in readers:
        with pytest.raises(Fp8opsError, match=rf"{name}.*nested too deeply"):
            read()


def test_a_log_replaced_by_a_link_is_refused_and_the_target_untouched(tmp_path):
    """An attacker who can write the run directory links metrics.jsonl to a file of whoever runs
    fp8ops: appending would cut its last line (it looks torn) and write records into it."""
    victim = tmp_path / "bashrc"
    victim.write_text('export PATH=/usr/bin\nalias ll="ls -l"')  # no final newline
    log = tmp_path / "run" / "metrics.jsonl"
    log.parent.mkdir()
    log.symlink_to(victim)
    with pytest.raises(Fp8opsError, match="metrics.jsonl: is a symbolic link"):
        append_lines(log, json_line({"step": 1, "loss": 1.0}))
    assert victim.read_text() == 'export PATH=/usr/bin\nalias ll="ls -l"'
    fifo = tmp_path / "run" / "events.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(Fp8opsError, match="events.jsonl: not a regular file"):
        append_lines(fifo, json_line({"event": "x"}))


def test_a_log_or_lock_that_is_not_a_regular_file_is_refused_at_once_on_read(tmp_path):
    """A FIFO where a log or run.lock should be: an ordinary open for reading waits for a writer
    forever, and every reader of the run (the console, a resume's checks) hung. A link is
    refused on read as on append, rather than followed to another run's file."""
    from fp8ops.run.run_dir import lock_holder, trained_now

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    os.mkfifo(run / "run.lock")
    refused = without_waiting(lambda: read_jsonl(run / "metrics.jsonl"), run / "metrics.jsonl")
    assert isinstance(refused, Fp8opsError), refused
    assert str(refused).startswith(f"{run / 'metrics.jsonl'}: not a regular file")
    for probe in (lock_holder, trained_now):
        refused = without_waiting(lambda probe=probe: probe(run), run / "run.lock")
        assert isinstance(refused, Fp8opsError), (probe, refused)
        assert "run.lock: not a regular file" in str(refused)

    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text(json_line({"step": 1}))
    (run / "events.jsonl").symlink_to(theirs)
    with pytest.raises(Fp8opsError, match="events.jsonl: is a symbolic link"):
        read_jsonl(run / "events.jsonl")


def test_a_regular_file_opened_without_waiting_reads_and_writes_as_a_blocking_file(tmp_path):
    log = tmp_path / "log.jsonl"
    with open_regular(log, write=True) as f:  # created
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        f.write(b"a\n")
    with open_regular(log) as f:
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        assert f.read() == b"a\n"
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "absent")
    with pytest.raises(Fp8opsError, match="not a regular file"):
        open_regular(tmp_path)  # a directory


# -- a full disk ---------------------------------------------------------------------------------


def _raised(make):
    try:
        make()
    except BaseException as exc:  # noqa: BLE001 - the test looks at what was raised
        return exc
    raise AssertionError("nothing raised")


def _chained(outer: Exception, inner: BaseException, *, cause: bool = False):
    def make():
        try:
            raise inner
        except BaseException as exc:
            if cause:
                raise outer from exc
            raise outer  # noqa: B904 - while handling: its context, as a failing cleanup

    return _raised(make)


FULL = OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_storage_error_is_found_wherever_it_hides_in_the_chain(code):
    error = OSError(code, os.strerror(code))
    assert storage_error(error) is error
    # Raised from, or while handling it (a status write failing after the save did).
    assert storage_error(_chained(RuntimeError("save failed"), error, cause=True)) is error
    assert storage_error(_chained(OSError(errno.ENOSPC, "again"), error)) is error  # the first
    # Collected from a worker, as torch's CheckpointException holds (exception, stack) by rank.
    collected = RuntimeError("CheckpointException ranks:dict_keys([0])")
    collected.failures = {0: (error, "stack")}
    assert storage_error(collected) is error


def test_what_is_not_a_full_disk_is_not_taken_for_one():
    assert storage_error(OSError(errno.EACCES, "Permission denied")) is None
    assert storage_error(RuntimeError("unexpected pos 704 vs 598")) is None
    # A context suppressed (raise ... from None) was already said by the error itself.
    hidden = _raised(lambda: _suppressed(FULL))
    assert storage_error(hidden) is None


def _suppressed(inner):
    try:
        raise inner
    except OSError:
        raise ValueError("said already") from None


def test_a_full_file_system_is_recognised_by_its_free_space(tmp_path, monkeypatch):
    """For an error that does not say (torch's zip writer: "unexpected pos"), the file system
    under the run: under 64 MiB or 1% of it free, less than the failed write takes, no inode
    left, or read-only."""

    def statvfs(free_blocks, *, files=1000, free_files=500, flag=0, blocks=10**7):
        found = SimpleNamespace(
            f_bavail=free_blocks,
            f_frsize=4096,
            f_blocks=blocks,
            f_files=files,
            f_favail=free_files,
            f_flag=flag,
        )
        monkeypatch.setattr(os, "statvfs", lambda path: found)

    statvfs(10**6)  # 3.8 GiB free of 38
    assert disk_full(tmp_path / "run" / "not-yet") is None
    statvfs(100)
    assert disk_full(tmp_path) == "no space left on the device (0.4 MiB free)"
    statvfs(10**6, free_files=0)
    assert disk_full(tmp_path).startswith("no space left")
    statvfs(10**6, flag=os.ST_RDONLY)
    assert disk_full(tmp_path) == "the file system is read-only"
    statvfs(3000, blocks=5000)  # 12 MiB free of a 20 MiB disk: room
    assert disk_full(tmp_path) is None
    # Unless the write that failed takes more (a checkpoint's size, while its save was cut).
    assert disk_full(tmp_path, need=20 * 2**20) == (
        "no space left on the device (11.7 MiB free, less than the 20.0 MiB the write takes)"
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_disk_is_said_once_under_several_ranks(cli, monkeypatch, rank):
    """Every rank that met the full disk printed its own message; rank 0 says it."""
    from fp8ops.manifest import cli as manifest_cli

    def full(*args, **kwargs):
        raise StorageFull("/run/checkpoints: no space left on the device")

    monkeypatch.setattr(manifest_cli, "load_manifest", full)
    monkeypatch.setenv("RANK", str(rank))
    result = cli("manifest", "validate", "any.yaml")
    said = "/run/checkpoints: no space left on the device" if rank == 0 else ""
    assert (result.code, result.err.strip()) == (StorageFull.exit_code, said)


def test_a_full_disk_met_outside_a_run_is_said_without_a_traceback(cli, monkeypatch):
    from fp8ops.manifest import cli as manifest_cli

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # no path, as a write says it

    monkeypatch.setattr(manifest_cli, "load_manifest", full)
    result = cli("manifest", "validate", "any.yaml")
    assert (result.code, result.err.strip()) == (StorageFull.exit_code, "No space left on device")
