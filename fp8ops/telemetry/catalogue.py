"""Every telemetry metric, defined once: its name, unit and meaning.

The store's columns, the reader's labels, the alert rules and the console all take their names
from here; the store records the catalogue in its attributes, so a reader needs no code version
to label what it reads.

Module metrics are one row per FP8-capable module per step (a ``[modules, metrics]`` array).
For each FP8 slot a module uses (``input`` and ``weight`` in forward, ``grad_output`` in
backward) there are the same fifteen metrics, named ``<slot>.<metric>``; then seven metrics of the
module itself. Step metrics are one row per step for the whole run. Values are float32; a
metric with nothing to report this step (an unsampled error, a BF16 module's saturation) is NaN,
and so is every metric of a slot no FP8 GEMM of an FP8 module reads (its GEMMs in the base
dtype, ``fp8ops.gemm_roles``): not applicable, never 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    meaning: str


SLOTS = ("input", "weight", "grad_output")

SLOT_METRICS = (
    Metric(
        "amax",
        "|value|",
        "The newest history entry, after the reduction: for input and grad_output the step's "
        "last micro-batch (their histories roll per micro-batch), for weight the step's cast.",
    ),
    Metric(
        "scale", "factor", "The scale in use after this step's update (fp8_max / amax / 2^margin)."
    ),
    Metric(
        "scale_inv",
        "factor",
        "1 / scale in float32, correctly rounded (as TE's cast computes it): what dequantisation "
        "multiplies by.",
    ),
    Metric(
        "window_max",
        "|value|",
        "Largest amax in the history after this step's update: the newest L-1 amaxes, which the "
        "next update's window holds with its own (under `max`, what it will scale by at least). "
        "The scale in use also saw the amax that update rolled out, so it can be based on more. "
        "The history counts updates: micro-batches for input and grad_output, steps for weight.",
    ),
    Metric("window_p50", "|value|", "Median of the non-zero amaxes in the history window."),
    Metric(
        "window_p90", "|value|", "90th percentile of the non-zero amaxes in the history window."
    ),
    Metric(
        "scale_change",
        "ratio >= 1",
        "How far the scale moved since the previous step, either way: max(s/s', s'/s).",
    ),
    Metric("saturation", "fraction", "Elements clipped at the FP8 maximum in this step's casts."),
    Metric(
        "underflow",
        "fraction",
        "Share of this step's cast elements that were non-zero and became zero (flushed).",
    ),
    Metric("nan", "count", "NaN elements in this step's casts (the cast keeps them)."),
    Metric("inf", "count", "Infinite elements in this step's casts (saturated to the FP8 max)."),
    # Block recipes (block scaling, MXFP8) only: NaN for per-tensor scales, which have no blocks.
    Metric(
        "block_exp_min",
        "log2",
        "Lowest exponent (floor of log2) of the block decode scales (scale_inv) in this step's "
        "casts, over the blocks holding a non-zero finite value.",
    ),
    Metric(
        "block_exp_median",
        "log2",
        "Median (the lower one) of those exponents in the step's last cast.",
    ),
    Metric("block_exp_max", "log2", "Highest of those exponents in this step's casts."),
    Metric(
        "blocks_at_floor",
        "fraction",
        "Share of those blocks whose scale sat at its floor: no larger scale was representable "
        "(block scaling: fp8_max / amax overflowed and took the substitute; MXFP8: E8M0 byte 0, "
        "2^-127), so their small values flush to zero.",
    ),
)

MODULE_OWN_METRICS = (
    Metric("input_norm", "L2", "Norm of the module's input (this rank's view), last micro-batch."),
    Metric("weight_norm", "L2", "Norm of the module's weight shard on this rank."),
    Metric(
        "grad_norm",
        "L2",
        "Norm of this rank's weight-shard gradient, summed over micro-batches, before the "
        "data-parallel sum.",
    ),
    Metric(
        "fp8_gemms",
        "count",
        "GEMMs the module ran in FP8 this step (up to 3 per micro-batch: fprop, dgrad, wgrad).",
    ),
    Metric(
        "fallback_gemms",
        "count",
        "GEMMs it ran in higher precision this step: all of a module held in the base dtype, "
        "or those of its GEMMs an override or module recipe takes out of FP8.",
    ),
    Metric(
        "fp8_rel_error",
        "ratio",
        "||y_fp8 - y_ref|| / ||y_ref|| of the forward output against the base-dtype GEMM on the "
        "same input (at most telemetry.error_sample_tokens of its tokens, evenly spaced); "
        "measured every telemetry.error_sample_every steps, NaN otherwise (and when fprop "
        "itself runs in the base dtype).",
    ),
    Metric(
        "fp8_enabled",
        "0/1",
        "1 if the module ran FP8 (admitted; some of its GEMMs may run in the base dtype), 0 if "
        "held in the base dtype.",
    ),
)

MODULE_METRICS: tuple[Metric, ...] = (
    tuple(Metric(f"{slot}.{m.name}", m.unit, m.meaning) for slot in SLOTS for m in SLOT_METRICS)
    + MODULE_OWN_METRICS
)

STEP_METRICS = (
    Metric("loss", "nats/token", "Training loss of the step (global batch mean)."),
    Metric("grad_norm", "L2", "Global gradient norm before clipping (NaN when not finite)."),
    Metric("lr", "", "Learning rate of the step."),
    Metric("skipped", "0/1", "1 if the optimizer step was skipped (non-finite gradients)."),
    Metric("tokens_per_s", "tokens/s", "Positions processed per second, padding included."),
    Metric("step_seconds", "s", "Wall time of the step."),
)

MODULE_METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in MODULE_METRICS)
STEP_METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in STEP_METRICS)
COLUMN = {name: index for index, name in enumerate(MODULE_METRIC_NAMES)}
STEP_COLUMN = {name: index for index, name in enumerate(STEP_METRIC_NAMES)}


def worst_end(metric: str) -> str:
    """Which end of a metric is the worst, for rankings and pooled views: "min" for a scale (it
    dropped because its amax grew), for a block exponent (the low end is the one nearest the
    floor, where values flush to zero) and for fp8_enabled (the module left FP8); "max" for
    everything else."""
    name = metric.rsplit(".", 1)[-1]
    low_is_worse = name in ("scale", "fp8_enabled") or name.startswith("block_exp_")
    return "min" if low_is_worse else "max"


# The metrics only some recipes have (by the name after the slot); NaN, never 0, elsewhere.
_ONLY_UNDER = {
    "window_max": ("delayed",),
    "window_p50": ("delayed",),
    "window_p90": ("delayed",),
    "scale_change": ("delayed",),
    "scale": ("delayed", "current"),  # one scale per tensor
    "scale_inv": ("delayed", "current"),
    "block_exp_min": ("block", "mxfp8"),
    "block_exp_median": ("block", "mxfp8"),
    "block_exp_max": ("block", "mxfp8"),
    "blocks_at_floor": ("block", "mxfp8"),
}


def applies(metric: str, scaling: str) -> bool:
    """Whether a module under ``scaling`` (delayed, current, block, mxfp8) has ``metric``: a
    metric that does not apply is NaN in the store, which means "not applicable", not "not
    measured yet"."""
    return scaling in _ONLY_UNDER.get(metric.rsplit(".", 1)[-1], (scaling,))


def describe() -> dict[str, list[dict[str, str]]]:
    """The catalogue as JSON-able lists (what the store keeps in its attributes): new dicts, so
    a caller that edits them (an imported store's meanings) leaves the catalogue as it is."""
    return {
        "module_metrics": [asdict(m) for m in MODULE_METRICS],
        "step_metrics": [asdict(m) for m in STEP_METRICS],
    }
