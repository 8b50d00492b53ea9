"""Reading a run's telemetry, while it trains or after: ``open_run(run_dir)``.

::

    run = open_run("runs/2026-05-01-a")
    run.module_history("decoder.layers.3.mlp.linear_fc1", ["input.amax", "input.scale"])
    run.step_snapshot()               # all modules at the latest committed step
    run.metric_window("weight.saturation", start=run.last_step() - 999)
    run.refresh()                     # pick up what the writers committed since

Only committed steps are visible (``committed_steps`` per rank, see ``store.py``): a reader
never sees a step that is half written. Step ranges are half-open, in step numbers:
``start=None`` is the first step, ``stop=None`` one past the last committed step.

Each query reads the array whose chunks suit it: a module's history comes from
``module_history`` (one chunk per module per 2048 steps) plus, for the steps not yet in a
whole shard, ``module_metrics``; snapshots and windows come from ``module_metrics`` (one chunk
per 256 steps and 64 modules).
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import zarr

from fp8ops.telemetry.store import (
    COMMITTED,
    HISTORY,
    MODULE_HISTORY,
    MODULE_METRICS,
    STEP_METRICS,
    STORE_NAME,
    WRITTEN_FROM,
    StoreSchema,
    TelemetryError,
    rank_group,
    read_schema,
)

_RANK_GROUP = re.compile(r"rank_(\d{5})")


def open_run(run_dir: str | Path) -> TelemetryRun:
    """The telemetry of the run in ``run_dir`` (or of the ``telemetry.zarr`` store given)."""
    path = Path(run_dir)
    if path.name != STORE_NAME and not (path / "zarr.json").is_file():
        path = path / STORE_NAME
    return TelemetryRun(path)


@dataclass
class _Rank:
    """One rank's marker, and its arrays once a query needs them."""

    committed: int  # steps readable in module_metrics and step_metrics
    history: int  # steps readable in module_history
    written_from: int | None  # rows before it never written (joined mid-run); None: not known
    arrays: dict[str, zarr.Array] = field(default_factory=dict)


