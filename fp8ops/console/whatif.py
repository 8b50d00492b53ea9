"""What-if: the scales a run would have had under another delayed-scaling window, or under
per-tensor current scaling.

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

from fp8ops.admission import module_recipe
from fp8ops.amax_algo import parse_amax_algo
from fp8ops.errors import Fp8opsError
from fp8ops.precision.scaling import FLT_MAX, scaled_max
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


@dataclass(frozen=True)
class CurrentScaling:
    """The what-if of per-tensor current scaling (TE's ``Float8CurrentScaling``): every cast
    scaled by its own amax, so nothing is delayed. From one recorded amax per step, which is the
    reduced amax of the amax group, where current scaling without sequence parallelism scales
    each TP shard by its own: the what-if's scale is never larger than the shard's would be."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    history_len = 0  # stateless: nothing to warm up

    def __str__(self) -> str:
        return "current scaling" + (", power-of-2 scales" if self.power_2_scale else "")


Setting = Window | CurrentScaling


def fp8_max(slot: str, fp8_format: str) -> float:
    """The largest value a slot's FP8 encoding holds under ``precision.fp8_format``."""
    return E5M2_MAX if slot == "grad_output" and fp8_format == "hybrid" else E4M3_MAX


@dataclass(frozen=True)
class Replay:
    """Scales replayed over steps, for ``n`` series (modules or slots) side by side."""

    window: Setting
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
        """[T, n] True where the cast clipped the amax: amax x scale_used (float32) beyond what
        rounds to fp8_max. A product a rounding above fp8_max is not clipped (current scaling's
        448 / amax x amax can be 448.00003), so the bound is half an FP8 step above it: 464 for
        E4M3 (a tie there rounds down to 448, the even code), 61440 for E5M2 (a tie rounds up)."""
        scaled = self.amax.astype(np.float32) * self.scale_used
        with np.errstate(invalid="ignore"):
            if self.fp8_max == E4M3_MAX:
                return scaled > np.float32(464.0)
            return scaled >= np.float32(61440.0)

    @property
    def representable(self) -> np.ndarray:
        """[T, n] the largest |value| each step's cast could hold: fp8_max / scale_used."""
        return np.float32(self.fp8_max) / self.scale_used


def replay(
    amax: np.ndarray,
    window: Setting,
    fp8_max: float,
    *,
    steps: Sequence[int] | np.ndarray | None = None,
    warmup: int = 0,
) -> Replay:
    """Run ``amax`` ([T, n] float32, one row per step) through TE's delayed-scaling update, or
    with :class:`CurrentScaling` through TE's current-scaling rule (each step's cast by its
    own scale).

    The first ``warmup`` rows only bring the history and scale to their state; the result
    covers the rows after them. NaN rows feed 0 (the slot did not run).

    Vectorised over steps, not one update call per step: the history is a sliding window, so
    every step's window statistic comes from one reduction over the series, and the scale
    after a step is the last usable quotient so far (``tests/test_whatif.py`` checks it equal,
    bit for bit, to calling ``update_delayed_scaling`` step by step).
    """
    amax = np.asarray(amax, dtype=np.float32)
    if amax.ndim == 1:
        amax = amax[:, None]
    total = amax.shape[0]
    fed = np.nan_to_num(amax, nan=0.0, posinf=np.inf)
    steps = np.arange(total) if steps is None else np.asarray(steps)
    if isinstance(window, CurrentScaling):
        scale = _current_scales(fed, window, fp8_max)
        return Replay(
            window, fp8_max, steps[warmup:], amax[warmup:], scale[warmup:], scale[warmup:]
        )
    algo = parse_amax_algo(window.algo)
    after = np.empty_like(fed)
    for i in range(fed.shape[1]):
        if algo.fused:
            after[:, i] = _fused_scales(fed[:, i], window, algo.kind, fp8_max)
        else:
            after[:, i] = _window_statistic_scales(fed[:, i], window, algo, fp8_max)
    used = np.concatenate([np.ones((1, fed.shape[1]), np.float32), after[:-1]])  # TE starts at 1
    return Replay(window, fp8_max, steps[warmup:], amax[warmup:], used[warmup:], after[warmup:])


def _current_scales(fed: np.ndarray, setting: CurrentScaling, fp8_max: float) -> np.ndarray:
    import torch

    from fp8ops.precision.scales import scale_from_amax

    scale = scale_from_amax(
        torch.from_numpy(fed),
        fp8_max,
        power_2_scale=setting.power_2_scale,
        epsilon=setting.amax_epsilon,
    )
    return scale.numpy()


def replay_stepwise(amax: np.ndarray, window: Window, fp8_max: float) -> np.ndarray:
    """The scales after each step ([T, n]) from one ``update_delayed_scaling`` call per step:
    the reference :func:`replay` is checked against (``tests/test_whatif.py``) and timed with
    (``ci/bench_whatif.py``)."""
    import torch

    from fp8ops.precision.scaling import update_delayed_scaling

    amax = np.asarray(amax, dtype=np.float32)
    amax = amax[:, None] if amax.ndim == 1 else amax
    fed = torch.from_numpy(np.nan_to_num(amax, nan=0.0, posinf=np.inf))
    algo = parse_amax_algo(window.algo)
    history = torch.zeros(window.history_len, amax.shape[1], dtype=torch.float32)
    scale = torch.ones(amax.shape[1], dtype=torch.float32)
    after = np.empty_like(amax)
    for t in range(len(amax)):
        history[0] = fed[t]  # row 0 holds the step's (reduced) amax, as the casts left it
        history, scale = update_delayed_scaling(
            history, scale, fed[t], fp8_max=fp8_max, margin=window.margin, algo=algo
        )
        after[t] = scale.numpy()
    return after


def _sliding_max(values: np.ndarray, length: int) -> np.ndarray:
    """``max(values[j - length + 1 .. j])`` for every j, with zeros before the start (the empty
    history), in O(T): van Herk / Gil-Werman's prefix and suffix maxima of blocks of ``length``."""
    padded = np.concatenate([np.zeros(length - 1, values.dtype), values])
    blocks = -(-len(padded) // length)
    full = np.concatenate([padded, np.zeros(blocks * length - len(padded), values.dtype)])
    cut = full.reshape(blocks, length)
    prefix = np.maximum.accumulate(cut, axis=1).ravel()
    suffix = np.maximum.accumulate(cut[:, ::-1], axis=1)[:, ::-1].ravel()
    ends = np.arange(length - 1, len(padded))
    return np.maximum(suffix[ends - length + 1], prefix[ends])


def _last_usable(quotient: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """At every step the most recent usable quotient, or TE's initial scale 1 before any."""
    last = np.maximum.accumulate(np.where(usable, np.arange(len(usable)), -1))
    return np.where(last >= 0, quotient[np.maximum(last, 0)], np.float32(1.0)).astype(np.float32)


def _ieee_quotient(top: np.float32, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fused kernel's ``top / amax`` (one float32 division, an infinite result clamped to
    FLT_MAX) where the amax is finite and positive."""
    usable = np.isfinite(amax) & (amax > 0)
    with np.errstate(divide="ignore", over="ignore"):
        quotient = np.float32(top) / np.where(usable, amax, np.float32(1.0))
    return np.where(np.isinf(quotient), FLT_MAX, quotient).astype(np.float32), usable


def _fused_scales(fed: np.ndarray, window: Window, kind: str, fp8_max: float) -> np.ndarray:
    """TE's fused update over a series: a step with amax 0 is neither rolled nor rescaled, so
    the window is the last ``history_len`` steps that ran; "max" takes its maximum (inf wins,
    and an infinite window keeps the old scale), "most_recent" the step's own amax."""
    ran = fed != 0
    ran_values = fed[ran]
    if kind == "most_recent":
        statistic = ran_values
    else:
        statistic = _sliding_max(ran_values, window.history_len)
    quotient, usable = _ieee_quotient(scaled_max(fp8_max, window.margin), statistic)
    scales = np.empty(len(fed), np.float32)
    scales[ran] = _last_usable(quotient, usable)
    # A step that did not run keeps the scale of the last step that did (1 before any).
    last_ran = np.maximum.accumulate(np.where(ran, np.arange(len(fed)), -1))
    return np.where(last_ran >= 0, scales[np.maximum(last_ran, 0)], np.float32(1.0))


def _window_statistic_scales(fed, window: Window, algo, fp8_max: float) -> np.ndarray:
    """TE's callable path over a series: it always rolls, so step t's window is the last
    ``history_len`` amaxes fed (zeros before the start); the statistic and the scale are the
    update's own functions, applied to every step's window at once (in chunks of steps)."""
    import torch

    from fp8ops.precision.scaling import callable_path_scale, window_amax

    length = window.history_len
    padded = np.concatenate([np.zeros(length - 1, np.float32), fed])
    windows = np.lib.stride_tricks.sliding_window_view(padded, length)  # [T, L], a view
    statistic = np.empty(len(fed), np.float32)
    chunk = max(1, (1 << 22) // length)
    for lo in range(0, len(fed), chunk):
        part = torch.from_numpy(np.ascontiguousarray(windows[lo : lo + chunk].T))
        statistic[lo : lo + chunk] = window_amax(algo, part).numpy()
    stat = torch.from_numpy(statistic)
    nan = torch.full_like(stat, float("nan"))
    scales = callable_path_scale(stat, nan, fp8_max, window.margin).numpy()
    return _last_usable(scales, ~np.isnan(scales))


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
    other: Setting
    first_step: int
    last_step: int
    rows: list[ReportRow]

    def to_json(self) -> dict:
        return {
            "run_dir": self.run_dir,
            "own": setting_json(self.own),
            "what_if": setting_json(self.other),
            "steps": [self.first_step, self.last_step],
            "rows": [r.to_json() for r in self.rows],
        }


def refuse_stateless(run_dir, precision, modules: Sequence[str] = ()) -> None:
    """A what-if replays a delayed-scaling run; a run of another recipe scaled every cast by its
    own amax, so there is no window to replay and nothing delayed to compare with. The same for
    ``modules`` that ran a per-module recipe (``precision.module_recipes``)."""
    if precision.scaling != "delayed":
        raise Fp8opsError(
            f"{run_dir}: this run used {precision.scaling} scaling, which scales every cast by "
            "its own amax: there is no delayed window to replay (the what-if compares a delayed "
            "run with other settings; compare recipes with fp8ops dualtrack --tracks)"
        )
    own = [m for m in modules if module_recipe(precision, m) is not None]
    if own and len(own) == len(modules):
        recipe = module_recipe(precision, own[0])[1].scaling
        raise Fp8opsError(
            f"{run_dir}: {own[0]} ran {recipe} scaling (precision.module_recipes), which scales "
            "every cast by its own amax: there is no delayed window to replay for it"
        )


def delayed_modules(precision, modules: Sequence[str]) -> list[str]:
    """The ``modules`` that ran the run's delayed scaling (not a per-module recipe)."""
    return [m for m in modules if module_recipe(precision, m) is None]


def setting_json(setting: Setting) -> dict:
    recipe = "current" if isinstance(setting, CurrentScaling) else "delayed"
    return {"recipe": recipe, **vars(setting)}


WHATIF_RECIPES = ("delayed", "current")


def what_if_setting(
    own: Window,
    recipe: str = "delayed",
    *,
    history_len: int | None = None,
    algo: str | None = None,
    margin: int | None = None,
    power_2_scale: bool = False,
) -> Setting:
    """The setting to compare with: the run's window with the given fields changed, or current
    scaling. Block and MXFP8 scaling take each block's amax, which telemetry does not record
    (one amax per tensor), so they are compared by training (``fp8ops dualtrack --tracks``)."""
    if recipe in ("block", "mxfp8"):
        raise Fp8opsError(
            f"--recipe {recipe}: a what-if of {recipe} scaling needs every block's amax and the "
            "telemetry records one per tensor; train it beside the run instead (fp8ops "
            f"dualtrack MANIFEST --tracks delayed,{recipe})"
        )
    if recipe not in WHATIF_RECIPES:
        raise Fp8opsError(f"--recipe {recipe!r}: use one of {', '.join(WHATIF_RECIPES)}")
    if recipe == "current":
        changed = [
            n
            for n, v in (("history-len", history_len), ("algo", algo), ("margin", margin))
            if v is not None
        ]
        if changed:
            raise Fp8opsError(
                f"--{changed[0]} is a delayed-scaling setting; current scaling has no window"
            )
        return CurrentScaling(power_2_scale=power_2_scale)
    if power_2_scale:
        raise Fp8opsError("--power-2-scale is a current-scaling setting; add --recipe current")
    return Window(
        own.history_len if history_len is None else history_len,
        own.algo if algo is None else algo,
        own.margin if margin is None else margin,
    )


def report(
    run_dir,
    *,
    recipe: str = "delayed",
    power_2_scale: bool = False,
    history_len: int | None = None,
    algo: str | None = None,
    margin: int | None = None,
    module: str | None = None,
    slots: Sequence[str] = SLOTS,
    steps: int = 10_000,
    rank: int = 0,
) -> Report:
    """Replay the last ``steps`` committed steps (0: all) of every module matching ``module``
    under the run's own window and under one with the given fields changed, or under current
    scaling (``recipe="current"``); the rows sorted
    worst first (most overflowing steps under the what-if, then the least headroom)."""
    from pathlib import Path

    from fp8ops.manifest import load_manifest
    from fp8ops.telemetry import open_run

    run_dir = Path(run_dir)
    precision = load_manifest(RunLayout(run_dir).manifest).precision
    if not precision.enabled:
        raise Fp8opsError(f"{run_dir}: FP8 is off in this run; there are no scales to replay")
    refuse_stateless(run_dir, precision)
    telemetry = open_run(run_dir)
    chosen = select_modules(telemetry, module)
    refuse_stateless(run_dir, precision, chosen)
    own = run_window(telemetry, precision)
    other = what_if_setting(
        own,
        recipe,
        history_len=history_len,
        algo=algo,
        margin=margin,
        power_2_scale=power_2_scale,
    )
    last = telemetry.last_step(rank)
    if last is None:
        raise Fp8opsError(f"{run_dir}: no committed telemetry steps yet on rank {rank}")
    start = max(telemetry.first_step, last - steps + 1) if steps else telemetry.first_step
    replays = replay_slots(
        telemetry,
        delayed_modules(precision, chosen),
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
