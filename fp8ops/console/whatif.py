"""Window what-if: the scales a run would have had under another delayed-scaling window.

The store records, for every module, slot and step, the amax that entered the scaling history
(``<slot>.amax``, after the amax reduction). Replaying that series through the update the
training used, :func:`fp8ops.precision.scaling.update_delayed_scaling` (TE's, bit for bit),
with another ``amax_history_len``, ``amax_compute_algo`` or ``margin`` gives the scales those
settings would have produced, and so the steps where a step's amax would have overflowed the
scale its cast used (delayed scaling casts step t with the scale of step t-1's update), and the
headroom: how many bits of FP8 range the scaled amax left unused, log2(fp8_max / (amax x scale)).
Negative headroom is an overflow: those elements saturate at fp8_max.

What the replay approximates (docs/console.md): the store has one reduced amax per step.

* ``weight`` rolls its history once per step (cast once per step), so replaying the run's own
  settings reproduces the recorded weight scales exactly (``tests/test_console.py`` checks it).
* ``input`` and ``grad_output`` roll once per micro-batch; the store keeps the step's last
  micro-batch. The replay feeds one entry per step, so a history of L entries spans L steps
  here but L / micro-batches steps in training, and the other micro-batches' amaxes are
  missing. Compare settings with each other through the replay (both sides approximated alike),
  not a replay with the recorded scales.
* A step where the slot did not run in FP8 (NaN, or the module held in BF16) feeds amax 0,
  which TE's fused update treats as "did not run": neither rolled nor rescaled.

A replay of steps [start, stop) starts ``warmup`` steps earlier from a fresh state (scale 1,
empty history): after as many updates as the history holds, the state depends only on the amax
series, so the reported steps do not depend on where the replay started.

Imports torch (the update is torch code); the console imports this module only when a what-if
is asked for.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fp8ops.amax_algo import parse_amax_algo
from fp8ops.errors import Fp8opsError
from fp8ops.run import RunLayout
from fp8ops.telemetry import TelemetryRun
from fp8ops.telemetry.catalogue import SLOTS

# Largest finite values of the two encodings (fp8ops.precision.formats, without importing it
# for a lookup): forward slots are E4M3; grad_output is E5M2 under the hybrid format.
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@dataclass(frozen=True)
class Window:
    """Delayed-scaling settings to replay: ``precision.amax_history_len``,
    ``precision.amax_compute_algo`` and ``precision.margin``."""

    history_len: int
    algo: str
    margin: int

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise Fp8opsError(f"history length must be >= 1, got {self.history_len}")
        try:
            parse_amax_algo(self.algo)
        except ValueError as exc:
            raise Fp8opsError(f"amax algorithm: {exc}") from None

    def __str__(self) -> str:
        return f"history {self.history_len}, {self.algo}, margin {self.margin}"


def fp8_max(slot: str, fp8_format: str) -> float:
    """The largest value a slot's FP8 encoding holds under ``precision.fp8_format``."""
    return E5M2_MAX if slot == "grad_output" and fp8_format == "hybrid" else E4M3_MAX


@dataclass(frozen=True)
class Replay:
    """Scales replayed over steps, for ``n`` series (modules or slots) side by side."""

    window: Window
    fp8_max: float
    steps: np.ndarray  # [T] step numbers
    amax: np.ndarray  # [T, n] the amax each step recorded; NaN where the slot did not run FP8
    scale_used: np.ndarray  # [T, n] the scale that step's cast used (the previous update's)
    scale: np.ndarray  # [T, n] the scale after that step's update (what the store records)

    @property
    def headroom_bits(self) -> np.ndarray:
        """[T, n] log2(fp8_max / (amax x scale_used)): bits of range left unused; < 0 overflowed.
        NaN where nothing was cast (no amax, or amax 0)."""
        scaled = self.amax.astype(np.float32) * self.scale_used  # the cast's float32 product
        with np.errstate(divide="ignore", invalid="ignore"):
            bits = np.log2(np.float64(self.fp8_max) / scaled.astype(np.float64))
        return np.where(np.isfinite(bits), bits, np.nan)

    @property
    def overflow(self) -> np.ndarray:
        """[T, n] True where amax x scale_used exceeded fp8_max (those values saturated)."""
        with np.errstate(invalid="ignore"):
            return (self.amax.astype(np.float32) * self.scale_used) > np.float32(self.fp8_max)

    @property
    def representable(self) -> np.ndarray:
        """[T, n] the largest |value| each step's cast could hold: fp8_max / scale_used."""
        return np.float32(self.fp8_max) / self.scale_used


