"""The alert rules: one :class:`AlertEngine` per run, fed one telemetry row per step.

The trainer calls :meth:`AlertEngine.observe` with the step's ``[modules, metrics]`` row (the
catalogue's columns, NaN where nothing was measured) and its step metrics. Nothing is read from
disk; the engine keeps only what its windows need (a few ``[window, modules]`` arrays and a
counter or two per condition).

Rules, in the order a step's alerts are reported (Stop first, then Degrade, then Observe):

==================  =======================================================  ==================
rule                condition                                                level
==================  =======================================================  ==================
nonfinite           NaN/Inf in a cast (``<slot>.nan``/``.inf`` > 0), an     stop (observe if
                    infinite amax or scale, a non-finite module gradient     ``nonfinite_stop``
                    norm, or a non-finite step ``loss``/``grad_norm``, or    is false); at once
                    ``update_norm`` of a step not skipped;
                    one alert, naming the first module where it appeared
                    (forward casts in module order, gradients in reverse);
                    where no cast shows it, the first module whose amax
                    jumped (``amax_jump_factor``) since the step before
update_blowup       the step's ``update_norm`` > ``update_blowup_factor`` x  stop, at once
                    the weights' norm before it (``weight_norm``)
divergence          mean loss of the last ``patience_steps`` >               stop, patience
                    ``divergence_factor`` x its lowest value since
                    ``divergence_warmup_steps``
saturation          ``<slot>.saturation`` > a level of ``alerts.saturation`` its level, patience
underflow           ``<slot>.underflow`` > a level of ``alerts.underflow``   its level, patience
scale_jitter        ``<slot>.scale_change`` > a level of                     its level, patience
                    ``alerts.scale_change``
fp8_error           ``fp8_rel_error`` > a level of ``alerts.fp8_rel_error``  its level, patience
                                                                             in samples
fp8_error_growing   the last ``error_growth_samples`` error samples each     degrade
                    larger than the one before, latest >=
                    ``error_growth_floor``
grad_spike          module ``grad_norm`` > ``grad_spike_factor`` x its       degrade, patience
                    median over the window
underflow_rising    newer half of the window's mean underflow >=             observe
                    ``underflow_rise_factor`` x older half's, and >=
                    ``underflow_rise_floor``
amax_jump           ``<slot>.amax`` > ``amax_jump_factor`` x the previous    observe, at once
                    step's ``<slot>.window_max`` (``<slot>.amax`` under
                    ``most_recent``: what the scale is computed from);
                    delayed scaling's modules only
blocks_at_floor     ``<slot>.blocks_at_floor`` > a level of                  its level, patience
                    ``alerts.blocks_at_floor`` (block recipes only)
==================  =======================================================  ==================

Modules held in the base dtype have no casts and no scales in use: every rule skips them except
``grad_spike`` and the gradient part of ``nonfinite``. An alert fires once when its condition starts holding and again only
after the condition has been false for ``patience_steps`` steps (samples, for the sampled
error): a value hovering at a threshold does not repeat itself every few steps. When one step
takes a condition past several levels at once, only the highest is reported.

"Steps" are the steps the engine observes. A NaN cell means "not measured": it neither extends
nor breaks a streak, so metrics measured every N steps count patience in measurements, and the
windows (rising underflow, gradient median) hold measured steps only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fp8ops.alerts.policy import gemms_to_switch
from fp8ops.alerts.records import (
    LEVELS,
    SEVERITY,
    Alert,
    Level,
    Proposal,
    check_level,
    format_value,
)
from fp8ops.manifest.schema import Alerts, Levels
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES, SLOTS

# Threshold rules added after alert windows were first checkpointed: a checkpoint saved before
# one existed has none of its latches, and resumes with that rule afresh.
_ADDED_RULES = frozenset({"blocks_at_floor"})
# Threshold rules that pass Degrade on their way to Stop: their Stop also proposes an override.
_PROPOSING_STOPS = frozenset(
    {"saturation", "underflow", "scale_jitter", "fp8_error", "blocks_at_floor"}
)
_FORWARD = tuple(slot for slot in SLOTS if slot != "grad_output")
_BACKWARD = ("grad_output",)


def _proposes(alert: Alert) -> bool:
    """A Degrade alert, or a Stop alert of a rule that passes Degrade on its way up."""
    return alert.level == "degrade" or (alert.level == "stop" and alert.rule in _PROPOSING_STOPS)


def _columns(metric: str, slots: Sequence[str] = SLOTS) -> list[int]:
    return [COLUMN[f"{slot}.{metric}"] for slot in slots]


def _py(value: Any) -> float:
    """A float32 cell as the shortest Python float that reads back as the same float32."""
    return float(str(np.float32(value)))


class _Latch:
    """Once-until-cleared bookkeeping for one condition over an array of keys.

    ``streak`` counts consecutive known observations where the condition held, ``calm`` those
    where it did not (both capped: only "reached" matters); ``open`` marks keys that fired and
    have not cleared. An unknown observation (nothing measured) changes nothing.
    """

    def __init__(self, shape: tuple[int, ...], patience: int, clear_after: int):
        self.patience, self.clear_after = patience, clear_after
        self.streak = np.zeros(shape, np.int32)
        self.calm = np.zeros(shape, np.int32)
        self.open = np.zeros(shape, bool)

    def update(self, held: np.ndarray, known: np.ndarray) -> np.ndarray:
        """Advance one observation; return where the alert fires now."""
        held = held & known
        quiet = known & ~held
        self.streak = np.where(held, np.minimum(self.streak + 1, self.patience), self.streak)
        self.streak[quiet] = 0
        self.calm = np.where(quiet, np.minimum(self.calm + 1, self.clear_after), self.calm)
        self.calm[held] = 0
        self.open &= ~(self.calm >= self.clear_after)
        fired = held & ~self.open & (self.streak >= self.patience)
        self.open |= fired
        return fired

    def rearm(self, where: np.ndarray) -> None:
        """Forget the streaks and open alerts of the keys ``where`` selects (a boolean mask)."""
        self.streak[where], self.calm[where], self.open[where] = 0, 0, False


class _Leveled:
    """One metric (per module and slot) against the observe/degrade/stop levels of a section."""

    def __init__(self, levels: Levels, shape: tuple[int, ...], patience: int):
        self.latches: dict[Level, tuple[np.float32, _Latch]] = {
            level: (np.float32(getattr(levels, level)), _Latch(shape, patience, patience))
            for level in LEVELS
            if getattr(levels, level) is not None
        }

    def update(self, values: np.ndarray, active: np.ndarray) -> dict[Level, np.ndarray]:
        known = active & ~np.isnan(values)
        fired = {
            level: latch.update(values > threshold, known)
            for level, (threshold, latch) in self.latches.items()
        }
        # Several levels reached at once: report the highest; the lower ones stay open (their
        # latches fired), so they do not fire on a later step either.
        higher = np.zeros(values.shape, bool)
        for level in reversed(LEVELS):
            if level in fired:
                fired[level] = fired[level] & ~higher
                higher |= fired[level]
        return fired


class AlertEngine:
    """Evaluates the manifest's alert rules on each step's telemetry, in memory.

    ``modules`` are the row order of the telemetry (module FQNs); ``fp8_enabled`` says which of
    them run FP8: the others are skipped by the FP8-only rules. ``amax_compute_algo`` (the
    manifest's) says what the scales are computed from, which ``amax_jump`` compares with: the
    last amax under ``most_recent``, else the window max (an upper bound of every statistic).
    ``delayed`` says which modules scale from an amax history (delayed scaling; all of them
    when not given): ``amax_jump`` judges only those, since a stateless recipe scales each cast
    by its own amax and a jump cannot make it clip. ``other_stages``: under pipeline
    parallelism, the other stages' modules and whether each runs FP8, so that every rank proposes overrides (:meth:`proposals`) for any stage's alerts
    alike.
    """

    def __init__(
        self,
        config: Alerts,
        modules: Sequence[str],
        fp8_enabled: Sequence[bool],
        *,
        amax_compute_algo: str = "max",
        delayed: Sequence[bool] | None = None,
        other_stages: Mapping[str, bool] | None = None,
    ):
        self.config = config
        self.other_stages = dict(other_stages or {})
        self._jump_base = "amax" if amax_compute_algo == "most_recent" else "window_max"
        self.modules = tuple(modules)
        self.fp8 = np.array(list(fp8_enabled), dtype=bool)
        if self.fp8.shape != (len(self.modules),):
            raise ValueError(
                f"fp8_enabled has {self.fp8.size} entries for {len(self.modules)} modules"
            )
        self.delayed = np.ones_like(self.fp8) if delayed is None else np.array(delayed, bool)
        if self.delayed.shape != self.fp8.shape:
            raise ValueError(f"delayed has {self.delayed.size} entries for {self.fp8.size} modules")
        n, slots, patience = len(self.modules), len(SLOTS), config.patience_steps
        window = config.window_steps
        self._leveled = {
            "saturation": (
                _columns("saturation"),
                _Leveled(config.saturation, (n, slots), patience),
            ),
            "underflow": (_columns("underflow"), _Leveled(config.underflow, (n, slots), patience)),
            "scale_jitter": (
                _columns("scale_change"),
                _Leveled(config.scale_change, (n, slots), patience),
            ),
            "fp8_error": (
                [COLUMN["fp8_rel_error"]],
                _Leveled(config.fp8_rel_error, (n, 1), patience),
            ),
            # Block recipes only; NaN (never measured) elsewhere, which no level judges.
            "blocks_at_floor": (
                _columns("blocks_at_floor"),
                _Leveled(config.blocks_at_floor, (n, slots), patience),
            ),
        }
        self._nonfinite = _Latch((), 1, patience)
        self._divergence = _Latch((), patience, patience)
        self._rising = _Latch((n, slots), 1, patience)
        self._growing = _Latch((n,), 1, patience)
        self._spike = _Latch((n,), patience, patience)
        self._jump = _Latch((n, slots), 1, patience)
        # Windows of measured steps, oldest overwritten first.
        self._underflow = np.full((window, n, slots), np.nan, np.float32)
        self._underflow_rows = 0
        self._grads = np.full((window, n), np.nan, np.float32)
        self._grad_rows = 0
        self._errors = np.full((n, config.error_growth_samples), np.nan, np.float32)
        self._error_samples = np.zeros(n, np.int32)
        self._previous_base = np.full((n, slots), np.nan, np.float32)
        # Each slot's last measured amax, for naming where a non-finite step began.
        self._previous_amax = np.full((n, slots), np.nan, np.float32)
        self._observed = 0
        self.fresh_rules: list[str] = []  # rules a loaded state had no windows of
        self._lowest_loss = np.inf  # of the smoothed loss
        self._recent_losses: deque[float] = deque(maxlen=config.patience_steps)

    # -- the step -------------------------------------------------------------------------------

    def observe(
        self, step: int, module_values: np.ndarray, step_values: Mapping[str, float]
    ) -> list[Alert]:
        """The alerts that start at ``step`` (Stop first), given its telemetry row."""
        rows = np.asarray(module_values, dtype=np.float32)
        expected = (len(self.modules), len(MODULE_METRIC_NAMES))
        if rows.shape != expected:
            raise ValueError(f"telemetry row has shape {rows.shape}; expected {expected}")
        alerts = [
            *self._check_nonfinite(step, rows, step_values),
            *self._check_update_blowup(step, step_values),
            *self._check_divergence(step, step_values),
            *self._check_levels(step, rows),
            *self._check_error_growth(step, rows),
            *self._check_grad_spike(step, rows),
            *self._check_underflow_rising(step, rows),
            *self._check_amax_jump(step, rows),
        ]
        amax = rows[:, _columns("amax")]
        self._previous_amax = np.where(np.isfinite(amax) & (amax > 0), amax, self._previous_amax)
        self._observed += 1
        return sorted(alerts, key=lambda alert: -SEVERITY[alert.level])  # stable: rule order kept

    def report(
        self,
        step: int,
        rule: str,
        level: str,
        message: str,
        module: str | None = None,
        metric: str | None = None,
        value: float | None = None,
        threshold: float | None = None,
    ) -> Alert:
        """An alert for a condition the trainer detects itself (e.g. ranks' scales disagree)."""
        return Alert(
            step=step,
            level=check_level(level),
            rule=rule,
            module=module,
            metric=metric,
            value=None if value is None else float(value),
            threshold=None if threshold is None else float(threshold),
            message=message,
        )

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """The windows, latches and loss memory as arrays of fixed shapes, so a checkpoint
        resumes alerting mid-window. (Open proposals are not here: the ledger holds them.)"""
        state = {
            "underflow": self._underflow,
            "underflow_rows": np.array(self._underflow_rows, np.int64),
            "grads": self._grads,
            "grad_rows": np.array(self._grad_rows, np.int64),
            "errors": self._errors,
            "error_samples": self._error_samples,
            "previous_window_max": self._previous_base,  # the name older checkpoints hold
            "previous_amax": self._previous_amax,
            "observed": np.array(self._observed, np.int64),
            "lowest_loss": np.array(self._lowest_loss, np.float64),
            "recent_losses": np.array(
                list(self._recent_losses)
                + [np.nan] * (self._recent_losses.maxlen - len(self._recent_losses)),
                np.float64,
            ),
            "recent_count": np.array(len(self._recent_losses), np.int64),
        }
        for name, latch in self._latches().items():
            state[f"{name}.streak"] = latch.streak
            state[f"{name}.calm"] = latch.calm
            state[f"{name}.open"] = latch.open.astype(np.uint8)
        return {k: np.array(v, copy=True) for k, v in state.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Continue from ``state``. The rules added since it was saved (``_ADDED_RULES`` of
        which it has no latch) start afresh and are listed in :attr:`fresh_rules`; any other
        missing or misshapen entry is refused."""
        expected = self.state_dict()
        fresh = [
            rule
            for rule, (_, leveled) in self._leveled.items()
            if rule in _ADDED_RULES
            and not any(f"{rule}.{level}.open" in state for level in leveled.latches)
        ]
        expected = {k: v for k, v in expected.items() if k.split(".")[0] not in fresh}
        if "previous_amax" not in state:  # saved before it was kept: nothing measured yet
            state = {**state, "previous_amax": np.full_like(expected["previous_amax"], np.nan)}
        for key, value in expected.items():
            if key not in state or np.shape(state[key]) != value.shape:
                raise ValueError(
                    f"alert state {key!r}: missing or shaped {np.shape(state.get(key))}, expected "
                    f"{value.shape} (the alert configuration or module list changed)"
                )
        self._underflow = state["underflow"].astype(np.float32)
        self._underflow_rows = int(state["underflow_rows"])
        self._grads = state["grads"].astype(np.float32)
        self._grad_rows = int(state["grad_rows"])
        self._errors = state["errors"].astype(np.float32)
        self._error_samples = state["error_samples"].astype(np.int32)
        self._previous_base = state["previous_window_max"].astype(np.float32)
        self._previous_amax = state["previous_amax"].astype(np.float32)
        self._observed = int(state["observed"])
        self._lowest_loss = float(state["lowest_loss"])
        count = int(state["recent_count"])
        self._recent_losses.clear()
        self._recent_losses.extend(float(x) for x in state["recent_losses"][:count])
        for name, latch in self._latches().items():
            if name.split(".")[0] in fresh:
                continue
            latch.streak = state[f"{name}.streak"].astype(np.int32)
            latch.calm = state[f"{name}.calm"].astype(np.int32)
            latch.open = state[f"{name}.open"].astype(bool)
        self._rearm_after_resume()
        self.fresh_rules = fresh

    def _rearm_after_resume(self) -> None:
        """What a resumed run must hear again, unlike the straight run it otherwise continues.

        * Stop conditions: the checkpoint of a Stop is saved with its alert open, and an open
          alert fires again only after its condition has cleared. A resume whose fix did not
          work (or no fix) would then train on through the same NaN or saturation in silence.
          A Stop that held on is reported again after its patience, and stops the run again.
        * Modules held in BF16 by an override: their FP8 history (open alerts, windows, the last
          window max) is from before the override. Forgotten, so a module lifted back to FP8
          later starts afresh instead of under alerts that can never clear.
        """
        stops = [self._divergence] + ([self._nonfinite] if self.config.nonfinite_stop else [])
        for _, leveled in self._leveled.values():
            stops += [latch for level, (_, latch) in leveled.latches.items() if level == "stop"]
        for latch in stops:
            latch.rearm(latch.open.copy())  # only the open ones: the rest continue as before
        self._forget(~self.fp8)

    def forget(self, modules: Iterable[str]) -> None:
        """``modules`` run some of their GEMMs in BF16 from the next step on (an auto-degrade
        switch of some GEMMs): they stay FP8 for the rules, which judge the slots their FP8
        GEMMs still cast, and their FP8 history is forgotten, as :meth:`hold` forgets it."""
        self._forget(np.isin(np.array(self.modules), list(modules)))

    def hold(self, modules: Iterable[str]) -> None:
        """``modules`` run in BF16 from the next step on (an auto-degrade switch): the FP8-only
        rules skip them, and their FP8 history is forgotten, as a resume forgets it for a module
        held by an override, so a switched run and its resume judge alike."""
        modules = list(modules)
        held = np.isin(np.array(self.modules), modules)
        self.fp8 = self.fp8 & ~held
        self._forget(held)
        for module in modules:
            if module in self.other_stages:
                self.other_stages[module] = False

    def release(self, modules: Iterable[str]) -> None:
        """``modules`` run FP8 again from the next step on (a phase of the precision schedule
        ended): the FP8-only rules judge them again, from a history that starts empty, as
        after :meth:`hold`."""
        modules = list(modules)
        back = np.isin(np.array(self.modules), modules)
        self.fp8 = self.fp8 | back
        self._forget(back)
        for module in modules:
            if module in self.other_stages:
                self.other_stages[module] = True

    def _forget(self, held: np.ndarray) -> None:
        for _, leveled in self._leveled.values():
            for _, latch in leveled.latches.values():
                latch.rearm(held)
        for latch in (self._rising, self._growing, self._jump):
            latch.rearm(held)
        self._underflow[:, held] = np.nan
        self._errors[held], self._error_samples[held] = np.nan, 0
        self._previous_base[held] = np.nan
        self._previous_amax[held] = np.nan

    def _latches(self) -> dict[str, _Latch]:
        latches = {
            "nonfinite": self._nonfinite,
            "divergence": self._divergence,
            "rising": self._rising,
            "growing": self._growing,
            "spike": self._spike,
            "jump": self._jump,
        }
        for rule, (_, leveled) in self._leveled.items():
            for level, (_, latch) in leveled.latches.items():
                latches[f"{rule}.{level}"] = latch
        return latches

    # -- override proposals -----------------------------------------------------------------------

    def proposals(self, alerts: Iterable[Alert | Mapping[str, Any]]) -> list[Proposal]:
        """Override proposals for the Degrade alerts among ``alerts`` (Alerts or their JSON).

        One per FP8 module: its most severe alert. Stop alerts of the threshold rules propose
        too (they passed Degrade on the way). Modules held in the base dtype are never proposed.
        A module that has an open override already gets none: the ledger refuses a second one
        (``Ledger.propose``), so one rejected or revoked can be proposed again when its alert
        fires again.
        """
        alerts = [a if isinstance(a, Alert) else Alert.from_json(a) for a in alerts]
        fp8 = self.other_stages | dict(zip(self.modules, self.fp8.tolist(), strict=True))
        # Under an auto-degrade policy of granularity gemm, a proposal its policy acts on names
        # the GEMMs that read the alerted tensors (policy.py); every other, the whole module.
        policy = self.config.auto_degrade
        proposing = [a for a in alerts if _proposes(a)]
        new: dict[str, Proposal] = {}
        for alert in sorted(alerts, key=lambda a: -SEVERITY[a.level]):
            module = alert.module
            if not _proposes(alert) or module is None or not fp8.get(module, True):
                continue
            if module in new:
                continue
            metrics = {
                a.metric: a.value
                for a in alerts
                if a.module == module and a.metric is not None and a.step == alert.step
            }
            gemms = None
            if policy is not None and policy.acts_on(alert.rule, alert.step):
                mine = [a for a in proposing if a.module == module and a.step == alert.step]
                gemms = gemms_to_switch(policy, mine)
            new[module] = Proposal(
                alert.step, module, alert.message, metrics, rule=alert.rule, gemms=gemms
            )
        return list(new.values())

    # -- rules --------------------------------------------------------------------------------

    def _alert(self, step, level, rule, index, metric, value, threshold, message) -> Alert:
        return Alert(
            step=step,
            level=level,
            rule=rule,
            module=None if index is None else self.modules[index],
            metric=metric,
            value=None if value is None else _py(value),
            threshold=None if threshold is None else _py(threshold),
            message=message,
        )

    def _for_steps(self, patience: int, unit: str = "steps") -> str:
        return f" for {patience} consecutive {unit}" if patience > 1 else ""

    def _check_nonfinite(self, step, rows, step_values) -> list[Alert]:
        """NaN/Inf anywhere: one alert naming where it appeared first.

        The forward pass runs in module order, so of the modules whose forward casts saw NaN or
        Inf the first is where it entered; the backward pass runs in reverse, so for gradients
        the last module in module order is the first to see them.
        """
        cells = self._nonfinite_cells(rows, step_values)
        loss, grad_norm = step_values.get("loss"), step_values.get("grad_norm")
        # Finite gradients can still step the weights past the float range (a learning rate
        # far too high): a non-finite update. A skipped step made none (its norm is NaN).
        update = None if step_values.get("skipped") else step_values.get("update_norm")
        run_level = [
            (name, value)
            for name, value in (("loss", loss), ("grad_norm", grad_norm), ("update_norm", update))
            if value is not None and not np.isfinite(value)
        ]
        held = bool(cells) or bool(run_level)
        if not self._nonfinite.update(np.array(held), np.array(True)):
            return []
        level: Level = "stop" if self.config.nonfinite_stop else "observe"
        also = [f"the step's {name} is {format_value(value)}" for name, value in run_level]
        if cells:
            (index, metric, value, order), affected = cells[0], len({c[0] for c in cells})
            limit = "above 0" if metric.endswith((".nan", ".inf")) else "not finite"
            if affected > 1:
                also.insert(0, f"{affected} of {len(self.modules)} modules affected")
            message = (
                f"Step {step}: {self.modules[index]} {metric} was {format_value(value)}, "
                f"{limit}: the first non-finite value of the step in {order} order"
                + (f" ({'; '.join(also)})" if also else "")
                + "."
            )
            threshold = 0.0 if limit == "above 0" else None
            return [self._alert(step, level, "nonfinite", index, metric, value, threshold, message)]
        name, value = run_level[0]
        if name == "update_norm":  # the step's forward and backward were finite: no module to name
            message = (
                f"Step {step}: the optimizer's update had norm {format_value(value)}, not "
                "finite, from finite gradients: the step left non-finite weights (a learning "
                "rate far too high, without optimizer.clip_grad). Stopped before the next step "
                "trains on them; an earlier checkpoint (or the base) holds finite weights."
            )
            return [self._alert(step, level, "nonfinite", None, name, value, None, message)]
        message = f"Step {step}: the run's {name} was {format_value(value)}, not finite" + (
            f" ({'; '.join(also[1:])})" if len(also) > 1 else ""
        )
        jumps = self._amax_jumps(rows)
        if not jumps:
            message += "; no module's telemetry shows where it started."
            return [self._alert(step, level, "nonfinite", None, name, value, None, message)]
        # No cast counted a NaN or Inf (or none was measured this step), but amaxes jumped:
        # the first module they jumped in is where the step's values left their range.
        index, j, before, now = jumps[0]
        metric, factor = f"{SLOTS[j]}.amax", self.config.amax_jump_factor
        modules = len({i for i, *_ in jumps})
        message += (
            f"; no cast counted it, but amaxes jumped first in {self.modules[index]}: {metric} "
            f"{format_value(_py(before))} -> {format_value(_py(now))} "
            f"({format_value(_py(now / before))}x, above amax_jump_factor {factor:g}) since the "
            f"step before, the first jump in module order ({modules} of {len(self.modules)} "
            "modules jumped"
            + (
                "; all at once, as when an optimizer step blows up the weights"
                if modules > 1
                else ""
            )
            + ")."
        )
        threshold = factor * before
        return [self._alert(step, level, "nonfinite", index, metric, now, threshold, message)]

    def _amax_jumps(self, rows) -> list[tuple[int, int, float, float]]:
        """(module index, slot index, previous amax, amax) of every forward cast whose amax
        this step is above ``amax_jump_factor`` x the last one measured, in module order."""
        amax, previous = rows[:, _columns("amax")], self._previous_amax
        with np.errstate(invalid="ignore", over="ignore"):
            jumped = np.isfinite(amax) & (
                amax > np.float32(self.config.amax_jump_factor) * previous
            )
        forward = [SLOTS.index(slot) for slot in _FORWARD]
        return [
            (int(i), int(j), float(previous[i, j]), float(amax[i, j]))
            for i, j in np.argwhere(jumped & self.fp8[:, None])
            if j in forward
        ]

    def _check_update_blowup(self, step, step_values) -> list[Alert]:
        """An optimizer step far larger than the weights it changed: a Stop before the next
        step trains on them (every time it holds: a blown-up step is never routine)."""
        factor = self.config.update_blowup_factor
        update, weights = step_values.get("update_norm"), step_values.get("weight_norm")
        if factor is None or update is None or weights is None:
            return []
        if not (np.isfinite(update) and np.isfinite(weights) and weights > 0):
            return []  # a skipped step changed nothing; a non-finite update is nonfinite's
        if update <= factor * weights:
            return []
        message = (
            f"Step {step}: the optimizer's update had norm {format_value(update)}, "
            f"{format_value(update / weights)}x the norm of the weights it changed "
            f"({format_value(weights)}), above update_blowup_factor {factor:g}: the step "
            "replaced the weights instead of adjusting them (a learning rate far too high, or a "
            "corrupted gradient). Stopped before the next step trains on them; this step's "
            "checkpoint holds the weights after the update, an earlier checkpoint (or the base) "
            "those before it."
        )
        threshold = factor * weights
        return [
            self._alert(
                step, "stop", "update_blowup", None, "update_norm", update, threshold, message
            )
        ]

    def _nonfinite_cells(self, rows, step_values) -> list[tuple[int, str, float, str]]:
        """(module index, metric, value, pass) of every non-finite cell, first appearance first."""

        def slot_cells(slots: Sequence[str]) -> list[tuple[int, str, float]]:
            counts = [f"{s}.{m}" for s in slots for m in ("nan", "inf")]
            infinite = [f"{s}.{m}" for s in slots for m in ("amax", "scale", "scale_inv")]
            names = counts + infinite
            cells = rows[:, [COLUMN[name] for name in names]]
            bad = np.concatenate(
                [cells[:, : len(counts)] > 0, np.isinf(cells[:, len(counts) :])], axis=1
            )
            return [(int(i), names[j], float(cells[i, j])) for i, j in np.argwhere(bad & fp8)]

        fp8 = self.fp8[:, None]
        forward = slot_cells(_FORWARD)
        # A module gradient norm is NaN also when it was not measured this step; it is
        # non-finite data only when it is infinite, or NaN while the global norm is non-finite
        # too (one non-finite gradient makes the global norm so).
        grads = rows[:, COLUMN["grad_norm"]]
        global_norm = step_values.get("grad_norm")
        global_bad = global_norm is not None and not np.isfinite(global_norm)
        measured = ~np.isnan(rows[:, COLUMN["weight_norm"]])
        bad_grad = np.isinf(grads) | (np.isnan(grads) & measured & global_bad)
        backward = slot_cells(_BACKWARD) + [
            (int(i), "grad_norm", float(grads[i])) for i in np.flatnonzero(bad_grad)
        ]
        # Forward: module order. Backward: from the last module, its grad_output first.
        backward.sort(key=lambda cell: (-cell[0], cell[1] == "grad_norm"))
        return [(*cell, "forward") for cell in forward] + [(*cell, "backward") for cell in backward]

    def _check_divergence(self, step, step_values) -> list[Alert]:
        loss = step_values.get("loss")
        if (
            loss is None
            or not np.isfinite(loss)
            or self._observed < self.config.divergence_warmup_steps
        ):
            return []
        # A mean over the last patience_steps losses, not one batch's: on mixed fine-tuning
        # batches a single easy batch would otherwise set a floor ordinary batches exceed.
        self._recent_losses.append(float(loss))
        if len(self._recent_losses) < self._recent_losses.maxlen:
            return []
        loss = sum(self._recent_losses) / len(self._recent_losses)
        lowest, factor = self._lowest_loss, self.config.divergence_factor
        self._lowest_loss = min(lowest, loss)
        known = bool(np.isfinite(lowest) and lowest > 0)
        threshold = factor * lowest if known else np.inf
        if not self._divergence.update(np.array(loss > threshold), np.array(known)):
            return []
        patience = self.config.patience_steps
        message = (
            f"Step {step}: the run's loss (mean of the last {patience} steps) was "
            f"{format_value(loss)}, above {factor:g}x its lowest {format_value(lowest)} "
            f"(threshold {format_value(threshold)})"
            f"{self._for_steps(patience)}: the run is diverging."
        )
        return [self._alert(step, "stop", "divergence", None, "loss", loss, threshold, message)]

    def _check_levels(self, step, rows) -> list[Alert]:
        alerts = []
        patience = self.config.patience_steps
        for rule, (columns, leveled) in self._leveled.items():
            values = rows[:, columns]
            # Cast statistics are measured every telemetry.every_steps: patience counts those.
            unit = {"fp8_error": "samples", "scale_jitter": "steps"}.get(rule, "measured steps")
            for level, fired in leveled.update(values, self.fp8[:, None]).items():
                threshold = float(leveled.latches[level][0])
                for i, j in np.argwhere(fired):
                    metric = MODULE_METRIC_NAMES[columns[j]]
                    message = (
                        f"Step {step}: {self.modules[i]} {metric} was "
                        f"{format_value(_py(values[i, j]))}, above the {level} level "
                        f"{threshold:.6g}{self._for_steps(patience, unit)}."  # as written
                    )
                    alerts.append(
                        self._alert(step, level, rule, i, metric, values[i, j], threshold, message)
                    )
        return alerts

    def _check_error_growth(self, step, rows) -> list[Alert]:
        """fp8_rel_error rising sample after sample: FP8 is losing this layer."""
        errors = rows[:, COLUMN["fp8_rel_error"]]
        sampled = self.fp8 & ~np.isnan(errors)
        self._errors[sampled] = np.roll(self._errors[sampled], -1, axis=1)
        self._errors[sampled, -1] = errors[sampled]
        self._error_samples[sampled] += 1
        count, floor = self.config.error_growth_samples, self.config.error_growth_floor
        full = sampled & (self._error_samples >= count)
        rising = np.all(np.diff(self._errors, axis=1) > 0, axis=1)
        held = rising & (self._errors[:, -1] >= np.float32(floor))
        alerts = []
        for i in np.flatnonzero(self._growing.update(held, full)):
            history = " -> ".join(format_value(_py(v)) for v in self._errors[i])
            message = (
                f"Step {step}: {self.modules[i]} fp8_rel_error grew over its last {count} "
                f"samples ({history}) to {format_value(_py(errors[i]))}, at or above the floor "
                f"{format_value(floor)}."
            )
            rule, value = "fp8_error_growing", errors[i]
            alerts.append(
                self._alert(step, "degrade", rule, i, "fp8_rel_error", value, floor, message)
            )
        return alerts

    def _check_grad_spike(self, step, rows) -> list[Alert]:
        """A module's gradient norm far above its recent median (measured steps only)."""
        grads = rows[:, COLUMN["grad_norm"]]
        if np.all(np.isnan(grads)):  # not measured this step
            return []
        window, factor = self.config.window_steps, self.config.grad_spike_factor
        counts = np.sum(~np.isnan(self._grads), axis=0)
        ready = counts >= max(2, window // 2)
        median = np.full(len(self.modules), np.nan, np.float32)
        if ready.any():
            median[ready] = np.nanmedian(self._grads[:, ready], axis=0)
        threshold = np.float32(factor) * median
        known = ready & np.isfinite(grads) & (median > 0)
        with np.errstate(invalid="ignore"):
            fired = self._spike.update(grads > threshold, known)
        self._grads[self._grad_rows % window] = np.where(np.isfinite(grads), grads, np.nan)
        self._grad_rows += 1
        alerts = []
        for i in np.flatnonzero(fired):
            message = (
                f"Step {step}: {self.modules[i]} grad_norm was {format_value(_py(grads[i]))}, "
                f"above {factor:g}x its median {format_value(_py(median[i]))} over the last "
                f"{counts[i]} measured steps (threshold {format_value(_py(threshold[i]))})"
                f"{self._for_steps(self.config.patience_steps)}."
            )
            alerts.append(
                self._alert(
                    step, "degrade", "grad_spike", i, "grad_norm", grads[i], threshold[i], message
                )
            )
        return alerts

    def _check_underflow_rising(self, step, rows) -> list[Alert]:
        """The zero-value ratio trending up: the newer half of the window against the older."""
        underflow = rows[:, _columns("underflow")]
        if np.all(np.isnan(underflow)):  # not measured this step
            return []
        window = self.config.window_steps
        self._underflow[self._underflow_rows % window] = underflow
        self._underflow_rows += 1
        if self._underflow_rows < window:
            return []
        start = self._underflow_rows % window  # the oldest row
        chronological = np.roll(self._underflow, -start, axis=0)
        half = window // 2
        older, older_n = _mean(chronological[:half])
        newer, newer_n = _mean(chronological[half:])
        factor, floor = self.config.underflow_rise_factor, self.config.underflow_rise_floor
        threshold = np.maximum(np.float32(factor) * older, np.float32(floor))
        known = self.fp8[:, None] & (older_n > 0) & (newer_n > 0)
        with np.errstate(invalid="ignore"):
            fired = self._rising.update(newer >= threshold, known)
        alerts = []
        for i, j in np.argwhere(fired):
            metric = f"{SLOTS[j]}.underflow"
            message = (
                f"Step {step}: {self.modules[i]} {metric} is rising: its mean was "
                f"{format_value(_py(newer[i, j]))} over the last {window - half} measured steps "
                f"against {format_value(_py(older[i, j]))} over the {half} before, at or above "
                f"{factor:g}x that and the floor {format_value(floor)} "
                f"(threshold {format_value(_py(threshold[i, j]))})."
            )
            value, limit = newer[i, j], threshold[i, j]
            alerts.append(
                self._alert(step, "observe", "underflow_rising", i, metric, value, limit, message)
            )
        return alerts

    def _base_name(self, i: int, j: int, rows: np.ndarray) -> str:
        """What module ``i``'s slot ``j`` scales by, as the jump message says it."""
        if self._jump_base == "window_max" and not np.isnan(rows[i, _columns("window_max")][j]):
            return "window max"
        return "amax"

    def _check_amax_jump(self, step, rows) -> list[Alert]:
        """Early warning: this step's amax far above what its scale was computed from."""
        amax = rows[:, _columns("amax")]
        previous = self._previous_base
        factor = self.config.amax_jump_factor
        threshold = np.float32(factor) * previous
        known = (self.fp8 & self.delayed)[:, None] & np.isfinite(amax) & np.isfinite(previous)
        known &= previous > 0
        with np.errstate(invalid="ignore"):
            fired = self._jump.update(amax > threshold, known)
        base = rows[:, _columns(self._jump_base)]
        self._previous_base = np.where(np.isnan(base), previous, base)
        alerts = []
        for i, j in np.argwhere(fired):
            metric = f"{SLOTS[j]}.amax"
            message = (
                f"Step {step}: {self.modules[i]} {metric} was {format_value(_py(amax[i, j]))}, "
                f"above {factor:g}x the previous step's {self._base_name(i, j, rows)} "
                f"{format_value(_py(previous[i, j]))} (threshold "
                f"{format_value(_py(threshold[i, j]))}): the scale in use was set from that "
                f"value, {factor:g}x below, so the cast clipped unless the margin leaves that "
                "much headroom."
            )
            alerts.append(
                self._alert(
                    step, "observe", "amax_jump", i, metric, amax[i, j], threshold[i, j], message
                )
            )
        return alerts


def _mean(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over axis 0 ignoring NaN, and how many values it took (0: the mean is NaN)."""
    count = np.sum(~np.isnan(block), axis=0)
    total = np.nansum(block, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan).astype(np.float32), count
