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
* :func:`te_extra_state` writes TE's payload from fp8ops' state and recipe: the keys TE's
  ``get_extra_state`` writes for a single-GEMM module (``extra_fp8_variables`` holding the
  entries ``set_extra_state`` needs, not every entry of a live module's ``fp8_meta``), for a TE
  model to load (which, on TE 2.18 and later, takes that environment switch: the payload is a
  pickle because TE's format is).
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
        return Fp8ExtraState(_tensors(value, where), "fp8ops")
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise Fp8opsError(
                f"{where}: a {value.dtype} tensor of shape {tuple(value.shape)} is neither "
                "fp8ops' FP8 state (a dict of tensors) nor TE's (a 1-D uint8 pickle payload)"
            )
        value = value.detach().cpu().numpy().tobytes()
    if not isinstance(value, bytes | bytearray):
        raise Fp8opsError(f"{where}: cannot read FP8 state from a {type(value).__name__}")
    if not value:
        return None
    _check_torch_loader(where)
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
    recipe = state.get("recipe")
    if not isinstance(recipe, _TeRecipe):
        raise Fp8opsError(
            f"{where}: TE extra state without TE's DelayedScaling recipe (a TE 1.x payload, or a "
            "made-up one): its scales cannot be checked against a recipe, so it is not loaded"
        )
    return Fp8ExtraState(
        _tensors(state, where), "transformer_engine", _recipe_fields(recipe, where)
    )


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


def _tensors(state: dict, where: str) -> dict[str, torch.Tensor]:
    """The four state tensors: float32, on the host, detached (a pickled tensor can carry
    requires_grad, which copy_ would pass on to the module's state)."""
    _check_keys(state, where)
    wrong = [f"{k} ({state[k].dtype})" for k in FP8_KEYS if state[k].dtype != torch.float32]
    if wrong:
        raise Fp8opsError(f"{where}: FP8 state tensors must be float32: {', '.join(wrong)}")
    return {k: state[k].detach().cpu() for k in FP8_KEYS}


_RECIPE_FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax")


def _recipe_fields(recipe: _TeRecipe, where: str) -> dict:
    # vars(), not a method of the record: the payload sets the record's __dict__, and a method
    # name in it would shadow the method.
    fields = vars(recipe)
    missing = [name for name in _RECIPE_FIELDS if name not in fields]
    if missing:
        raise Fp8opsError(f"{where}: TE's recipe in the payload lacks {', '.join(missing)}")
    return {name: fields[name] for name in _RECIPE_FIELDS}


def _check_torch_loader(where: str) -> None:
    # The tensors' storage inside a payload is read by torch.load(weights_only=True), whose
    # restrictions could be bypassed before torch 2.6 (CVE-2025-32434).
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 6):
        raise Fp8opsError(
            f"{where}: reading TE's pickled extra state safely needs torch >= 2.6 "
            f"(this is {torch.__version__}, whose weights_only loader can be bypassed)"
        )


# -- the allow-list unpickler ------------------------------------------------------------------


class _Refused(Exception):
    pass


class _TeRecipe:
    """TE's ``DelayedScaling`` as a record: pickle restores its ``__dict__`` here instead. (A
    recipe with a callable ``amax_compute_algo`` names that callable's global, which the
    allow-list refuses: TE's Megatron path runs only the two named algorithms.)"""

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple):  # (dict, slots) from dataclasses with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise _Refused(f"a recipe state of type {type(state).__name__}")
        self.__dict__.update(state)


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
    # torch.storage._load_from_bytes would torch.load with weights_only=False; on the host, so
    # a payload cannot place its storage on a device of its choosing.
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    # megatron-core 0.17 and later replace torch.storage._load_from_bytes with this loader of
    # theirs when imported, so tensors pickled in a training process (TE's payloads) name it.
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): dict,
    (_TE_RECIPE_MODULE, "DelayedScaling"): _TeRecipe,
    # Megatron's subclass, which its TE layers keep in fp8_meta["recipe"] and so pickle.
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): _TeRecipe,
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
