"""The telemetry store: one Zarr v3 group per run, written by every rank while it trains.

Layout of ``RUN_DIR/telemetry.zarr`` (numbers behind every choice: ``docs/telemetry.md``)::

    zarr.json                 root attributes: schema version, catalogue, module and metric
                              lists, first step, the caller's attrs. Written once, by rank 0.
    rank_00000/zarr.json      this rank's marker: committed_steps, history_steps, written_from
    rank_00000/module_metrics   [steps, modules, metrics] float32, chunks (256 steps, 64 modules)
    rank_00000/module_history   the same values, module-major: shards of 2048 steps holding one
                                inner chunk per module; only whole shards, so it lags behind
    rank_00000/step_metrics     [steps, step_metrics] float32
    rank_00001/...            the same for every other rank

Why two copies of the module metrics: a chunk is the unit zarr reads, and zarr spends about
0.3 ms per chunk before any data is decoded. A step-major chunk serves "all modules at one
step" and "one metric over a window" in a few chunks, but a module's full history would read
every chunk of the run; a module-major chunk is the opposite. Writing both costs a second
compression per step (in the background) and twice the disk, and keeps all three reads well
within their goals at 100k steps x 256 modules x 52 metrics while every step becomes readable
within one block. Of the single layouts we measured, step-major ones read a history in
0.4-2 s; module-major ones must be sharded (or make thousands of files), take 80-85 ms for a
snapshot, and can only be written in whole shards (point 3 below): thousands of steps that
readers would not see.

The commit protocol, safe with readers in other processes. It has to be this one: zarr's
``Array.append`` grows an array's shape before it writes the rows, so a reader that reads up to
the shape sees fill values for a step still being written, and two processes that resize or
write one chunk lose each other's rows (a read-modify-write race):

1. Each rank writes only its own group, so no two processes ever write one chunk, resize one
   array or rewrite one ``zarr.json``. Rank 0 creates the root; other ranks wait for it and
   then create their own subgroup, which zarr does without touching the root's metadata.
2. A flush grows the arrays, writes the data, and only then publishes ``committed_steps`` in the
   rank group's attributes. LocalStore writes every file atomically (temporary file, then
   rename), so a reader sees the old marker or the new one, and either way data for it.
3. Files a reader may read are replaced only whole: ``module_metrics`` and ``step_metrics``
   chunks are unsharded (a reader reads each in one go), and a ``module_history`` shard is
   written once, complete. (A sharded read fetches the shard's index and then byte ranges in
   separate reads; rewriting a shard under a reader could pair an old index with new bytes.)
4. Readers re-read the marker before opening arrays and never read past it.

The training step never waits on disk: :meth:`TelemetryWriter.append` copies one row into an
in-memory block; a background thread writes each full block (``flush_every`` steps) and then
publishes the marker. Only if the writer falls more than ``MAX_PENDING_BLOCKS`` blocks behind
does ``append`` wait for it (bounded memory beats an unbounded queue on a slow filesystem).
"""

from __future__ import annotations

import atexit
import json
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.codecs import TransposeCodec, ZstdCodec

from fp8ops.errors import Fp8opsError
from fp8ops.run.layout import TELEMETRY
from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, describe

if TYPE_CHECKING:
    from typing_extensions import Self

SCHEMA_VERSION = 1
STORE_NAME = TELEMETRY  # the store's name in a run directory (fp8ops.run.layout spells it)
ROOT_KEY = "fp8ops_telemetry"  # the root attribute holding the schema

# Array names inside a rank group, and the marker keys in its attributes.
MODULE_METRICS = "module_metrics"
MODULE_HISTORY = "module_history"
STEP_METRICS = "step_metrics"
COMMITTED = "committed_steps"  # steps written to module_metrics and step_metrics
HISTORY = "history_steps"  # steps written to module_history (whole shards only)
WRITTEN_FROM = "written_from"  # rows before it were never written: a rank that joined mid-run

