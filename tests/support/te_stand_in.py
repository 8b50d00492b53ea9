"""A stand-in for a Transformer Engine linear's FP8 bookkeeping (not its arithmetic).

Transformer Engine's PyTorch side does not import on any machine here, so the tests of fp8ops'
TE adapters (``te_telemetry``, ``te_state``, admission of a TE model) run against this class,
which keeps TE's documented layout and behaviour:

* no state until a module's first FP8 forward, then ``fp8_meta["scaling_fwd"]`` /
  ``["scaling_bwd"]`` holding ``scale`` and ``amax_history``;
* ``module.fp8`` set at every forward; the weight cast unless Megatron's ``is_first_microbatch``
  flag is False;
* ``set_extra_state`` as TE's ``module/base.py`` does it, with TE's *real* payload classifier
  (``transformer_engine/pytorch/_extra_state.py`` of the installed TE 2.20.2, which imports
  without TE's PyTorch side): refusal of a delayed-scaling pickle unless
  ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``, then ``fp8_meta`` updated, the state created at
  the payload recipe's history length, and the tensors copied in;
* Megatron's TE linears' ``parallel_mode`` and ``tp_size``.

Whether TE itself behaves so is for a GPU with TE (docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from fp8ops.precision.te_recipe import load_te_recipe_module


def load_te_extra_state_module():
    """TE's ``pytorch/_extra_state.py`` (TE 2.18 and later), loaded from the installed file;
    None without it."""
    # It imports TE's recipe module, which on a CPU imports only as fp8ops loads it.
    if load_te_recipe_module() is None:
        return None
    spec = importlib.util.find_spec("transformer_engine")
    path = Path(spec.origin).parent / "pytorch" / "_extra_state.py"
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location(
        "transformer_engine.pytorch._extra_state", path
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


TE_EXTRA_STATE = load_te_extra_state_module()


class TeLikeLinear(nn.Linear):
    """One TE projection's bookkeeping; ``TeLikeLinear.autocast`` stands in for TE's autocast."""

    autocast = False

    def __init__(
        self,
        features: int,
        gemms: int = 1,
        *,
        out_features: int | None = None,
        history_len: int = 4,
        parallel_mode: str = "column",
        tp_size: int = 1,
    ):
        super().__init__(features, out_features or features, bias=False)
        self.fp8_meta: dict = {}
        self.fp8_enabled = True  # te_backend.bf16_capable's flag
        self.gemms, self.history_len = gemms, history_len
        self.parallel_mode, self.tp_size = parallel_mode, tp_size
        self.is_first_microbatch = True  # Megatron's TELinear keeps it
        self.disable_parameter_transpose_cache = False
        self.classified: list[bool] = []  # what TE's classifier answered, per set_extra_state

    def forward(self, x):
        self.fp8 = TeLikeLinear.autocast and self.fp8_enabled
        self.is_first_microbatch = False  # as TELinear.forward leaves it
        if self.fp8 and "scaling_fwd" not in self.fp8_meta:  # TE's init_fp8_metadata
            self._init_state(self.history_len)
        if self.fp8:
            row = self.fp8_meta["scaling_fwd"].amax_history[0]
            row[0] = torch.fmax(row[0], x.detach().abs().amax())
            row[1] = torch.fmax(row[1], self.weight.detach().abs().amax())
        return super().forward(x)

    def set_extra_state(self, state: torch.Tensor) -> None:
        """TE's ``set_extra_state`` for a uint8 payload (reference §4)."""
        if state.numel() == 0:
            return
        data = state.detach().cpu().numpy().tobytes()
        load = TE_EXTRA_STATE.should_load_extra_state_pickle(data, type(self).__name__)
        self.classified.append(load)
        if not load:
            return
        loaded = pickle.loads(data)
        self.fp8_meta.update(loaded["extra_fp8_variables"])
        self.fp8_meta["recipe"] = loaded["recipe"]
        # init_fp8_meta_tensors: new state for a module without one; an existing one is kept
        # (set_meta_tensor returns early), its history brought to the recipe's length.
        length = loaded["recipe"].amax_history_len
        if "scaling_fwd" not in self.fp8_meta:
            self._init_state(length, self.fp8_meta["num_gemms"], loaded["recipe"])
        for key in ("scaling_fwd", "scaling_bwd"):
            state = self.fp8_meta[key]
            if state.amax_history.shape[0] != length:  # adjust_amax_history_length
                state.amax_history = torch.nn.functional.pad(
                    state.amax_history, (0, 0, 0, max(0, length - state.amax_history.shape[0]))
                )[:length].clone()
        for direction, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
            self.fp8_meta[key].scale.copy_(loaded[f"scale_{direction}"])
            self.fp8_meta[key].amax_history.copy_(loaded[f"amax_history_{direction}"])

    def _init_state(self, history_len: int, gemms: int | None = None, recipe=None) -> None:
        # New tensors each time, as TE's RecipeState.create: a view must read them afresh. TE's
        # state keeps the recipe it was made for (its casts' dtypes are fixed then); the
        # stand-in's autocast has none, so a state made by a forward here records None.
        gemms = self.gemms if gemms is None else gemms
        for key, slots in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = SimpleNamespace(
                scale=torch.ones(slots * gemms),
                amax_history=torch.zeros(history_len, slots * gemms),
                recipe=recipe,
            )


def decoder(layers: int = 2, features: int = 8) -> nn.Module:
    """``decoder.layers.<i>.linear_qkv`` / ``linear_proj`` of TE-like projections (column,
    row), and an output layer outside the decoder."""
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.linear_qkv = TeLikeLinear(features)
        layer.linear_proj = TeLikeLinear(features, parallel_mode="row")
        model.decoder.layers.append(layer)
    model.output_layer = TeLikeLinear(features)  # not a decoder projection: not observed
    return model
