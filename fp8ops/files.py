"""Files that survive crashes: whole files replaced atomically, logs read up to a torn last line,
and JSON lines that strict readers (jq, JavaScript) accept."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from fp8ops.errors import Fp8opsError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file in the same directory.

    Readers (and a crash) see the old content or the new, never a mix: the new bytes are
    flushed to disk before the rename, and the rename before returning.
    """
    path = Path(path)
    for folder in (path.parent, *path.parent.parents):
        if folder.exists() and not folder.is_dir():
            raise Fp8opsError(f"{path}: {folder} is a file, not a directory; choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; run records are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


# Free space below which a file system counts as full (or below 1% of it, on a small one): a
# write that failed for space leaves about nothing free (the writer filled the disk).
FULL_BELOW_BYTES = 64 * 2**20


def disk_full(path: str | Path, need: int = 0) -> str | None:
    """Why the file system holding ``path`` refuses writes (full, no inodes left, read-only,
    or less free than the ``need`` bytes a write of the kind that failed takes), as a message
    says it; None when it has room. For a failure that does not say (torch's zip writer
    reports a short write as "unexpected pos"), rather than its errno."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        found = os.statvfs(path)
    except OSError:
        return None
    if found.f_flag & os.ST_RDONLY:
        return "the file system is read-only"
    free, size = found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize
    if free < need:
        return (
            f"no space left on the device ({free / 2**20:.1f} MiB free, less than the "
            f"{need / 2**20:.1f} MiB the write takes)"
        )
    if free < min(FULL_BELOW_BYTES, size // 100) or (found.f_files and found.f_favail == 0):
        return f"no space left on the device ({free / 2**20:.1f} MiB free)"
    return None


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding ``path`` (for "free space on ...")."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def append_lines(path: str | Path, text: str) -> None:
    """Append ``text`` (whole lines) to a log in one write, first cutting off a torn last line.

    A crash or a full disk can leave the log ending mid-record. That record was never
    completed, and :func:`read_jsonl` already skips it; but appended after, it would sit
    mid-file, where it is damage, and every later read of the log would refuse. (A last line
    that is whole JSON, only its newline lost, is a record :func:`read_jsonl` returns: kept.)
    """
    with open_log(path) as log:
        end = log.seek(0, os.SEEK_END)
        if end:
            log.seek(end - 1)
            if log.read(1) != b"\n":
                start = _after_last_newline(log, end)
                log.seek(start)
                if _is_json(log.read(end - start)):
                    text = "\n" + text  # a whole record that lost only its newline: kept
                else:
                    log.truncate(start)
        log.write(text.encode("utf-8"))


def open_log(path: str | Path) -> BinaryIO:
    """``path`` opened to read and append (created if absent), as a regular file only
    (:func:`open_regular`): appending cuts a torn-looking last line first, and through a link
    would cut and write a file outside the run, of whoever runs fp8ops."""
    return open_regular(path, write=True)


def open_regular(path: str | Path, *, write: bool = False) -> BinaryIO:
    """``path`` opened to read (``write``: to read and append, created if absent) only if it
    is a regular file. A run's files replaced by a symbolic link (to another run's file, or to
    one of whoever runs fp8ops) are refused, never followed; and a FIFO or a device, which an
    ordinary ``open`` waits on forever (a FIFO until someone writes it), is refused at once:
    opened without blocking, checked with ``fstat``, and only then made a blocking file."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT if write else os.O_RDONLY
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise Fp8opsError(
            f"{path}: is a symbolic link; fp8ops reads and writes a run's files only as regular "
            "files in the run directory, never through a link: replace the link with the file "
            "it should be"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Fp8opsError(
                f"{path}: not a regular file (a FIFO, a device or a directory); replace it with "
                "the file it should be"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab+" if write else "rb")  # writes go to the end


def _is_json(data: bytes) -> bool:
    try:
        loads_json(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        return False
    return True


def _after_last_newline(log, end: int) -> int:
    block = 1 << 16
    position = end
    while position > 0:
        start = max(0, position - block)
        log.seek(start)
        found = log.read(position - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        position = start
    return 0


def loads_json(text: str | bytes, **kwargs: Any) -> Any:
    """``json.loads`` for what a file holds. Nesting deeper than Python's recursion limit raises
    RecursionError, which handlers of JSONDecodeError miss, so a file anyone can write would end
    a reader in a traceback; here it is a ``ValueError`` (JSONDecodeError's base class), as all
    other unreadable JSON is, for the caller to name the file."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


# The key of a JSON line that names its non-finite numbers: JSON Pointer -> "nan", "inf", "-inf".
NONFINITE = "nonfinite"


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON. JSON has no NaN or infinity, and Python's writer
    would put bare ``NaN`` there, which strict readers refuse: each such number is written as
    ``null`` and named under ``"nonfinite"`` with what it was (``{"loss": null, "nonfinite":
    {"/loss": "nan"}}``); :func:`read_jsonl` puts it back."""
    found: dict[str, str] = {}

    def strict(value: Any, pointer: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[pointer] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if isinstance(value, dict):
            return {k: strict(v, f"{pointer}/{_escape(str(k))}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [strict(v, f"{pointer}/{i}") for i, v in enumerate(value)]
        return value

    out = strict(record, "")
    if found:
        out[NONFINITE] = found
    return json.dumps(out, sort_keys=True, allow_nan=False) + "\n"


def _escape(key: str) -> str:  # RFC 6901
    return key.replace("~", "~0").replace("/", "~1")


def _restore_nonfinite(record: dict[str, Any]) -> dict[str, Any]:
    """:func:`json_line`'s nulls back to the numbers they were (a record without the key, or
    from a writer before it, as it is)."""
    found = record.get(NONFINITE) if isinstance(record, dict) else None
    if not isinstance(found, dict):
        return record
    record = {k: v for k, v in record.items() if k != NONFINITE}
    for pointer, what in found.items():
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        holder: Any = record
        for part in parents:
            holder = holder[int(part)] if isinstance(holder, list) else holder[part]
        if isinstance(holder, list):
            holder[int(last)] = float(what)
        else:
            holder[last] = float(what)
    return record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of an append-only log; a torn last line (a crash mid-write) is skipped, and
    the non-finite numbers :func:`json_line` wrote as ``null`` are numbers again. A log that is
    not a regular file (a link, a FIFO) is refused (:func:`open_regular`)."""
    records = []
    try:
        with open_regular(path) as log:  # never through a link, never waiting on a FIFO
            lines = log.read().decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise Fp8opsError(f"{path}: not text (not UTF-8); the file is damaged") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = loads_json(line)
        except ValueError as exc:
            if number < len(lines):  # only the final, unterminated line may be torn
                raise Fp8opsError(
                    f"{path}:{number}: not valid JSON ({exc}); the file is damaged"
                ) from None
            continue
        try:
            records.append(_restore_nonfinite(record))
        except (LookupError, TypeError, ValueError, AttributeError):
            raise Fp8opsError(
                f"{path}:{number}: its {NONFINITE!r} entry names a value the record does not "
                "hold; the file is damaged"
            ) from None
    return records


def latest_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per ``step``, in step order: a step logged again after a resume from an
    earlier checkpoint keeps its latest line."""
    by_step = {record["step"]: record for record in records}
    return [by_step[step] for step in sorted(by_step)]