class TelemetryRun:
    """A run's telemetry store, read-only. All queries take ``rank`` (default 0)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _, self.schema = read_schema(self.path)
        self.modules: tuple[str, ...] = self.schema.modules
        self.metrics: tuple[str, ...] = self.schema.module_metrics
        self.step_metric_names: tuple[str, ...] = self.schema.step_metrics
        self.first_step: int = self.schema.first_step
        self.attrs: dict = self.schema.run_attrs
        self._module_index = {name: i for i, name in enumerate(self.modules)}
        self._metric_index = {name: i for i, name in enumerate(self.metrics)}
        self._ranks: dict[int, _Rank] = {}
        self._files_seen: set[Path] = set()
        self.refresh()

    def __repr__(self) -> str:
        steps = ", ".join(f"rank {r}: {n}" for r, n in self.committed_steps.items())
        return (
            f"<TelemetryRun {self.path} | {len(self.modules)} modules x {len(self.metrics)} "
            f"metrics | committed steps {steps or 'none'}>"
        )

    # -- what is there -------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-read every rank's marker (one small file each) and find new ranks.

        Arrays are reopened lazily afterwards: a zarr Array caches its shape, and the marker
        must be read before the shape for the shape to cover it (writers grow, then commit).
        """
        if not self.path.is_dir():
            raise TelemetryError(f"the telemetry store {self.path} is gone")
        ranks = {}
        for entry in sorted(self.path.iterdir()):
            match = _RANK_GROUP.fullmatch(entry.name)
            if not match or not (entry / "zarr.json").is_file():
                continue
            try:
                group = zarr.open_group(entry, mode="r", zarr_format=3, use_consolidated=False)
                attrs = group.attrs.asdict()
                if COMMITTED not in attrs:
                    continue  # a rank still creating its arrays: listed once it has a marker
                written = attrs.get(WRITTEN_FROM)  # absent in stores older than the check
                ranks[int(match.group(1))] = _Rank(
                    int(attrs[COMMITTED]),
                    int(attrs[HISTORY]),
                    None if written is None else int(written),
                )
            except Exception as e:
                raise TelemetryError(
                    f"{entry}/zarr.json cannot be read ({type(e).__name__}: {e}); the store "
                    f"is damaged"
                ) from e
        self._ranks = ranks

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._ranks)

    @property
    def committed_steps(self) -> dict[int, int]:
        """Rank -> how many steps it has committed (as of the last refresh)."""
        return {rank: state.committed for rank, state in self._ranks.items()}

    def steps(self, rank: int = 0) -> range:
        """The committed step numbers of ``rank``."""
        return range(self.first_step, self.first_step + self._rank(rank).committed)

    def last_step(self, rank: int = 0) -> int | None:
        steps = self.steps(rank)
        return steps[-1] if steps else None

    # -- queries -------------------------------------------------------------------------

    def module_history(
        self,
        module: str,
        metrics: str | Sequence[str] | None = None,
        start: int | None = None,
        stop: int | None = None,
        *,
        rank: int = 0,
    ) -> pd.DataFrame:
        """One module's metrics over steps: index ``step``, one column per metric."""
        m = self._lookup(module, self._module_index, "module")
        names, cols = self._metric_columns(metrics)
        state = self._rank(rank)
        lo, hi = self._rows(start, stop, state)
        # Whole shards from the module-major copy, the rest from the step-major array.
        split = min(max(lo, state.history), hi)
        values = np.empty((0, len(self.metrics)), np.float32)
        if lo < split:
            values = self._read(rank, MODULE_HISTORY, np.s_[lo:split, m, :])
        if split < hi:
            tail = self._read(rank, MODULE_METRICS, np.s_[split:hi, m, :])
            values = np.concatenate([values, tail])
        if cols != list(range(len(self.metrics))):  # a gather over columns: 18 ms at 100k steps
            values = values[:, cols]
        return _frame(values, self._step_index(lo, hi), _columns(names, "metric"))

    def step_snapshot(self, step: int | None = None, *, rank: int = 0) -> pd.DataFrame:
        """Every module at one step (default: the latest committed): index ``module``."""
        state = self._rank(rank)
        if state.committed == 0:
            raise TelemetryError(f"rank {rank} of {self.path} has no committed steps yet")
        row = state.committed - 1 if step is None else step - self.first_step
        if not 0 <= row < state.committed:
            raise TelemetryError(
                f"step {step} is not committed on rank {rank} of {self.path}: committed steps "
                f"are {self.first_step}..{self.first_step + state.committed - 1} (refresh() "
                f"to see newer ones)"
            )
        values = self._read(rank, MODULE_METRICS, np.s_[row])
        return _frame(
            values, pd.Index(self.modules, name="module"), _columns(self.metrics, "metric")
        )

    def metric_window(
        self, metric: str, start: int | None = None, stop: int | None = None, *, rank: int = 0
    ) -> pd.DataFrame:
        """One metric of every module over steps: index ``step``, one column per module."""
        k = self._lookup(metric, self._metric_index, "metric")
        lo, hi = self._rows(start, stop, self._rank(rank))
        values = self._read(rank, MODULE_METRICS, np.s_[lo:hi, :, k])
        return _frame(values, self._step_index(lo, hi), _columns(self.modules, "module"))

    def module_rows(
        self, start: int | None = None, stop: int | None = None, *, rank: int = 0
    ) -> np.ndarray:
        """The rows as written, ``[steps, modules, metrics]`` float32 (the columns in
        :attr:`metrics` order): what the alert rules judged, for replaying them."""
        lo, hi = self._rows(start, stop, self._rank(rank))
        return self._read(rank, MODULE_METRICS, np.s_[lo:hi])

    def step_metrics(
        self, start: int | None = None, stop: int | None = None, *, rank: int = 0
    ) -> pd.DataFrame:
        """The whole-step metrics (loss, grad norm, ...): index ``step``."""
        lo, hi = self._rows(start, stop, self._rank(rank))
        values = self._read(rank, STEP_METRICS, np.s_[lo:hi])
        return _frame(values, self._step_index(lo, hi), _columns(self.step_metric_names, "metric"))

    def to_xarray(self, start: int | None = None, stop: int | None = None, rank: int = 0):
        """An ``xarray.Dataset`` over (step, module): one variable per module metric, and the
        step metrics as ``step.<name>`` (``grad_norm`` is both). Attributes carry each metric's
        unit and meaning from the store's catalogue. Reads every module: pass a window for long
        runs (100k steps x 256 modules x 52 metrics is 5.3 GB)."""
        import xarray as xr  # imported here: a second of import time training processes skip

        lo, hi = self._rows(start, stop, self._rank(rank))
        module_values = self._read(rank, MODULE_METRICS, np.s_[lo:hi])
        step_values = self._read(rank, STEP_METRICS, np.s_[lo:hi])
        about = {
            kind: {m["name"]: {"units": m["unit"], "meaning": m["meaning"]} for m in metrics}
            for kind, metrics in self.schema.catalogue.items()
        }
        data_vars = {
            name: (("step", "module"), module_values[:, :, k], about["module_metrics"].get(name))
            for k, name in enumerate(self.metrics)
        }
        data_vars.update(
            {
                f"step.{name}": (("step",), step_values[:, k], about["step_metrics"].get(name))
                for k, name in enumerate(self.step_metric_names)
            }
        )
        return xr.Dataset(
            data_vars,
            coords={
                "step": np.arange(self.first_step + lo, self.first_step + hi),
                "module": list(self.modules),
            },
            attrs={
                "store": str(self.path),
                "rank": rank,
                "first_step": self.first_step,
                **{
                    f"run.{k}": v for k, v in self.attrs.items() if isinstance(v, (str, int, float))
                },
            },
        )

    # -- helpers -------------------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        if rank not in self._ranks:
            raise TelemetryError(
                f"rank {rank} has no telemetry in {self.path}; ranks present: "
                f"{list(self._ranks) or 'none yet'} (refresh() to look again)"
            )
        return self._ranks[rank]

    def _rows(self, start: int | None, stop: int | None, state: _Rank) -> tuple[int, int]:
        """Step numbers [start, stop) as row indices, clamped to the committed rows."""
        lo = 0 if start is None else start - self.first_step
        hi = state.committed if stop is None else stop - self.first_step
        lo, hi = max(lo, 0), min(hi, state.committed)
        return lo, max(lo, hi)

    def _step_index(self, lo: int, hi: int) -> pd.Index:
        return pd.RangeIndex(self.first_step + lo, self.first_step + hi, name="step")

    def _read(self, rank: int, name: str, selection) -> np.ndarray:
        state = self._ranks[rank]
        array = state.arrays.get(name)
        where = f"{self.path}/{rank_group(rank)}/{name}"
        try:
            if array is None:  # opened after the marker was read: its shape covers the marker
                array = state.arrays[name] = zarr.open_array(
                    self.path / rank_group(rank) / name, mode="r", zarr_format=3
                )
            self._check_files(array, Path(where), selection, rank)
            return array[selection]
        except TelemetryError:
            raise
        except Exception as e:
            raise TelemetryError(
                f"{where} cannot be read ({type(e).__name__}: {e}); the store is damaged"
            ) from e

    def _check_files(self, array: zarr.Array, directory: Path, selection, rank: int) -> None:
        """Every chunk (or shard) file under the rows read must be there.

        Zarr reads a missing file as its fill value, NaN, which in this store means "nothing to
        report this step", so a deleted or lost file would read as quiet steps. The writer never
        leaves one out (all-NaN chunks included), so within the committed rows a missing file is
        damage. Exceptions: a rank that joined mid-run has no files before the row it joined at
        (``written_from``); a store written before that marker existed is not checked; and steps
        a resume withdrew since the last refresh read as NaN, as before (their files go once the
        marker no longer covers them). Files once seen are remembered: a console refreshing
        every few seconds checks only new ones.
        """
        written_from = self._ranks[rank].written_from
        rows = selection[0] if isinstance(selection, tuple) else selection
        lo, hi = (rows.start, rows.stop) if isinstance(rows, slice) else (int(rows), int(rows) + 1)
        if written_from is None or max(lo, written_from) >= hi:
            return
        grid = array.shards or array.chunks  # one file per shard, else per chunk
        lo, step = max(lo, written_from), grid[0]
        cells = [range(_ceil_div(n, g)) for n, g in zip(array.shape[1:], grid[1:], strict=True)]
        for coords in itertools.product(range(lo // step, _ceil_div(hi, step)), *cells):
            path = directory / array.metadata.encode_chunk_key(coords)
            if path in self._files_seen:
                continue
            if not path.is_file():
                if self._withdrawn(rank, directory.name, coords[0] * step):
                    return
                first = self.first_step + coords[0] * step
                last = self.first_step + min((coords[0] + 1) * step, array.shape[0]) - 1
                raise TelemetryError(
                    f"{path} is missing: it holds committed steps {first}..{last}, so the store "
                    "is damaged (zarr would read the file as NaN, which here means nothing to "
                    "report). Restore it from a backup, or move the store aside to read the run "
                    "without telemetry"
                )
            self._files_seen.add(path)

    def _withdrawn(self, rank: int, name: str, row: int) -> bool:
        """Whether ``rank``'s marker on disk, read now, no longer covers ``row`` of ``name``."""
        marker = zarr.open_group(
            self.path / rank_group(rank), mode="r", zarr_format=3, use_consolidated=False
        ).attrs.asdict()
        return int(marker[HISTORY if name == MODULE_HISTORY else COMMITTED]) <= row

    def _lookup(self, name: str, index: dict[str, int], what: str) -> int:
        if name not in index:
            close = difflib.get_close_matches(name, list(index), n=3)
            # Metrics are few enough to list (40); a model's modules are not (Llama 8B: 128).
            every = f"; the {what}s are {', '.join(index)}" if what == "metric" else ""
            hint = f"; did you mean {', '.join(close)}?" if close else every
            raise TelemetryError(f"no {what} {name!r} in {self.path}{hint}")
        return index[name]

    def _metric_columns(self, metrics: str | Sequence[str] | None) -> tuple[list[str], list[int]]:
        if metrics is None:
            names = list(self.metrics)
        elif isinstance(metrics, str):
            names = [metrics]
        else:
            names = list(metrics)
        return names, [self._lookup(n, self._metric_index, "metric") for n in names]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _columns(names: Sequence[str], label: str) -> pd.Index:
    return pd.Index(list(names), name=label)


def _frame(values: np.ndarray, index: pd.Index, columns: pd.Index) -> pd.DataFrame:
    """The values as a DataFrame, without the copy pandas makes of an array by default: every
    array here was just read, so nothing else holds it (the copy is 19 ms of a 100k-step
    history)."""
    return pd.DataFrame(values, index=index, columns=columns, copy=False)


__all__ = ["StoreSchema", "TelemetryRun", "open_run"]
