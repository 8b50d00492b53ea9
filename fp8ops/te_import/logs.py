"""Reading nvdlfw_inspect's statistics logs: which files, and each line's name, iteration and value.

nvdlfw_inspect's default statistics logger (``FileLogger.log_scalar`` in
``nvdlfw_inspect/logging.py``) writes one file per global rank,
``LOG_DIR/nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-<rank>.log`` (with
``_<timestamp>`` before ``_globalrank`` under ``NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP``), one line
per value (folded here)::

    2026-03-02 10:15:02,118 - INFO - model.decoder.layers.1.mlp.linear_fc1_activation_cur_amax
        \\t\\t\\t\\t iteration=000002 \\t\\t\\t\\t value=4.3188

(``%(asctime)s - %(levelname)s - %(message)s``; the message ``{name} iteration={:06d}
value={:.4f}``, so every value has four decimals). A rank's lines come in iteration order: each
``debug_api.step()`` logs the iteration just finished.

What is read is checked as it is read, and every problem names the file and line: a line that is
not such a line is an error, and so are iterations going backwards (two runs appended to one
file) and a value logged twice for one iteration; a last line without its newline (a crash
mid-write) is skipped with a warning, even if it parses, since its value may be cut short.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp8ops.errors import Fp8opsError

STATISTICS_DIR = "nvdlfw_inspect_statistics_logs"
_RANK_FILE = re.compile(r"nvdlfw_inspect(?:_.+)?_globalrank-(\d+)\.log")
_SHOWN = 160  # characters of a bad line quoted in an error


class TeLogError(Fp8opsError):
    """A Transformer Engine debug log cannot be imported as it is."""


def find_rank_files(log_dir: Path) -> dict[int, Path]:
    """Rank -> its statistics log, from the debug API's ``log_dir`` or its statistics folder."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        what = "not a directory" if log_dir.exists() else "no such directory"
        raise TeLogError(f"{log_dir}: {what}; give the log_dir of TE's debug API")
    folder = log_dir / STATISTICS_DIR if (log_dir / STATISTICS_DIR).is_dir() else log_dir
    found: dict[int, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        match = _RANK_FILE.fullmatch(path.name)
        if match and path.is_file():
            found.setdefault(int(match[1]), []).append(path)
    if not found:
        raise TeLogError(
            f"{folder}: no nvdlfw_inspect statistics logs (nvdlfw_inspect_globalrank-N.log); "
            f"give the log_dir passed to debug_api.initialize, which holds {STATISTICS_DIR}/"
        )
    twice = {rank: paths for rank, paths in found.items() if len(paths) > 1}
    if twice:
        rank, paths = next(iter(twice.items()))
        raise TeLogError(
            f"{folder}: rank {rank} has {len(paths)} logs ({', '.join(p.name for p in paths)}), "
            "from runs logged with timestamps; import one run at a time (move the others aside)"
        )
    return {rank: paths[0] for rank, paths in sorted(found.items())}


@dataclass
class RankLog:
    """One rank's statistics: parallel arrays, one entry per line read, in file order."""

    rank: int
    path: Path
    sha256: str  # of the bytes parsed
    size: int
    iterations: np.ndarray  # int64
    names: np.ndarray  # int32: the index of the line's name in the NameTable
    values: np.ndarray  # float64, as printed
    lines: np.ndarray  # int32: the line number (1-based), for messages
    skipped: int = 0  # lines left out, each with a warning
    first_time: str | None = None  # the first and last lines' timestamps, as written
    last_time: str | None = None

    @property
    def steps(self) -> np.ndarray:
        """The iterations this rank logged anything at, ascending and unique."""
        return np.unique(self.iterations)


@dataclass
class NameTable:
    """Every distinct ``<layer>_<tensor>_<stat>`` seen, numbered in order of first appearance
    (the ranks' files read in rank order), with where each first appeared."""

    names: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    first_seen: list[str] = field(default_factory=list)  # "file:line"

    def add(self, name: str, where: str) -> int:
        self.index[name] = len(self.names)
        self.names.append(name)
        self.first_seen.append(where)
        return self.index[name]


def read_rank_log(
    path: Path,
    rank: int,
    table: NameTable,
    warn: Callable[[str], None],
    usable: Callable[[str, str], bool],
) -> RankLog:
    """Parse ``path``. ``usable(name, where)`` decides once per new name whether its lines are
    kept (it warns about those that are not); ``warn`` takes every other warning."""
    iterations, ids, values, numbers = array("q"), array("i"), array("d"), array("i")
    index, dropped = table.index, set()
    previous, previous_line, skipped = -1, 0, 0
    first_time = last_time = None
    read = _Read(path)
    for number, line in read.lines():
        parts = line.rsplit(None, 2)
        if len(parts) != 3:
            if not line.strip():
                continue
            raise _malformed(path, number, line)
        head, iteration_field, value_field = parts
        if not iteration_field.startswith("iteration=") or not value_field.startswith("value="):
            raise _malformed(path, number, line)
        prefix = head.split(" - ", 2)  # asctime - levelname - name
        if len(prefix) == 3:
            name = prefix[2].strip()
            last_time = prefix[0]
            first_time = first_time or last_time
        elif len(prefix) == 1:  # a logger without the default format's prefix
            name = head.strip()
        else:
            raise _malformed(path, number, line)
        try:
            iteration = int(iteration_field[10:])
            value = float(value_field[6:])
        except ValueError:
            raise _malformed(path, number, line) from None
        if iteration < previous:
            raise TeLogError(
                f"{path}:{number}: iteration {iteration} after iteration {previous} "
                f"(line {previous_line}): the file holds more than one run (logs appended "
                "under NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0, or a restarted job); keep one "
                "run's lines per file"
            )
        previous, previous_line = iteration, number
        name_id = index.get(name)
        if name_id is None:
            if name in dropped:
                skipped += 1
                continue
            if not usable(name, f"{path}:{number}"):
                dropped.add(name)
                skipped += 1
                continue
            name_id = table.add(name, f"{path}:{number}")
        iterations.append(iteration)
        ids.append(name_id)
        values.append(value)
        numbers.append(number)
    if read.torn is not None:
        number, raw = read.torn
        skipped += 1
        warn(
            f"{path}:{number}: the last line has no newline (a crash mid-write?); skipped, "
            f"since its value may be cut short: {raw[:_SHOWN].decode(errors='replace')!r}"
        )
    log = RankLog(
        rank,
        path,
        read.digest.hexdigest(),
        read.size,
        np.frombuffer(iterations, np.int64) if iterations else np.zeros(0, np.int64),
        np.frombuffer(ids, np.int32) if ids else np.zeros(0, np.int32),
        np.frombuffer(values, np.float64) if values else np.zeros(0, np.float64),
        np.frombuffer(numbers, np.int32) if numbers else np.zeros(0, np.int32),
        skipped,
        first_time,
        last_time,
    )
    _refuse_repeats(log, table)
    return log


class _Read:
    """A log's complete lines, read in blocks (a long run's log is gigabytes; only its entries,
    24 bytes each, are kept), every byte hashed on the way; a last line without its newline is
    kept apart in ``torn``."""

    BLOCK = 1 << 24

    def __init__(self, path: Path):
        self.path, self.digest, self.size = path, hashlib.sha256(), 0
        self.torn: tuple[int, bytes] | None = None

    def lines(self) -> Iterator[tuple[int, str]]:
        number, rest = 0, b""
        with open(self.path, "rb") as file:
            while block := file.read(self.BLOCK):
                self.digest.update(block)
                self.size += len(block)
                data = rest + block
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                try:
                    text = data[:cut].decode("utf-8")
                except UnicodeDecodeError as exc:
                    where = number + data[: exc.start].count(b"\n") + 1
                    raise TeLogError(
                        f"{self.path}:{where}: not UTF-8 text; is this a statistics log?"
                    ) from None
                for line in text.split("\n")[:-1]:  # text ends with its last newline
                    number += 1
                    yield number, line
        if rest.strip():
            self.torn = (number + 1, rest)


def _refuse_repeats(log: RankLog, table: NameTable) -> None:
    """One value per name and iteration: a second one means two runs' lines in one file."""
    if len(log.names) == 0:
        return
    key = log.iterations * len(table.names) + log.names
    order = np.argsort(key, kind="stable")
    repeated = np.flatnonzero(key[order][1:] == key[order][:-1])
    if len(repeated):
        first, second = order[repeated[0]], order[repeated[0] + 1]
        raise TeLogError(
            f"{log.path}:{log.lines[second]}: {table.names[log.names[second]]} at iteration "
            f"{log.iterations[second]} was logged already at line {log.lines[first]}: the file "
            "holds more than one run's lines (NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0 appends); "
            "keep one run's lines per file"
        )


def _malformed(path: Path, number: int, line: str) -> TeLogError:
    return TeLogError(
        f"{path}:{number}: not a statistics line: {line[:_SHOWN]!r}; nvdlfw_inspect writes "
        "'<time> - <level> - <layer>_<tensor>_<stat> iteration=<n> value=<x>'. The file is "
        "damaged, or is not nvdlfw_inspect's statistics log"
    )