def replay(
    amax: np.ndarray,
    window: Window,
    fp8_max: float,
    *,
    steps: Sequence[int] | np.ndarray | None = None,
    warmup: int = 0,
) -> Replay:
    """Run ``amax`` ([T, n] float32, one row per step) through TE's delayed-scaling update.

    The first ``warmup`` rows only bring the history and scale to their state; the result
    covers the rows after them. NaN rows feed 0 (the slot did not run).
    """
    import torch

    from fp8ops.precision.scaling import update_delayed_scaling

    amax = np.asarray(amax, dtype=np.float32)
    if amax.ndim == 1:
        amax = amax[:, None]
    total, n = amax.shape
    algo = parse_amax_algo(window.algo)
    fed = torch.from_numpy(np.nan_to_num(amax, nan=0.0))
    history = torch.zeros(window.history_len, n, dtype=torch.float32)
    scale = torch.ones(n, dtype=torch.float32)  # TE's initial scale
    used = np.empty((total, n), np.float32)
    after = np.empty((total, n), np.float32)
    for t in range(total):
        used[t] = scale.numpy()
        history[0] = fed[t]  # row 0 holds the step's (reduced) amax, as the casts left it
        history, scale = update_delayed_scaling(
            history, scale, fed[t], fp8_max=fp8_max, margin=window.margin, algo=algo
        )
        after[t] = scale.numpy()
    steps = np.arange(total) if steps is None else np.asarray(steps)
    return Replay(window, fp8_max, steps[warmup:], amax[warmup:], used[warmup:], after[warmup:])


# --------------------------------------------------------------------------------------
# From a run's telemetry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotWhatIf:
    """One module slot replayed under the run's own window and under another."""

    module: str
    slot: str
    recorded_scale: np.ndarray  # [T] what the store holds (the run's real scales)
    run: Replay  # the run's own settings, replayed (the baseline)
    what_if: Replay  # the other settings

    @property
    def steps(self) -> np.ndarray:
        return self.run.steps


def run_window(run: TelemetryRun, manifest_precision) -> Window:
    """The window a run trained with (its manifest's ``precision`` section)."""
    p = manifest_precision
    return Window(p.amax_history_len, p.amax_compute_algo, p.margin)


def replay_slots(
    run: TelemetryRun,
    modules: Sequence[str],
    slots: Sequence[str],
    own: Window,
    other: Window,
    fp8_format: str,
    *,
    start: int | None = None,
    stop: int | None = None,
    rank: int = 0,
) -> list[SlotWhatIf]:
    """Replay every (module, slot) over steps [start, stop) under ``own`` and ``other``.

    Reads each slot's amax for all ``modules`` at once (``metric_window``) and replays them side
    by side: one update call per step and window for all modules of a slot.
    """
    last = run.last_step(rank)
    if last is None:
        raise Fp8opsError(f"{run.path}: no committed telemetry steps yet on rank {rank}")
    lo = run.first_step if start is None else max(start, run.first_step)
    hi = last + 1 if stop is None else min(stop, last + 1)
    if hi <= lo:
        raise Fp8opsError(f"no committed steps in [{start}, {stop}) (committed: ..{last})")
    warmup = max(own.history_len, other.history_len)
    first = max(run.first_step, lo - warmup)
    enabled = run.metric_window("fp8_enabled", first, hi, rank=rank)[list(modules)]
    results = []
    for slot in slots:
        amax = run.metric_window(f"{slot}.amax", first, hi, rank=rank)[list(modules)]
        recorded = run.metric_window(f"{slot}.scale", lo, hi, rank=rank)[list(modules)]
        # A module held in the base dtype keeps its frozen state in the row: it cast nothing.
        values = np.where(enabled.to_numpy() > 0, amax.to_numpy(), np.nan)
        steps = amax.index.to_numpy()
        top = fp8_max(slot, fp8_format)
        mine = replay(values, own, top, steps=steps, warmup=lo - first)
        theirs = replay(values, other, top, steps=steps, warmup=lo - first)
        for i, module in enumerate(modules):
            results.append(
                SlotWhatIf(
                    module,
                    slot,
                    recorded.to_numpy()[:, i],
                    _column(mine, i),
                    _column(theirs, i),
                )
            )
    return results


def _column(r: Replay, i: int) -> Replay:
    return Replay(
        r.window,
        r.fp8_max,
        r.steps,
        r.amax[:, i : i + 1],
        r.scale_used[:, i : i + 1],
        r.scale[:, i : i + 1],
    )


def select_modules(run: TelemetryRun, pattern: str | None) -> list[str]:
    """The run's modules matching a glob (all without one); an error if none does."""
    if pattern is None:
        return list(run.modules)
    found = [m for m in run.modules if fnmatch.fnmatchcase(m, pattern)]
    if not found:
        raise Fp8opsError(f"no module of {run.path} matches {pattern!r}")
    return found


