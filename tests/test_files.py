"""fp8ops.files: logs that survive a torn last line, and the CLI's answer to paths that fail."""

from __future__ import annotations

import json

import pytest

from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, read_jsonl
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
