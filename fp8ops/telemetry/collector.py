"""The collector: one ``[modules, metrics]`` row of telemetry per step, from the model itself.

Reading order: :class:`TelemetryCollector` attaches a :class:`~fp8ops.telemetry.probe.Probe` to
every FP8-capable module; the trainer calls :meth:`begin_step` before the step's first
micro-batch and :meth:`end_step` after its last backward, before the optimizer zeroes the
gradients, and takes the row from the :class:`PendingRow` it returns. The FP8 state has then
been updated for this step, so the row holds the scales the next step will use.

Cadence (``telemetry`` section of the manifest): the scaling state is read every step (it is
there anyway); full cast statistics and norms every ``every_steps`` steps, because they cost
extra passes over every cast tensor; the FP8-vs-reference error every ``error_sample_every``
steps, because it costs one more GEMM per module (over at most ``error_sample_tokens`` tokens).
Unmeasured values are NaN.

On a GPU a row costs one device-to-host copy for the FP8 state of every module, and on
measuring steps one more for the cast counts and one for the norms (tensors on the device until
then). None stops the host: ``end_step`` starts them and returns a :class:`PendingRow`, whose
``result()`` waits for them (the trainer asks after its own per-step sync for the loss, so it
never waits).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from fp8ops.gemm_roles import ALL_GEMMS, cast_roles
from fp8ops.precision.scaling import BWD_GRAD_OUTPUT, FWD_INPUT, FWD_WEIGHT
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES, SLOT_METRICS
from fp8ops.telemetry.probe import Probe

# (slot name in the catalogue, forward?, slot index in the FP8 state)
_SLOTS = (
    ("input", True, FWD_INPUT),
    ("weight", True, FWD_WEIGHT),
    ("grad_output", False, BWD_GRAD_OUTPUT),
)


# Every metric column of each slot (``<slot>.<metric>``).
_SLOT_COLUMNS = {slot: [COLUMN[f"{slot}.{m.name}"] for m in SLOT_METRICS] for slot, _, _ in _SLOTS}


class TelemetryCollector:
    """Per-step telemetry rows for a model's FP8-capable modules (in module order)."""

    def __init__(self, modules: dict, telemetry_cfg):
        """``modules``: FQN -> FP8 linear (``fp8ops.megatron.fp8_modules(model)``);
        ``telemetry_cfg``: the manifest's ``telemetry`` section (``schema.Telemetry``)."""
        self.modules = modules
        self.names = list(modules)
        self.cfg = telemetry_cfg
        # A stateless recipe's modules (current, block, MXFP8; the run's, or a module's own)
        # keep no amax history: their rows read what the step's casts saw (``CastRecord``), and
        # the window metrics do not apply. The two kinds are read apart and put in one row.
        stateless = np.array([m.fp8_meta is None for m in modules.values()], dtype=bool)
        self._delayed = {n: m for n, m in modules.items() if m.fp8_meta is not None}
        self._stateless = {n: m for n, m in modules.items() if m.fp8_meta is None}
        self._delayed_rows, self._stateless_rows = (
            np.flatnonzero(~stateless),
            np.flatnonzero(stateless),
        )
        self._history_len = _history_len(self._delayed)
        self._columns = self._state_columns()
        # The state copy of the last observed row (None before the first): for scale_change.
        self._previous: _HostCopy | None = None
        self.active = False
        self.set_active(True)

    def set_active(self, active: bool) -> None:
        """Attach probes to the modules (True) or remove them, so the model runs unobserved
        (False: :meth:`end_step` then returns an all-NaN row). Benchmarks toggle this."""
        if active != self.active:
            for module in self.modules.values():
                module.probe = Probe(error_tokens=self.cfg.error_sample_tokens) if active else None
            self.active = active

    @contextlib.contextmanager
    def paused(self):
        """Run the model unobserved (an evaluation): its GEMMs, casts and errors must not land
        in the next training step's row. The probes come back empty."""
        was_active = self.active
        self.set_active(False)
        try:
            yield
        finally:
            self.set_active(was_active)

    def seed_previous_scales(self) -> None:
        """After a checkpoint is loaded: the scales it restored are the "previous" ones, so the
        first resumed row reports the same scale change an uninterrupted run would."""
        if self.names:
            self._previous = _HostCopy(self._state_tensor())

    def begin_step(self, step: int) -> None:
        """Set this step's cadence on every probe (``step`` counts from 1)."""
        if not self.active:
            return
        measure = step % self.cfg.every_steps == 0
        sample = step % self.cfg.error_sample_every == 0
        for module in self.modules.values():
            module.probe.measure = measure
            module.probe.sample_error = sample and module.fp8_enabled
        for module in self._stateless.values():
            module.cast_record.clear()
        # A slot's amax is the one it feeds during this step: none yet (one kernel for all).
        # fp8ops' states keep it (ScalingState.last_amax); TE's, read afresh each time, do not.
        tracked = [s.last_amax for s in self._delayed_states() if s.last_amax is not None]
        if tracked:
            torch._foreach_mul_(tracked, math.nan)

    def take_records(self) -> list[Probe]:
        """Every probe's record of the step so far, in module order; the probes start empty."""
        return [module.probe.take() for module in self.modules.values()]

    def end_step(self, records: list[Probe] | None = None) -> PendingRow:
        """This step's row, on its way: every device value it needs is copied to the host
        without waiting for the GPU (:class:`_HostCopy`); :meth:`PendingRow.result` finishes it.

        Call it after the last backward, before the optimizer zeroes the gradients: what the
        row reports is read (on the device) here, and only the copy completes later.

        ``records``: for a step replayed from a CUDA graph, whose forward ran no Python, so the
        probes saw nothing: the records taken (:meth:`take_records`) right after that graph was
        captured, with the step number's cadence. Their GEMM counts are the capture's, which
        every replay repeats, and their tensors are the graph's, which every replay rewrites.
        """
        if not self.active:
            return PendingRow(self, None, None, [], {}, [])
        state = _HostCopy(self._state_tensor())
        casts = _HostCopy(self._cast_tensor()) if self._stateless else None
        if records is None:
            records = self.take_records()
        elif len(records) != len(self.names):
            raise ValueError(f"{len(records)} records for {len(self.names)} modules")
        norms = self._norms(records)
        measured = [
            self._measured(record, norms.get(name, {}))
            for name, record in zip(self.names, records, strict=True)
        ]
        counts = [
            self._counts(module, record) for module, record in zip(self.modules.values(), records)
        ]
        pending = PendingRow(
            self, state, self._previous, measured, _measured_copy(measured), counts, casts
        )
        self._previous = state
        return pending

    def _finish(self, pending: PendingRow) -> np.ndarray:
        """The ``[modules, metrics]`` float32 row of ``pending`` (NaN where nothing was measured)."""
        row = np.full((len(self.names), len(MODULE_METRIC_NAMES)), np.nan, dtype=np.float32)
        if pending.state is None:  # an unobserved step
            return row
        if self._delayed:
            previous = None if pending.previous is None else self._slot_scales(pending.previous)
            metrics = self._state_metrics(self._slot_arrays(pending.state), previous)
            for metric, values in metrics.items():
                row[self._delayed_rows, COLUMN[metric]] = values
        if self._stateless:
            metrics = self._cast_metrics(pending.casts.get().numpy()[:, self._cast_columns()])
            for metric, values in metrics.items():
                row[self._stateless_rows, COLUMN[metric]] = values
        for metric in ("fp8_gemms", "fallback_gemms", "fp8_enabled"):
            row[:, COLUMN[metric]] = [counts[metric] for counts in pending.counts]
        # A tensor no FP8 GEMM of an FP8 module casts (its GEMMs in the base dtype): its slot's
        # state is frozen and nothing was cast, so none of its metrics applies.
        for i, counts in enumerate(pending.counts):
            for slot in counts["uncast"]:
                row[i, _SLOT_COLUMNS[slot]] = np.nan
        measured = _values(pending.measured, pending.measured_copy)
        for i, values in enumerate(measured):
            for metric, value in values.items():  # none on ordinary steps
                row[i, COLUMN[metric]] = value
        return row

    # -- the three kinds of metrics --------------------------------------------------------

    def _delayed_states(self) -> list:
        return [
            module.fp8_meta.direction(forward)
            for forward in (True, False)
            for module in self._delayed.values()
        ]

    def _state_tensor(self) -> torch.Tensor:
        """Every delayed-scaling module's FP8 state in one new ``[L + 2, 5 * modules]`` float32
        tensor on its device (four kernels, however many modules): the amax histories as
        columns, forward slots of every module then backward slots, then the amax each slot
        fed this step's updates (``ScalingState.last_amax``; the newest history entry where
        the state has none, TE's), and their scales as the last row. A new tensor, so the next
        step's updates, made in place, do not reach it."""
        states = self._delayed_states()
        if not states:
            return torch.zeros(self._history_len + 2, 0)
        histories = torch.cat([state.amax_history for state in states], dim=1)
        fed = [s.amax_history[-1] if s.last_amax is None else s.last_amax for s in states]
        scales = torch.cat([state.scale for state in states])
        return torch.cat([histories, torch.cat(fed).unsqueeze(0), scales.unsqueeze(0)])

    def _cast_tensor(self) -> torch.Tensor:
        """``[rows, 3 * modules]``: each stateless module's ``CastRecord`` table side by side."""
        return torch.cat([module.cast_record.table for module in self._stateless.values()], 1)

    def _cast_columns(self) -> np.ndarray:
        """``[modules, slots]``: the column of each stateless module's role in
        :meth:`_cast_tensor` (one per role, in ``_SLOTS`` order)."""
        modules = np.arange(len(self._stateless))[:, None]
        return 3 * modules + np.arange(len(_SLOTS))[None, :]

    def _slot_arrays(self, copy: _HostCopy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """From a :meth:`_state_tensor` copy: ``[modules, slots, L-1]`` float32 amax histories
        without the accumulator row 0, the ``[modules, slots]`` amaxes fed this step, and
        ``[modules, slots]`` float32 scales, slots in ``_SLOTS`` order."""
        table = copy.get().numpy()
        history = table[1:-2, self._columns].transpose(1, 2, 0)
        return history, table[-2, self._columns], table[-1, self._columns]

    def _slot_scales(self, copy: _HostCopy) -> np.ndarray:
        """The scales alone of :meth:`_slot_arrays` (the previous row's, for scale_change)."""
        return copy.get().numpy()[-1, self._columns]

    def _state_columns(self) -> np.ndarray:
        """``[modules, slots]``: the column of each delayed module's slot in
        :meth:`_state_tensor`."""
        modules = np.arange(len(self._delayed))[:, None]
        forward_width, backward_width = 3, 2  # slots per direction (state.py)
        backward_start = forward_width * len(self._delayed)
        return np.concatenate(
            [
                forward_width * modules + index
                if forward
                else backward_start + backward_width * modules + index
                for _, forward, index in _SLOTS
            ],
            axis=1,
        )

    @staticmethod
    def _cast_metrics(table: np.ndarray) -> dict[str, np.ndarray]:
        """A stateless recipe's metrics from its ``CastRecord`` columns (``[rows, modules,
        slots]``): the step's amax and, for a per-tensor scale, the scale; for blocks, their
        scale exponents and the share at the floor. The window metrics and scale_change are
        delayed scaling's and stay NaN (not applicable)."""
        amax, scale, low, median, high, at_floor, blocks = table
        with np.errstate(divide="ignore", invalid="ignore"):  # no live block: NaN, as wanted
            share = np.where(blocks > 0, at_floor / blocks, np.nan).astype(np.float32)
        columns = {
            "amax": amax,
            "scale": scale,
            "scale_inv": np.float32(1.0) / scale,
            "block_exp_min": low,
            "block_exp_median": median,
            "block_exp_max": high,
            "blocks_at_floor": share,
        }
        return {
            f"{slot}.{metric}": values[:, k]
            for metric, values in columns.items()
            for k, (slot, _, _) in enumerate(_SLOTS)
        }

    @staticmethod
    def _state_metrics(
        arrays: tuple[np.ndarray, np.ndarray, np.ndarray], previous_scale: np.ndarray | None
    ) -> dict[str, np.ndarray]:
        """From the delayed-scaling state (:meth:`_slot_arrays`), every module at once: what the
        scales are and what they are based on, ``[modules]`` per metric. ``previous_scale``: the
        last row's scales, for scale_change (None: NaN)."""
        # Vectorised over modules and slots: this runs every step, and a numpy call per module
        # and slot cost more than a percent of a GPU step, which the host has to launch.
        history, fed, scale = arrays
        if not history.shape[0]:  # a model without FP8-capable modules
            return {}
        if not history.shape[-1]:  # amax_history_len 1: the window is the amax fed alone
            history = fed[..., None]
        seen = history > 0  # NaN and zero are no observation
        count = seen.sum(axis=-1)
        # Positive values first, ascending; the +inf filler sorts after them (and equals a +inf
        # amax, which is fine: only the first `count` places are read).
        ordered = np.sort(np.where(seen, history, np.inf), axis=-1)
        scale64 = scale.astype(np.float64)
        if previous_scale is None:
            previous_scale = np.full_like(scale64, np.nan)
        ratio = scale64 / previous_scale.astype(np.float64)
        columns = {
            # NaN where the slot fed no update this step (an all-NaN cast, a weight not cast)
            "amax": np.where(fed > 0, fed, np.nan),
            "scale": scale,
            "scale_inv": np.float32(1.0) / scale,  # one float32 division: correctly rounded
            "window_max": history.max(axis=-1),
            **dict(zip(("window_p50", "window_p90"), _quantiles(ordered, count, (0.5, 0.9)))),
            "scale_change": np.maximum(ratio, 1.0 / ratio),
        }
        return {
            f"{slot}.{metric}": values[:, k]
            for metric, values in columns.items()
            for k, (slot, _, _) in enumerate(_SLOTS)
        }

    def _norms(self, records: list[Probe]) -> dict[str, dict[str, torch.Tensor | float]]:
        """The weight and gradient norms of the modules that measured this step, as float32
        0-dim tensors: one multi-tensor kernel for all weights and one for all gradients."""
        measuring = [
            (name, module)
            for (name, module), record in zip(self.modules.items(), records, strict=True)
            if record.measure
        ]
        weights = [module.weight.detach() for _, module in measuring]
        grads = [module.weight.grad for _, module in measuring if module.weight.grad is not None]
        weight_norms = iter(torch._foreach_norm(weights, 2, dtype=torch.float32) if weights else [])
        grad_norms = iter(torch._foreach_norm(grads, 2, dtype=torch.float32) if grads else [])
        return {
            name: {
                "weight_norm": next(weight_norms),
                "grad_norm": next(grad_norms) if module.weight.grad is not None else math.nan,
            }
            for name, module in measuring
        }

    @staticmethod
    def _measured(record: Probe, norms: dict[str, torch.Tensor | float]) -> dict:
        """What this step measured, still on the device (:class:`_Counts`, :class:`_Norm`):
        saturation, underflow, NaN and Inf over all micro-batches' casts, and the norms."""
        values: dict[str, _Counts | _Norm] = {}
        for slot, _, _ in _SLOTS:
            stats = [log[slot] for log in record.cast_logs if slot in log]
            if stats:
                values[slot] = _Counts(
                    slot, tuple(s.counts for s in stats), sum(s.numel for s in stats)
                )
        norms = {"input_norm": record.input_norm, "fp8_rel_error": record.rel_error} | norms
        for name, norm in norms.items():
            if isinstance(norm, torch.Tensor):  # else NaN: not measured, as the row starts
                values[name] = _Norm(name, (norm,))
        return values

    @staticmethod
    def _counts(module, record: Probe) -> dict:
        # The module's split as it ran this step (an auto-degrade switch comes between steps).
        gemms = getattr(module, "fp8_gemms", ALL_GEMMS)  # TE's modules: all or none
        cast = cast_roles(gemms)
        if getattr(module, "phase_recipe", None) is not None and module.fp8_meta is not None:
            # A phase's recipe casts without the module's delayed-scaling state, which its row
            # reads: frozen, it says nothing of those casts (NaN, as for a module in BF16).
            cast = ()
        return {
            "fp8_gemms": record.fp8_gemms,
            "fallback_gemms": record.fallback_gemms,
            "fp8_enabled": float(module.fp8_enabled),
            "uncast": [s for s, _, _ in _SLOTS if s not in cast] if module.fp8_enabled else [],
        }


@dataclass(frozen=True)
class _Counts:
    """One slot's cast counts (``CastStats.counts``), one device tensor per micro-batch: added up
    on the host, exactly, and saturation and underflow divided there, as Python divides int by
    int (a CUDA tensor divided by a number is multiplied by its reciprocal instead)."""

    slot: str
    tensors: tuple[torch.Tensor, ...]
    numel: int

    def metrics(self, host: list[list[int]]) -> dict[str, float]:
        saturated, underflow, nan, inf = (sum(column) for column in zip(*host, strict=True))
        return {
            f"{self.slot}.saturation": saturated / self.numel,
            f"{self.slot}.underflow": underflow / self.numel,
            f"{self.slot}.nan": nan,
            f"{self.slot}.inf": inf,
        }


@dataclass(frozen=True)
class _Norm:
    """A norm (or ratio of norms) computed on the device, a 0-dim float32 tensor."""

    name: str
    tensors: tuple[torch.Tensor]

    def metrics(self, host: list[float]) -> dict[str, float]:
        return {self.name: host[0]}


class _HostCopy:
    """A tensor on its way to host memory. From a GPU it is copied into pinned memory without
    waiting (``non_blocking``), and :meth:`get` waits for that copy alone: a blocking ``.cpu()``
    would stop the host until the GPU had run everything queued, every step, and a host that
    waits does not queue the next step's kernels (a GPU step of FP8 layers is bound by the host,
    docs/gpu.md). Elsewhere the tensor is already in host memory, or is brought there now."""

    def __init__(self, tensor: torch.Tensor):
        self._ready = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)  # on the tensor's GPU's current stream
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))  # so, that stream
        else:
            self._host = tensor.cpu()

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host