def check_slots(slots: Sequence[str]) -> list[str]:
    unknown = [s for s in slots if s not in SLOTS]
    if unknown:
        raise Fp8opsError(f"unknown slot {unknown[0]!r}; slots: {', '.join(SLOTS)}")
    return list(slots)


# --------------------------------------------------------------------------------------
# Summaries (the CLI's table, the console's text)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """What a replay means for one slot: overflowing steps and the range left unused."""

    cast_steps: int  # steps where the slot cast something
    overflow_steps: int
    first_overflows: tuple[int, ...]  # up to 5 step numbers
    headroom_median: float  # bits; NaN when nothing was cast
    headroom_p10: float  # the tighter steps
    headroom_min: float  # < 0: the worst overshoot

    @classmethod
    def of(cls, r: Replay, column: int = 0) -> Summary:
        bits = r.headroom_bits[:, column]
        cast = np.isfinite(bits)
        over = r.overflow[:, column]
        nan = float("nan")
        return cls(
            cast_steps=int(cast.sum()),
            overflow_steps=int(over.sum()),
            first_overflows=tuple(int(s) for s in r.steps[over][:5]),
            headroom_median=float(np.median(bits[cast])) if cast.any() else nan,
            headroom_p10=float(np.percentile(bits[cast], 10)) if cast.any() else nan,
            headroom_min=float(bits[cast].min()) if cast.any() else nan,
        )


def fidelity(w: SlotWhatIf) -> float:
    """Share of the steps the slot cast in FP8 where the run's own settings, replayed, give the
    recorded scale exactly (1.0 for weight; lower for input and grad_output, see the module
    docstring). Steps held in the base dtype do not count: the row keeps their frozen scale,
    which no replay of a cast-free step reproduces. NaN if the slot never cast."""
    recorded, replayed = w.recorded_scale, w.run.scale[:, 0]
    known = np.isfinite(recorded) & ~np.isnan(w.run.amax[:, 0])
    return float((recorded[known] == replayed[known]).mean()) if known.any() else float("nan")


# --------------------------------------------------------------------------------------
# The whole run: `fp8ops whatif RUN_DIR`
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportRow:
    module: str
    slot: str
    run: Summary  # the run's own window, replayed
    what_if: Summary
    fidelity: float  # share of steps where the replayed own window gives the recorded scale

    def to_json(self) -> dict:
        return {
            "module": self.module,
            "slot": self.slot,
            "run": vars(self.run),
            "what_if": vars(self.what_if),
            "fidelity": self.fidelity,
        }


@dataclass(frozen=True)
class Report:
    run_dir: str
    own: Window
    other: Window
    first_step: int
    last_step: int
    rows: list[ReportRow]

    def to_json(self) -> dict:
        return {
            "run_dir": self.run_dir,
            "own": vars(self.own),
            "what_if": vars(self.other),
            "steps": [self.first_step, self.last_step],
            "rows": [r.to_json() for r in self.rows],
        }


def report(
    run_dir,
    *,
    history_len: int | None = None,
    algo: str | None = None,
    margin: int | None = None,
    module: str | None = None,
    slots: Sequence[str] = SLOTS,
    steps: int = 10_000,
    rank: int = 0,
) -> Report:
    """Replay the last ``steps`` committed steps (0: all) of every module matching ``module``
    under the run's own window and under one with the given fields changed; the rows sorted
    worst first (most overflowing steps under the what-if, then the least headroom)."""
    from pathlib import Path

    from fp8ops.manifest import load_manifest
    from fp8ops.telemetry import open_run

    run_dir = Path(run_dir)
    precision = load_manifest(RunLayout(run_dir).manifest).precision
    if not precision.enabled:
        raise Fp8opsError(f"{run_dir}: FP8 is off in this run; there are no scales to replay")
    telemetry = open_run(run_dir)
    own = run_window(telemetry, precision)
    other = Window(
        own.history_len if history_len is None else history_len,
        own.algo if algo is None else algo,
        own.margin if margin is None else margin,
    )
    last = telemetry.last_step(rank)
    if last is None:
        raise Fp8opsError(f"{run_dir}: no committed telemetry steps yet on rank {rank}")
    start = max(telemetry.first_step, last - steps + 1) if steps else telemetry.first_step
    replays = replay_slots(
        telemetry,
        select_modules(telemetry, module),
        check_slots(slots),
        own,
        other,
        precision.fp8_format,
        start=start,
        rank=rank,
    )
    rows = [
        ReportRow(w.module, w.slot, Summary.of(w.run), Summary.of(w.what_if), fidelity(w))
        for w in replays
    ]
    rows.sort(key=lambda r: (-r.what_if.overflow_steps, _or_inf(r.what_if.headroom_p10)))
    return Report(str(run_dir), own, other, start, last, rows)


def _or_inf(x: float) -> float:
    return x if np.isfinite(x) else float("inf")
