"""Telemetry shaped for the console's views: heatmaps, a module's history, all downsampled.

A screen holds about a thousand columns, a run can hold millions of steps. So every view pools
steps into bins of consecutive steps, keeping each bin's *worst* value (the largest amax,
saturation or error; the smallest scale), never an average that would hide a spike:

* a heatmap of the last N steps reads that window (``metric_window``: chunks of 256 steps x 64
  modules) and pools it into at most ``MAX_COLUMNS`` bins;
* the whole run reads every chunk of the store: 2 s at 100k steps x 256 modules on this
  machine, up to 4 s when it is busy (``ci/bench_console.py``), too slow to wait for on a click.
  :class:`Overview` pools each complete 256-step block once, in a background thread, keeps the
  blocks in memory (4 bytes per module and block: 400 KB per metric at 100k steps x 256
  modules) and afterwards reads only blocks committed since;
* a module's history (``module_history``, one chunk per 2048 steps) is pooled into at most
  ``MAX_POINTS`` points per line.

Sparse metrics (saturation, underflow, norms and FP8 error are NaN on steps that did not
measure them) are pooled with NaN-ignoring reductions; a bin with no measurement stays NaN.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fp8ops.telemetry import TelemetryRun
from fp8ops.telemetry.catalogue import worst_end
from fp8ops.telemetry.store import FLUSH_EVERY

MAX_COLUMNS = 1000  # heatmap columns: about one per screen pixel of a wide plot
MAX_POINTS = 2000  # points per line of a module's history
BLOCK = FLUSH_EVERY  # the overview's unit: one row of module_metrics chunks (256 steps)
READ_SLAB = 25_600  # steps read at once while pooling the whole run: 26 MB per metric


def pool(values: np.ndarray, bin_steps: int, keep: str = "max") -> np.ndarray:
    """Pool rows (steps) of ``values`` in groups of ``bin_steps``, the last group possibly
    shorter, keeping each group's "max" or "min" per column; NaN is ignored (a group of NaN
    stays NaN)."""
    if bin_steps <= 1 or len(values) == 0:
        return values
    reduce = np.fmin if keep == "min" else np.fmax  # fmin/fmax skip NaN
    return reduce.reduceat(values, np.arange(0, len(values), bin_steps), axis=0)


def bin_size(steps: int, columns: int = MAX_COLUMNS) -> int:
    return max(1, -(-steps // columns))


@dataclass(frozen=True)
class Heatmap:
    """One metric over modules x step bins. ``z[i, j]``: module i's worst value in bin j, which
    covers steps ``starts[j]`` to ``ends[j]`` inclusive. Bins where no module measured
    anything are dropped (sparse metrics)."""

    metric: str
    modules: tuple[str, ...]
    starts: np.ndarray  # [columns] first step of each bin
    ends: np.ndarray  # [columns] last step of each bin
    z: np.ndarray  # [modules, columns] float32
    bin_steps: int

    @property
    def empty(self) -> bool:
        return self.z.size == 0

    def worst(self, count: int) -> list[tuple[str, float]]:
        """The ``count`` modules with the worst value anywhere in the map, worst first (modules
        that measured nothing left out)."""
        lowest = worst_end(self.metric) == "min"
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows
            per_module = np.nanmin(self.z, axis=1) if lowest else np.nanmax(self.z, axis=1)
        order = [
            i
            for i in np.argsort(per_module if lowest else -per_module, kind="stable")
            if np.isfinite(per_module[i])
        ]
        return [(self.modules[i], float(per_module[i])) for i in order[:count]]


def _heatmap(
    metric, modules, steps: np.ndarray, pooled: np.ndarray, bin_steps: int, last_step: int
) -> Heatmap:
    """Assemble a Heatmap from pooled rows [columns, modules] whose bins start at ``steps``."""
    ends = np.append(steps[1:] - 1, last_step) if len(steps) else steps
    measured = ~np.isnan(pooled).all(axis=1) if pooled.size else np.zeros(0, bool)
    return Heatmap(
        metric,
        tuple(modules),
        steps[measured],
        ends[measured],
        np.ascontiguousarray(pooled[measured].T, dtype=np.float32),
        bin_steps,
    )


def window_heatmap(run: TelemetryRun, metric: str, start: int, stop: int, rank: int = 0) -> Heatmap:
    """A heatmap of steps [start, stop), read directly and pooled into <= MAX_COLUMNS bins."""
    frame = run.metric_window(metric, start, stop, rank=rank)
    steps = frame.index.to_numpy()
    size = bin_size(len(steps))
    pooled = pool(frame.to_numpy(), size, worst_end(metric))
    last = int(steps[-1]) if len(steps) else start
    return _heatmap(metric, run.modules, steps[::size], pooled, size, last)


class Overview:
    """One metric of every module over the whole run, pooled per 256-step block, kept in memory
    and extended as the run commits more steps.

    ``update()`` reads the complete blocks not pooled yet (everything, the first time), in
    slabs of ``READ_SLAB`` steps; ``heatmap()`` regroups the blocks into <= MAX_COLUMNS bins and
    adds the steps after the last complete block, read directly. Thread-safe: a background
    thread may update while the console draws.

    A resume from an earlier checkpoint withdraws committed steps and writes them again: when
    the committed count falls below what was pooled, the blocks past it are dropped and pooled
    again. (Withdrawn and rewritten past the old count between two updates goes unnoticed;
    ``Overview.reset()`` or choosing the run again starts over.)
    """

    def __init__(self, run: TelemetryRun, metric: str, rank: int = 0):
        self.run, self.metric, self.rank = run, metric, rank
        self._blocks = np.empty((0, len(run.modules)), np.float32)  # [blocks, modules]
        self._lock = threading.Lock()

    @property
    def pooled_steps(self) -> int:
        return len(self._blocks) * BLOCK

    def reset(self) -> None:
        with self._lock:
            self._blocks = self._blocks[:0]

    def update(self) -> None:
        """Pool the complete blocks committed since the last update."""
        with self._lock:
            committed = self.run.committed_steps.get(self.rank, 0)
            if committed < self.pooled_steps:  # withdrawn by a resume from an earlier step
                self._blocks = self._blocks[: committed // BLOCK]
            first, complete = self.run.first_step, committed // BLOCK * BLOCK
            new = [self._blocks]
            for row in range(self.pooled_steps, complete, READ_SLAB):
                rows = min(READ_SLAB, complete - row)
                frame = self.run.metric_window(
                    self.metric, first + row, first + row + rows, rank=self.rank
                )
                new.append(pool(frame.to_numpy(), BLOCK, worst_end(self.metric)))
            self._blocks = np.concatenate(new)

    def heatmap(self) -> Heatmap:
        """The whole run as pooled so far, plus the steps after the last complete block."""
        with self._lock:
            blocks = self._blocks
        run, first = self.run, self.run.first_step
        committed = run.committed_steps.get(self.rank, 0)
        done = min(len(blocks) * BLOCK, committed // BLOCK * BLOCK)
        blocks = blocks[: done // BLOCK]
        per_column = bin_size(len(blocks) + 1)  # blocks per column, the tail counting as one
        pooled = pool(blocks, per_column, worst_end(self.metric))
        starts = first + np.arange(0, done, per_column * BLOCK)
        if done < committed:  # the partial block at the end, read now
            tail = run.metric_window(self.metric, first + done, first + committed, rank=self.rank)
            last = pool(tail.to_numpy(), len(tail), worst_end(self.metric))
            pooled, starts = np.concatenate([pooled, last]), np.append(starts, first + done)
        bin_steps = min(per_column * BLOCK, committed)
        return _heatmap(self.metric, run.modules, starts, pooled, bin_steps, first + committed - 1)


# --------------------------------------------------------------------------------------
# A module's history
# --------------------------------------------------------------------------------------


def detail_metrics(slot: str) -> list[str]:
    """What the module view plots for a slot (catalogue names)."""
    return [
        f"{slot}.amax",
        f"{slot}.window_max",
        f"{slot}.scale",
        f"{slot}.saturation",
        f"{slot}.underflow",
        f"{slot}.blocks_at_floor",
        "grad_norm",
        "fp8_rel_error",
        "fp8_enabled",
    ]


@dataclass(frozen=True)
class Series:
    """One line: steps and values, pooled to at most MAX_POINTS points (NaN steps dropped)."""

    steps: np.ndarray
    values: np.ndarray
    bin_steps: int


def series(frame: pd.DataFrame, metric: str, points: int = MAX_POINTS) -> Series:
    """``frame[metric]`` without its unmeasured steps, pooled to at most ``points`` points."""
    column = frame[metric]
    column = column[column.notna()]
    steps, values = column.index.to_numpy(), column.to_numpy(np.float32)
    size = bin_size(len(steps), points)
    return Series(steps[::size], pool(values, size, worst_end(metric)), size)


def module_history(
    run: TelemetryRun,
    module: str,
    slot: str,
    rank: int = 0,
    start: int | None = None,
    stop: int | None = None,
) -> dict[str, Series]:
    """The module view's lines for ``module`` and ``slot``, metric -> Series."""
    metrics = detail_metrics(slot)
    frame = run.module_history(module, metrics, start, stop, rank=rank)
    return {metric: series(frame, metric) for metric in metrics}