@dataclass
class PendingRow:
    """A step's telemetry row whose device values are still being copied (``end_step``).

    :meth:`result` waits for its copies (only those) and builds the row. It holds copies, not
    the model's tensors, so the row is the step's whenever it is finished; and the previous
    row's state copy, for scale_change, so rows can be finished in any order.
    """

    collector: TelemetryCollector
    state: _HostCopy | None  # None: an unobserved step, an all-NaN row
    previous: _HostCopy | None
    measured: list[dict]  # per module: _Counts / _Norm of device tensors (what was measured)
    measured_copy: dict[tuple, _HostCopy]  # their tensors (_measured_copy)
    counts: list[dict[str, float]]
    casts: _HostCopy | None = None  # the stateless modules' CastRecord tables (_cast_tensor)
    _row: np.ndarray | None = None

    def result(self) -> np.ndarray:
        """The ``[modules, metrics]`` float32 row (waits for this row's copies)."""
        if self._row is None:
            self._row = self.collector._finish(self)
        return self._row


def _history_len(modules: dict) -> int:
    """The amax history length every delayed module shares (one delayed recipe per scope, so
    one length); 1 without any."""
    lengths = {
        module.fp8_meta.direction(forward).amax_history.shape[0]
        for module in modules.values()
        for forward in (True, False)
    }
    if len(lengths) > 1:
        raise ValueError(
            f"the modules' FP8 states have amax histories of {sorted(lengths)} entries; "
            "telemetry reads modules of one recipe (build them from the same manifest)"
        )
    return lengths.pop() if lengths else 1