FLUSH_EVERY = 256  # steps per block: the freshness of what readers see, and a chunk's length
STEPS_PER_SHARD = 2048  # module_history's shard length: 2048 x 256 x 52 x 4 B = 109 MB in memory
MODULES_PER_CHUNK = 64  # module_metrics chunks split modules, so a history's tail reads 1/4
MAX_PENDING_BLOCKS = 4  # blocks queued for the writer before append waits (10 MB each above)
RANK_WAIT_S = 120.0  # how long a rank > 0 waits for rank 0 to create the store


class TelemetryError(Fp8opsError):
    """The telemetry store is missing, damaged, misused, or its writer failed."""


def rank_group(rank: int) -> str:
    return f"rank_{rank:05d}"


# ----------------------------------------------------------------------------------------
# The schema: what the root attributes promise about every rank's arrays
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSchema:
    """What a store holds: the row and column labels, step numbering and the catalogue."""

    modules: tuple[str, ...]
    module_metrics: tuple[str, ...]
    step_metrics: tuple[str, ...]
    first_step: int = 1
    catalogue: dict = field(default_factory=describe, compare=False)
    run_attrs: dict = field(default_factory=dict, compare=False)  # the caller's (manifest hash…)

    def __post_init__(self) -> None:
        for what, names in (
            ("modules", self.modules),
            ("module_metrics", self.module_metrics),
            ("step_metrics", self.step_metrics),
        ):
            if not names:
                raise ValueError(f"telemetry needs at least one name in {what}")
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"telemetry {what} must be unique; repeated: {twice}")
        if self.first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {self.first_step}")

    def to_attrs(self) -> dict[str, Any]:
        return {
            ROOT_KEY: {
                "schema_version": SCHEMA_VERSION,
                "first_step": self.first_step,
                "modules": list(self.modules),
                "module_metrics": list(self.module_metrics),
                "step_metrics": list(self.step_metrics),
                "catalogue": self.catalogue,
            },
            "run": self.run_attrs,
        }

    @classmethod
    def from_attrs(cls, attrs: dict, path: Path) -> StoreSchema:
        schema = attrs.get(ROOT_KEY)
        if not isinstance(schema, dict):
            raise TelemetryError(
                f"{path} is a Zarr group but not an fp8ops telemetry store "
                f"(no '{ROOT_KEY}' in its zarr.json attributes)"
            )
        version = schema.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TelemetryError(
                f"{path} has telemetry schema version {version!r}; this fp8ops reads version "
                f"{SCHEMA_VERSION}. Read it with the fp8ops version that wrote the run."
            )
        try:
            return cls(
                modules=tuple(schema["modules"]),
                module_metrics=tuple(schema["module_metrics"]),
                step_metrics=tuple(schema["step_metrics"]),
                first_step=int(schema["first_step"]),
                catalogue=schema["catalogue"],
                run_attrs=attrs.get("run", {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TelemetryError(f"{path}/zarr.json: damaged telemetry schema ({e!r})") from e


def read_schema(path: str | Path) -> tuple[zarr.Group, StoreSchema]:
    """Open the store's root read-only and check its schema; TelemetryError if it can't."""
    path = Path(path)
    if not (path / "zarr.json").is_file():
        raise TelemetryError(
            f"no telemetry store at {path} (no zarr.json there): was the run started with "
            f"telemetry, and is this its run directory?"
        )
    try:
        root = zarr.open_group(path, mode="r", zarr_format=3, use_consolidated=False)
        attrs = root.attrs.asdict()
    except Exception as e:  # zarr raises JSON, key and value errors for a damaged zarr.json
        raise TelemetryError(
            f"{path}/zarr.json cannot be read as a Zarr v3 group ({type(e).__name__}: {e}); "
            f"the store is damaged"
        ) from e
    return root, StoreSchema.from_attrs(attrs, path)


def _create_arrays(
    group: zarr.Group, schema: StoreSchema, flush_every: int, steps_per_shard: int
) -> None:
    """A rank's three arrays, empty (0 steps); they grow as steps are committed."""
    n_mod, n_met = len(schema.modules), len(schema.module_metrics)
    common = {"dtype": "float32", "fill_value": np.nan, "compressors": ZstdCodec(level=0)}
    # Inside a chunk, metric-major order (transpose): a metric's run of steps is contiguous,
    # so constant columns (GEMM counts, flags, zero NaN counts) compress to almost nothing.
    # Measured on 100k steps: 6-8% smaller and 1.8x faster to write (docs/telemetry.md).
    group.create_array(
        MODULE_METRICS,
        shape=(0, n_mod, n_met),
        chunks=(flush_every, min(MODULES_PER_CHUNK, n_mod), n_met),
        filters=TransposeCodec(order=(2, 1, 0)),
        dimension_names=("step", "module", "metric"),
        **common,
    )
    group.create_array(
        MODULE_HISTORY,
        shape=(0, n_mod, n_met),
        shards=(steps_per_shard, n_mod, n_met),
        chunks=(steps_per_shard, 1, n_met),
        filters=TransposeCodec(order=(2, 1, 0)),
        dimension_names=("step", "module", "metric"),
        **common,
    )
    group.create_array(
        STEP_METRICS,
        shape=(0, len(schema.step_metrics)),
        chunks=(steps_per_shard, len(schema.step_metrics)),  # tiny: one file per shard's steps
        filters=TransposeCodec(order=(1, 0)),
        dimension_names=("step", "step_metric"),
        **common,
    )


# ----------------------------------------------------------------------------------------
# The writer
# ----------------------------------------------------------------------------------------


@dataclass
class WriterStats:
    """What telemetry cost so far: the background thread's time and the caller's waits."""

    blocks: int = 0  # flushes written (full blocks and tails)
    steps: int = 0  # steps committed by this writer
    write_seconds: float = 0.0  # background thread: zarr writes and marker updates
    blocked_seconds: float = 0.0  # caller: waiting in append because the writer was behind

    @property
    def write_ms_per_step(self) -> float:
        return 1e3 * self.write_seconds / max(self.steps, 1)


@dataclass
class _Flush:
    """Rows [start, stop) of the store (0-based indices), handed to the background thread."""

    start: int
    stop: int
    module_rows: np.ndarray  # [stop - start, modules, metrics]
    step_rows: np.ndarray  # [stop - start, step_metrics]


class TelemetryWriter:
    """Appends one rank's telemetry, one step at a time, without making the step wait.

    ::

        with TelemetryWriter(run_dir / STORE_NAME, rank=rank, modules=names) as writer:
            for step in range(1, steps + 1):
                ...
                writer.append(step, module_values, step_values)

    Rank 0 must be constructed first or concurrently: it creates the store, and other ranks
    wait up to ``wait_s`` for it. After a crash, :meth:`resume` reopens a rank's arrays at its
    last committed step.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        rank: int,
        modules: Sequence[str],
        module_metrics: Sequence[str] = MODULE_METRIC_NAMES,
        step_metrics: Sequence[str] = STEP_METRIC_NAMES,
        first_step: int = 1,
        flush_every: int = FLUSH_EVERY,
        steps_per_shard: int = STEPS_PER_SHARD,
        attrs: dict | None = None,
        wait_s: float = RANK_WAIT_S,
        catalogue: dict | None = None,
    ):
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if flush_every < 1 or steps_per_shard % flush_every:
            raise ValueError(
                f"flush_every ({flush_every}) must be >= 1 and divide steps_per_shard "
                f"({steps_per_shard}): a module_history shard is built from whole blocks"
            )
        path = Path(path)
        schema = StoreSchema(
            modules=tuple(modules),
            module_metrics=tuple(module_metrics),
            step_metrics=tuple(step_metrics),
            first_step=first_step,
            # The units and meanings of the columns: the catalogue's, unless the columns are
            # not all the catalogue's (an imported run's, fp8ops.te_import).
            catalogue=describe() if catalogue is None else json.loads(json.dumps(catalogue)),
            run_attrs=json.loads(json.dumps(attrs or {})),  # JSON-able now, not at a flush
        )
        if rank == 0:
            root = _create_root(path, schema)
        else:
            root = _wait_for_root(path, schema, wait_s)
        name = rank_group(rank)
        if name in root:
            raise TelemetryError(
                f"{path}/{name} already exists: to continue this rank's telemetry use "
                f"TelemetryWriter.resume({str(path)!r}, rank={rank})"
            )
        group = root.create_group(name)
        _create_arrays(group, schema, flush_every, steps_per_shard)
        # The marker last: a reader lists a rank only once its arrays exist.
        group.update_attributes({COMMITTED: 0, HISTORY: 0, WRITTEN_FROM: 0, "rank": rank})
        self._start(path, rank, schema, group, committed=0, history=0)

    @classmethod
    def resume(
        cls, path: str | Path, *, rank: int, next_step: int | None = None
    ) -> TelemetryWriter:
        """Reopen ``rank``'s arrays to append from ``next_step`` (default: after the last commit).

        Whatever lies beyond the last commit (a flush torn by a crash) is dropped; so are
        committed steps from ``next_step`` on, when a run resumes from an earlier checkpoint.
        """
        path = Path(path)
        _, schema = read_schema(path)
        name = rank_group(rank)
        try:
            group = zarr.open_group(path / name, mode="r+", zarr_format=3, use_consolidated=False)
            committed, history = int(group.attrs[COMMITTED]), int(group.attrs[HISTORY])
            arrays = [group[a] for a in (MODULE_METRICS, MODULE_HISTORY, STEP_METRICS)]
        except Exception as e:
            raise TelemetryError(
                f"cannot resume rank {rank} of {path}: {path / name} is missing or damaged "
                f"({type(e).__name__}: {e})"
            ) from e
        if next_step is not None:
            keep = next_step - schema.first_step
            if not 0 <= keep <= committed:
                raise TelemetryError(
                    f"cannot resume rank {rank} of {path} at step {next_step}: its committed "
                    f"steps are {schema.first_step}..{schema.first_step + committed - 1}, so "
                    f"the next step can be at most {schema.first_step + committed}"
                )
            shard = arrays[1].shards[0]
            committed, history = keep, min(history, keep // shard * shard)
            marker = {COMMITTED: committed, HISTORY: history}
            if WRITTEN_FROM in group.attrs:  # rows from ``keep`` on are written again
                marker[WRITTEN_FROM] = min(int(group.attrs[WRITTEN_FROM]), keep)
            # Withdraw the dropped steps from readers before their data goes away.
            group.update_attributes(marker)
        # Shrinking deletes whole chunks beyond the commit; a torn partial chunk stays, past the
        # shape and the marker, and is overwritten row by row before its steps are committed.
        for array, rows in zip(arrays, (committed, history, committed), strict=True):
            if array.shape[0] != rows:
                array.resize((rows, *array.shape[1:]))
        writer = cls.__new__(cls)  # __init__ creates; resume attaches to what exists
        writer._start(path, rank, schema, group, committed=committed, history=history)
        return writer

    # -- the caller's side ---------------------------------------------------------------

    @classmethod
    def join(
        cls,
        path: str | Path,
        *,
        rank: int,
        next_step: int,
        flush_every: int = FLUSH_EVERY,
        steps_per_shard: int = STEPS_PER_SHARD,
    ) -> TelemetryWriter:
        """A rank joining a store mid-run (a resume at a larger world size): its arrays start
        at the store's first step with the steps before ``next_step`` empty (NaN, never
        written: Zarr's fill value), then it appends from ``next_step`` on."""
        path = Path(path)
        _, schema = read_schema(path)
        root = zarr.open_group(path, mode="r+", zarr_format=3, use_consolidated=False)
        group = root.create_group(rank_group(rank))
        _create_arrays(group, schema, flush_every, steps_per_shard)
        rows = next_step - schema.first_step
        for name in (MODULE_METRICS, MODULE_HISTORY, STEP_METRICS):
            group[name].resize((rows, *group[name].shape[1:]))
        history = rows // steps_per_shard * steps_per_shard
        group.update_attributes(
            {COMMITTED: rows, HISTORY: history, WRITTEN_FROM: rows, "rank": rank}
        )
        return cls.resume(path, rank=rank)

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, step: int, module_values: np.ndarray, step_values: np.ndarray) -> None:
        """Record ``step``: ``module_values`` [modules, metrics], ``step_values`` [step_metrics].

        Copies the values (the caller may reuse its arrays) and returns; the background thread
        writes them. Waits only while the writer is ``MAX_PENDING_BLOCKS`` blocks behind.
        """
        self._check_usable()
        if step != self._schema.first_step + self._filled:
            raise ValueError(
                f"telemetry steps must be consecutive: expected step "
                f"{self._schema.first_step + self._filled}, got {step}"
            )
        if np.shape(module_values) != self._module_buf.shape[1:]:
            raise ValueError(
                f"module_values must have shape {self._module_buf.shape[1:]} "
                f"(modules, metrics), got {np.shape(module_values)}"
            )
        if np.shape(step_values) != self._step_buf.shape[1:]:
            raise ValueError(
                f"step_values must have shape {self._step_buf.shape[1:]}, got "
                f"{np.shape(step_values)}"
            )
        row = self._filled - self._block_start
        self._module_buf[row] = module_values
        self._step_buf[row] = step_values
        self._filled += 1
        if row + 1 == self._flush_every:
            self._submit()
            self._new_block()

    def flush(self) -> None:
        """Write and commit every appended step; returns when readers can see them."""
        self._check_usable()
        self._submit()
        self._queue.join()
        self._check_usable()

    def close(self) -> None:
        """Flush, then stop the background thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._error is None:
            self._submit()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            raise self._failure()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body's exception is the one to see; keep ours as a note on it
            self.close()
        except TelemetryError as ours:
            if hasattr(exc, "add_note"):
                exc.add_note(f"also: {ours}")

    @property
    def committed_steps(self) -> int:
        """Steps readers can see (published by the background thread)."""
        return self._committed

    @property
    def next_step(self) -> int:
        return self._schema.first_step + self._filled

    # -- set-up --------------------------------------------------------------------------

    @property
    def schema(self) -> StoreSchema:
        """What the store holds (a resumed store's own, which may predate this catalogue)."""
        return self._schema

    def _start(
        self,
        path: Path,
        rank: int,
        schema: StoreSchema,
        group: zarr.Group,
        *,
        committed: int,
        history: int,
    ) -> None:
        self.path, self.rank, self._schema, self._group = path, rank, schema, group
        # Every chunk written, even one that is all NaN (zarr leaves those out by default, and
        # the setting is not stored with the array): a reader takes a missing file for damage.
        self._module_metrics, self._module_history, self._step_metrics = (
            group[name].with_config({"write_empty_chunks": True})
            for name in (MODULE_METRICS, MODULE_HISTORY, STEP_METRICS)
        )
        self._flush_every = self._module_metrics.chunks[0]
        self._steps_per_shard = self._module_history.shards[0]
        self.stats = WriterStats()

        # Caller side: rows [_block_start, _filled) are in the current block buffer, rows
        # before _sent were handed to the thread. Blocks are aligned to flush_every, so a
        # routine flush writes whole chunks.
        self._filled = self._sent = committed
        self._new_block()

        # Thread side: the shard being assembled for module_history, refilled after a resume.
        self._committed, self._history = committed, history
        self._shard_buf: np.ndarray | None = None
        if committed > history:
            self._shard_rows()[: committed - history] = self._module_metrics[history:committed]

        self._queue: queue.Queue[_Flush | None] = queue.Queue(maxsize=MAX_PENDING_BLOCKS)
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._drain, name=f"telemetry-writer-{rank_group(rank)}", daemon=True
        )
        self._thread.start()
        # A daemon thread dies with the interpreter; flush what was appended before that.
        atexit.register(self.close)

    def _new_block(self) -> None:
        self._block_start = self._filled // self._flush_every * self._flush_every
        n_mod, n_met = len(self._schema.modules), len(self._schema.module_metrics)
        # np.empty, not a NaN fill: only appended rows are ever handed on, and filling 10 MB
        # (256 modules) would cost one step a few milliseconds.
        self._module_buf = np.empty((self._flush_every, n_mod, n_met), np.float32)
        self._step_buf = np.empty((self._flush_every, len(self._schema.step_metrics)), np.float32)

    def _submit(self) -> None:
        """Hand rows [_sent, _filled) to the thread; the caller never writes those rows again."""
        if self._filled == self._sent:
            return
        lo, hi = self._sent - self._block_start, self._filled - self._block_start
        item = _Flush(self._sent, self._filled, self._module_buf[lo:hi], self._step_buf[lo:hi])
        started = time.perf_counter()
        self._queue.put(item)  # blocks only while MAX_PENDING_BLOCKS are waiting
        self.stats.blocked_seconds += time.perf_counter() - started
        self._sent = self._filled

    def _check_usable(self) -> None:
        if self._error is not None:
            self._error_reported = True
            raise self._failure()
        if self._closed:
            raise TelemetryError(f"the telemetry writer for rank {self.rank} is closed")

    def _failure(self) -> TelemetryError:
        error = TelemetryError(
            f"the telemetry writer for rank {self.rank} of {self.path} failed: "
            f"{type(self._error).__name__}: {self._error}. Steps up to "
            f"{self._schema.first_step + self._committed - 1} are committed; later ones are lost."
        )
        error.__cause__ = self._error
        return error

    # -- the background thread -----------------------------------------------------------

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure, drop blocks so callers never hang
                    started = time.perf_counter()
                    self._write(item)
                    self.stats.write_seconds += time.perf_counter() - started
            except BaseException as e:  # noqa: BLE001 - surfaced by the caller's next call
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, item: _Flush) -> None:
        """Data first, marker last (the commit protocol in the module docstring)."""
        start, stop = item.start, item.stop
        for array, rows in (
            (self._module_metrics, item.module_rows),
            (self._step_metrics, item.step_rows),
        ):
            if array.shape[0] < stop:
                array.resize((stop, *array.shape[1:]))
            array[start:stop] = rows

        # module_history receives a shard only when all its steps have arrived.
        shard_start = self._history
        self._shard_rows()[start - shard_start : stop - shard_start] = item.module_rows
        if stop - shard_start == self._steps_per_shard:
            self._module_history.resize((stop, *self._module_history.shape[1:]))
            self._module_history[shard_start:stop] = self._shard_buf
            self._history = stop

        self._group.update_attributes({COMMITTED: stop, HISTORY: self._history})
        self._committed = stop
        self.stats.blocks += 1
        self.stats.steps += stop - start

    def _shard_rows(self) -> np.ndarray:
        if self._shard_buf is None:
            self._shard_buf = np.empty(
                (self._steps_per_shard, *self._module_history.shape[1:]), np.float32
            )  # every row is filled (blocks are consecutive) before the shard is written
        return self._shard_buf


def _create_root(path: Path, schema: StoreSchema) -> zarr.Group:
    """Rank 0: the root group and its attributes, in one atomic write of zarr.json."""
    if path.exists():
        raise TelemetryError(
            f"{path} already exists: telemetry is written once per run directory; use "
            f"TelemetryWriter.resume to continue it"
        )
    return zarr.create_group(path, attributes=schema.to_attrs(), zarr_format=3)


def _wait_for_root(path: Path, schema: StoreSchema, wait_s: float) -> zarr.Group:
    """Ranks > 0: wait for rank 0's root, then check we describe the same modules and metrics.

    Creating our subgroup before the root exists would make zarr write an attribute-less root
    (it creates missing parents), which rank 0's exclusive create would then refuse.
    """
    deadline = time.monotonic() + wait_s
    while not (path / "zarr.json").is_file():
        if time.monotonic() > deadline:
            raise TelemetryError(
                f"{path} was not created by rank 0 within {wait_s:g} s: construct rank 0's "
                f"TelemetryWriter first (or concurrently)"
            )
        time.sleep(0.05)
    root, stored = read_schema(path)
    if stored != schema:  # modules, metric lists and first step, in order
        raise TelemetryError(
            f"{path} was created by rank 0 for other modules, metrics or first step than this "
            f"rank's: every rank must describe the same rows and columns"
        )
    del root  # read-only; creating our subgroup needs a writable handle
    return zarr.open_group(path, mode="r+", zarr_format=3, use_consolidated=False)


__all__ = [
    "FLUSH_EVERY",
    "SCHEMA_VERSION",
    "STEPS_PER_SHARD",
    "STORE_NAME",
    "StoreSchema",
    "TelemetryError",
    "TelemetryWriter",
    "WriterStats",
    "rank_group",
    "read_schema",
]
