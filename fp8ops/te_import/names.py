"""TE's statistic names, and which of them fill a metric of fp8ops' catalogue.

Transformer Engine's debug features log each value as ``<layer>_<tensor>_<stat>`` (its stats
buffer, ``transformer_engine/debug/features/utils/stats_buffer.py``). The layer name is the
one given to the TE module (``name=`` or ``infer_and_assign_layer_names``), so it may hold
underscores; the tensor is one of :data:`TENSORS`, none of which appears inside a stat name, so
the name splits at its last ``_<tensor>_``.

A TE stat fills a catalogue metric only where both mean the same thing (:func:`catalogue_metric`;
the table, with why for each, is in docs/telemetry.md). Everything else is kept under TE's own
name, as the column ``te.<tensor>.<stat>`` (:func:`kept_column`), never folded into a catalogue
metric that means something else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The tensors TE's LogTensorStats can log; LogFp8TensorStats and LogNvfp4TensorStats log the
# first three, the ones that are cast.
TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad")
# TE's tensor -> fp8ops' FP8 slot: the GEMM operands that are cast.
SLOTS = {"activation": "input", "weight": "weight", "gradient": "grad_output"}

# LogFp8TensorStats names a stat <recipe>_<stat>[_columnwise]; without a recipe, the one the
# layer trains with. LogNvfp4TensorStats logs nvfp4_<stat>.
RECIPES = ("fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling", "nvfp4")
QUANTIZED_STATS = (
    "underflows%",
    "underflows_num",
    "overflows%",  # delayed scaling only
    "overflows_num",
    "scale_inv_min",
    "scale_inv_max",
    "mse",
    "total_square_error",
)
# LogTensorStats (TE's, and nvdlfw_inspect's generic one: the first six).
TENSOR_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
_BLOCKWISE = re.compile(
    r"max_blockwise_dynamic_range_block_size_\d+_dims_[12](_max_over_orientations)?"
)
_NAME = re.compile(rf"^(?P<layer>.+)_(?P<tensor>{'|'.join(TENSORS)})_(?P<stat>.+)$")

# fp8ops' words for TE's recipes (the manifest's precision.scaling, and --recipe).
TE_RECIPE = {
    "delayed": "fp8_delayed_scaling",
    "current": "fp8_current_scaling",
    "block": "fp8_block_scaling",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}


@dataclass(frozen=True)
class Stat:
    """A stat name taken apart: ``recipe`` ("" where the name gives none), the stat itself,
    ``columnwise`` (computed on the transposed cast), and whether TE documents it."""

    name: str
    recipe: str
    base: str
    columnwise: bool
    known: bool

    @property
    def quantized(self) -> bool:
        """A statistic of a quantized tensor (LogFp8TensorStats, LogNvfp4TensorStats): TE logs
        one only where the layer ran a quantizer for that tensor."""
        return self.known and self.base in QUANTIZED_STATS


def parse_stat(name: str) -> Stat:
    if name in TENSOR_STATS or _BLOCKWISE.fullmatch(name):
        return Stat(name, "", name, False, True)
    rest = name.removesuffix("_columnwise")
    columnwise = rest != name
    recipe = next((r for r in RECIPES if rest.startswith(f"{r}_")), "")
    base = rest[len(recipe) + 1 :] if recipe else rest
    return Stat(name, recipe, base, columnwise, base in QUANTIZED_STATS)


def split_name(name: str) -> tuple[str, str, str] | None:
    """``<layer>_<tensor>_<stat>`` as (layer, tensor, stat); None if no known tensor is in it."""
    match = _NAME.match(name)
    return None if match is None else (match["layer"], match["tensor"], match["stat"])


@dataclass(frozen=True)
class Mapped:
    """Where a TE stat goes in the catalogue: the metric, and the factor from TE's unit."""

    metric: str
    factor: float = 1.0


def catalogue_metric(tensor: str, stat: Stat, recipe: str | None) -> Mapped | None:
    """The catalogue metric a TE stat of ``tensor`` fills, given the recipe the layers trained
    with (TE's name; None: not known), or None where none means the same thing.

    A recipe-prefixed FP8 stat of another recipe than the training one is a "what if": TE casts
    the tensor again with that recipe, so it says nothing about the casts that ran. Columnwise
    stats are of the transposed cast, which the catalogue does not record apart.
    """
    slot = SLOTS.get(tensor)
    if slot is None or not stat.known or stat.columnwise:
        return None
    if stat.base == "cur_amax":  # max |x| over the step's micro-batches, after the reduction
        return Mapped(f"{slot}.amax")
    # nvfp4 stats are logged only where the tensor was cast to NVFP4 (LogNvfp4TensorStats skips
    # every other layer), and fp8_delayed_scaling ones only under delayed scaling (TE cannot
    # cast to it as a what-if), so both are the training recipe's.
    actual = stat.recipe in ("", "nvfp4", "fp8_delayed_scaling") or stat.recipe == recipe
    if not actual:
        return None
    if stat.base == "underflows%":
        return Mapped(f"{slot}.underflow", 0.01)  # a percentage of all elements
    if stat.base == "overflows%":  # |x| > fp8_max * scale_inv: clipped at the FP8 maximum
        return Mapped(f"{slot}.saturation", 0.01)
    # Per-tensor current scaling: the largest scale_inv over the step's casts is the one of the
    # cast with the largest amax, which is what fp8ops records for current scaling.
    if stat.base == "scale_inv_max" and (stat.recipe or recipe) == "fp8_current_scaling":
        return Mapped(f"{slot}.scale_inv")
    return None


# TE's values that are NaN or infinite only when the tensor holds such an element: torch's
# reductions propagate NaN, and max |x| is infinite only for an infinite element.
NAN_MEANS_NAN_ELEMENT = frozenset(
    {"cur_amax", "max", "min", "mean", "std", "l1_norm", "l2_norm", "mse"}
)
INF_MEANS_INF_ELEMENT = frozenset({"cur_amax", "max", "min"})


def kept_column(tensor: str, stat: str) -> str:
    """The store's column for a TE stat kept under its own name."""
    return f"te.{tensor}.{stat}"


# -- module names -------------------------------------------------------------------------------

NAMINGS = ("te", "inferred")
_INFERRED_LAYER = re.compile(r"^model\.decoder\.layers\.(\d+)\.")


def module_name(layer: str, naming: str) -> str:
    """fp8ops' module name for TE's layer name.

    ``te``: TE's name as it is. ``inferred``: a name nvdlfw_inspect's
    ``infer_and_assign_layer_names`` gave a Megatron-Core model, made fp8ops' module path again
    (the inverse of ``fp8ops overrides export-te --names inferred``): without the ``model.``
    prefix, and a decoder layer's 0-based index for Megatron's 1-based ``layer_number``.
    """
    if naming == "te":
        return layer
    if not layer.startswith("model."):
        raise ValueError(
            f"layer {layer!r} does not start with 'model.', as infer_and_assign_layer_names "
            "names every layer; import with --naming te to keep TE's names"
        )
    match = _INFERRED_LAYER.match(layer)
    if match is not None and int(match[1]) < 1:
        raise ValueError(
            f"layer {layer!r}: decoder layer {match[1]}, but infer_and_assign_layer_names "
            "numbers them from 1 (Megatron's layer_number); import with --naming te"
        )
    path = layer.removeprefix("model.")
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) - 1}.", path)