def _measured_copy(rows: list[dict]) -> dict[tuple, _HostCopy]:
    """Every device tensor of ``rows``' :class:`_Counts` and :class:`_Norm`, on its way to the
    host: one copy for all the tensors of one dtype and shape (the counts, the norms)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for values in rows:
        for value in values.values():
            for tensor in value.tensors:
                groups.setdefault((tensor.dtype, tensor.shape), []).append(tensor)
    return {key: _HostCopy(torch.stack(tensors)) for key, tensors in groups.items()}


def _values(rows: list[dict], copies: dict[tuple, _HostCopy]) -> list[dict[str, float]]:
    """``rows`` with their :class:`_Counts` and :class:`_Norm` replaced by the metrics they
    give, read from ``copies`` (:func:`_measured_copy` of the same rows, so in the same order)."""
    host = {key: iter(copy.get().tolist()) for key, copy in copies.items()}
    finished = []
    for values in rows:
        metrics: dict[str, float] = {}
        for value in values.values():
            metrics |= value.metrics([next(host[(t.dtype, t.shape)]) for t in value.tensors])
        finished.append(metrics)
    return finished


def _quantiles(ordered: np.ndarray, count: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """Linearly interpolated quantiles ``qs`` of the first ``count`` values of each sorted row
    (``[len(qs), *count.shape]``), NaN where ``count`` is 0: ``below + (above - below) * frac``
    in float32 (``np.quantile`` computes some of them the other way round, which can differ by
    an ulp)."""
    last = np.maximum(count - 1, 0)
    position = np.multiply.outer(qs, last)  # float64, as q * (n - 1) in numpy
    low = position.astype(np.int64)
    high = np.minimum(low + 1, last)
    below = np.take_along_axis(ordered[None], low[..., None], axis=-1)[..., 0]
    above = np.take_along_axis(ordered[None], high[..., None], axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):  # inf - inf where the window holds an infinite amax
        value = below + (above - below) * (position - low).astype(np.float32)
    return np.where(count > 0, value, np.float32(np.nan))
