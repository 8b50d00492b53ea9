"""Transformer Engine's ``_extra_state`` payload, read and written without running pickled code.

A TE module under delayed scaling checkpoints its FP8 state as a uint8 tensor holding
``pickle.dumps`` of a dict (reference §4): the ``DelayedScaling`` recipe object, ``scale_fwd``,
``amax_history_fwd``, ``scale_bwd``, ``amax_history_bwd`` (float32 CPU tensors, TE's slot layout,
which is fp8ops' too) and ``extra_fp8_variables``. An empty tensor means no FP8 state (a module not
in FP8, or a stateless recipe). fp8ops' own linears keep the same four tensors under the same names
as a plain dict (``Fp8Meta.state_dict``), so one reader serves both:

* :func:`read_extra_state` takes either form and returns the four tensors and, for TE's, the
  recipe's fields. TE's payload is unpickled by an allow-list: the globals that rebuild CPU
  tensors (their storage loaded with ``torch.load(weights_only=True)``) and TE's recipe classes,
  which become plain records; any other global is refused by name before anything runs. TE 2.18
  and later refuse to load these payloads at all unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``
  (its own classifier cannot tell a state from an exploit); this reader needs no such switch.
* :func:`te_extra_state` writes TE's payload from fp8ops' state and recipe, byte-compatible
  with what ``get_extra_state`` of a TE module returns, for a TE model to load (which, on TE 2.18
  and later, takes that environment switch: the payload is a pickle because TE's format is).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch

from fp8ops.errors import Fp8opsError
from fp8ops.precision.recipe import DelayedScalingRecipe

# TE's names, which fp8ops' Fp8Meta.state_dict uses too.
FP8_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# (forward max, backward max) of TE's Format members; pure E5M2 is refused by TE itself.
_TE_FORMATS = {(448.0, 448.0): "e4m3", (448.0, 57344.0): "hybrid"}


@dataclass(frozen=True)
class Fp8ExtraState:
    """One module's delayed-scaling state, from either kind of ``_extra_state``."""

    tensors: dict[str, torch.Tensor]  # FP8_KEYS -> float32 CPU tensors, TE's slot layout
    source: str  # "fp8ops" or "transformer_engine"
    recipe: dict | None = None  # TE's recipe fields (margin, fp8_format, ...); None for fp8ops'


def read_extra_state(value, *, where: str = "_extra_state") -> Fp8ExtraState | None:
    """The FP8 state in ``value``: fp8ops' dict of tensors, or TE's uint8 pickle payload (also
    as bytes). None when it holds none (an empty TE payload). ``where`` names the checkpoint
    entry in errors."""
    if isinstance(value, dict):
        _check_keys(value, where)
        return Fp8ExtraState({k: value[k] for k in FP8_KEYS}, "fp8ops")
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise Fp8opsError(
                f"{where}: a {value.dtype} tensor of shape {tuple(value.shape)} is neither "
                "fp8ops' FP8 state (a dict of tensors) nor TE's (a 1-D uint8 pickle payload)"
            )
        value = value.numpy().tobytes()
    if not isinstance(value, bytes | bytearray):
        raise Fp8opsError(f"{where}: cannot read FP8 state from a {type(value).__name__}")
    if not value:
        return None
    try:
        state = _AllowListUnpickler(io.BytesIO(value)).load()
    except _Refused as refused:
        raise Fp8opsError(
            f"{where}: refusing TE extra state that names {refused}: a delayed-scaling payload "
            "holds only tensors and TE's recipe, so this is not one (or comes from an unknown "
            "TE version); nothing of it was executed"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign byte string fails anyhow
        raise Fp8opsError(
            f"{where}: not a readable TE extra-state payload ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(state, dict):
        raise Fp8opsError(f"{where}: TE extra state holds a {type(state).__name__}, not a dict")
    if not any(k in state for k in FP8_KEYS):
        return None  # a stateless recipe's payload
    _check_keys(state, where)
    recipe = state.get("recipe")
    fields = recipe.fields() if isinstance(recipe, _TeRecipe) else None
    return Fp8ExtraState({k: state[k] for k in FP8_KEYS}, "transformer_engine", fields)


def te_extra_state(tensors: dict[str, torch.Tensor], recipe: DelayedScalingRecipe) -> torch.Tensor:
    """TE's ``_extra_state`` payload for one single-GEMM module: what its ``get_extra_state``
    returns after the same training. Needs TE's recipe module (it pickles TE's own recipe)."""
    from fp8ops.precision.te_recipe import to_te_recipe

    _check_keys(tensors, "fp8ops FP8 state")
    if not recipe.amax_compute_algo.fused:
        raise Fp8opsError(
            f"amax_compute_algo {recipe.amax_compute_algo.name!r}: TE's Megatron path runs only "
            "'max' and 'most_recent', so there is no TE state to write for it"
        )
    fp8_format = recipe.fp8_format
    state = {
        "recipe": to_te_recipe(recipe),
        **{k: tensors[k].detach().to("cpu", torch.float32).clone() for k in FP8_KEYS},
        # fp8_meta's plain entries, as TE stores them (module/base.py::get_extra_state)
        "extra_fp8_variables": {
            "fp8_checkpoint": True,
            "num_gemms": 1,
            "fp8_max_fwd": fp8_format.forward.max,
            "fp8_max_bwd": fp8_format.backward.max,
        },
    }
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _check_keys(state: dict, where: str) -> None:
    missing = [k for k in FP8_KEYS if not isinstance(state.get(k), torch.Tensor)]
    if missing:
        raise Fp8opsError(f"{where}: FP8 state lacks {', '.join(missing)} (tensors)")


# -- the allow-list unpickler ------------------------------------------------------------------


class _Refused(Exception):
    pass


class _TeRecipe:
    """TE's ``DelayedScaling`` as a record: pickle restores its ``__dict__`` here instead."""

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple):  # (dict, slots) from dataclasses with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state)

    def fields(self) -> dict:
        values = dict(self.__dict__)
        algo = values.get("amax_compute_algo")
        if not isinstance(algo, str):
            values["amax_compute_algo"] = repr(algo)  # a callable TE was given
        return values


class _TeFormatHelper(tuple):
    """TE's ``_FormatHelper(max_fwd, max_bwd)``, as a tuple."""

    def __new__(cls, *args):
        return tuple.__new__(cls, args)


def _te_format(helper) -> str:
    maxima = tuple(float(v) for v in helper)
    if maxima not in _TE_FORMATS:
        raise _Refused(f"an FP8 format with maxima {maxima}")
    return _TE_FORMATS[maxima]


def _storage_from_bytes(data: bytes):
    # torch.storage._load_from_bytes would torch.load with weights_only=False.
    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): dict,
    (_TE_RECIPE_MODULE, "DelayedScaling"): _TeRecipe,
    (_TE_RECIPE_MODULE, "Format"): _te_format,
    (_TE_RECIPE_MODULE, "_FormatHelper"): _TeFormatHelper,
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise _Refused(f"{module}.{name}")
        return _ALLOWED[(module, name)]


def recipe_differences(fields: dict | None, recipe: DelayedScalingRecipe) -> list[str]:
    """Where TE's recorded recipe fields differ from ``recipe``, as "field: theirs != ours"
    lines (empty when they agree, or when there are no fields: fp8ops' own state)."""
    if not fields:
        return []
    ours = {
        "margin": recipe.margin,
        "fp8_format": recipe.fp8_format.value,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo.name,
        "reduce_amax": recipe.reduce_amax,
    }
    return [
        f"{key}: {fields.get(key)!r} != {value!r}"
        for key, value in ours.items()
        if fields.get(key) != value
    ]
