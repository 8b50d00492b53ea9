"""A TE projection's delayed-scaling state, seen as fp8ops' ``Fp8Meta``.

Transformer Engine keeps a module's state in ``module.fp8_meta["scaling_fwd"]`` and
``["scaling_bwd"]``: ``amax_history [L, 3]`` and ``scale [3]`` forward, ``[L, 2]`` and ``[2]``
backward (one GEMM per module in Megatron's GPT spec: the layout fp8ops' own state copies,
reference §2.1). :class:`TeFp8MetaView` shows those tensors the way the rest of fp8ops reads an
``Fp8Meta``: ``direction``/``forward``/``backward`` for telemetry, ``state_dict`` and
``load_state_dict`` for checkpoints, evaluation and the cross-rank check. So a run on TE saves
the same ``fp8.<module>.<tensor>`` tensors as a run on fp8ops' own layers, and the same tools
read both.

Reading takes TE's tensors afresh every time, because TE creates new ones (a module's first FP8
forward, or loading a checkpoint into a module that has none yet). Before a module's first FP8
forward TE has no state; the view then shows the state TE will create (scales 1, histories 0),
as fp8ops' layers start.

Writing into a module that has TE state already copies into TE's tensors in place, which is what
TE's own loader does then. A module without state yet gets it through TE's ``set_extra_state``,
so TE builds it as from its own checkpoints (``init_fp8_meta_tensors``, then copies). That call
takes only TE's pickled payload, and TE 2.18 and later refuse a delayed-scaling pickle unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (reference §4), since a pickle from a file can run
code. fp8ops' checkpoints hold no pickle: the view builds the payload in this process from the
loaded tensors (``te_extra_state``) and turns the switch on for that one call only. What TE
unpickles is then fp8ops' own bytes, never a file's. Either way the view then reads the state
back and refuses to go on if TE did not take it.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from fp8ops.errors import Fp8opsError
from fp8ops.megatron.te_extra_state import FP8_KEYS, te_extra_state
from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.state import ScalingState

SLOTS_PER_GEMM = {True: 3, False: 2}  # TE's FP8FwdTensors / FP8BwdTensors
TE_KEYS = {True: "scaling_fwd", False: "scaling_bwd"}
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"  # TE's _extra_state.py


def is_te_projection(module: nn.Module) -> bool:
    """A TE linear that can run BF16 inside the FP8 autocast (``te_backend.bf16_capable``):
    fp8ops' ``fp8_enabled`` flag on a module that keeps TE's ``fp8_meta`` dict (fp8ops' own
    FP8 linears keep an ``Fp8Meta``)."""
    return hasattr(module, "fp8_enabled") and isinstance(getattr(module, "fp8_meta", None), dict)


class TeFp8MetaView:
    """A TE module's delayed-scaling state as an ``Fp8Meta``: TE's own tensors (module
    docstring)."""

    def __init__(self, module: nn.Module, recipe: DelayedScalingRecipe, name: str):
        self.module, self.recipe, self.name = module, recipe, name
        self._initial: dict[bool, ScalingState] = {}

    @property
    def forward(self) -> ScalingState:
        return self.direction(True)

    @property
    def backward(self) -> ScalingState:
        return self.direction(False)

    def direction(self, forward: bool) -> ScalingState:
        fp8 = self.recipe.fp8_format.forward if forward else self.recipe.fp8_format.backward
        state = self.module.fp8_meta.get(TE_KEYS[forward])
        if state is None:  # no FP8 forward yet: the state TE will create then
            if forward not in self._initial:
                self._initial[forward] = ScalingState.fresh(
                    self.recipe.amax_history_len,
                    SLOTS_PER_GEMM[forward],
                    fp8,
                    device=self.module.weight.device,
                )
            return self._initial[forward]
        slots = state.amax_history.shape[1]
        if slots != SLOTS_PER_GEMM[forward]:
            raise ValueError(
                f"{self.name}: TE's fp8_meta[{TE_KEYS[forward]!r}].amax_history has {slots} "
                f"slots, fp8ops reads modules of one GEMM ({SLOTS_PER_GEMM[forward]}); a module "
                "of several GEMMs (LayerNormMLP) is not one of Megatron's GPT projections"
            )
        history = _at_length(state.amax_history, self.recipe.amax_history_len)
        return ScalingState(amax_history=history, scale=state.scale, fp8=fp8)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the four tensors under TE's (and ``Fp8Meta``'s) names."""
        forward, backward = self.direction(True), self.direction(False)
        tensors = (forward.scale, forward.amax_history, backward.scale, backward.amax_history)
        return {key: tensor.detach().clone() for key, tensor in zip(FP8_KEYS, tensors, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Make ``state`` TE's state of the module (module docstring). Keys and shapes must be
        this recipe's, as ``Fp8Meta.load_state_dict`` requires."""
        missing = [key for key in FP8_KEYS if key not in state]
        if missing:
            raise Fp8opsError(f"{self.name}: FP8 state lacks {', '.join(missing)}")
        for key, current in self.state_dict().items():
            if state[key].shape != current.shape:
                raise ValueError(
                    f"{self.name}: FP8 state {key}: shape {tuple(state[key].shape)} does not "
                    f"match this module's {tuple(current.shape)}"
                )
        targets = self._te_tensors()
        if targets is not None and all(targets[k].shape == state[k].shape for k in FP8_KEYS):
            # TE's state exists at this length: its set_extra_state would copy in place too
            # (set_meta_tensor keeps an initialised state), so do that, without the pickle.
            self._refuse_another_format()
            for key in FP8_KEYS:
                targets[key].copy_(state[key])
        else:
            with _pickle_allowed():
                self.module.set_extra_state(te_extra_state(state, self.recipe))
            self._initial.clear()
        # A TE that skipped the payload (a classifier that ignores it, a changed loader) must
        # not leave the old state in place unnoticed: evaluation restores through here too.
        loaded = self._te_tensors()
        if loaded is None or not all(_same_bits(loaded[k], state[k]) for k in FP8_KEYS):
            raise Fp8opsError(
                f"{self.name}: Transformer Engine did not take the FP8 state handed to its "
                "set_extra_state; this TE's loader is not the one fp8ops was written against"
            )

    def _refuse_another_format(self) -> None:
        """TE fixes a state's cast dtypes when it makes the state, and loading keeps the state:
        scales for this recipe's format copied into a state made for another would be used by
        casts to the other format's dtype. A resume loads into a model built afresh, where TE
        makes the state from the payload's recipe; this is for any other caller."""
        made_for = getattr(self.module.fp8_meta[TE_KEYS[False]], "recipe", None)
        made = getattr(getattr(made_for, "fp8_format", None), "name", None)
        if made is not None and made != self.recipe.fp8_format.name:
            raise Fp8opsError(
                f"{self.name}: Transformer Engine made this module's FP8 state for fp8_format "
                f"{made} and keeps its casts' dtypes when loading; a state for "
                f"{self.recipe.fp8_format.name} loads only into a model built afresh (as "
                "`fp8ops resume` does)"
            )

    def _te_tensors(self) -> dict[str, torch.Tensor] | None:
        """TE's own four tensors as they stand (not length-adjusted); None before it has any."""
        forward, backward = (self.module.fp8_meta.get(TE_KEYS[f]) for f in (True, False))
        if forward is None or backward is None:
            return None
        tensors = (forward.scale, forward.amax_history, backward.scale, backward.amax_history)
        return dict(zip(FP8_KEYS, tensors, strict=True))


def _same_bits(te: torch.Tensor, given: torch.Tensor) -> bool:
    # Bits, not values: a NaN in a history is the same NaN after a copy, and never == itself.
    return torch.equal(te.cpu().view(torch.int32), given.to(torch.float32).cpu().view(torch.int32))


@contextlib.contextmanager
def _pickle_allowed():
    """TE's switch on, for a payload this process built; as it was afterwards."""
    before = os.environ.get(UNSAFE_PICKLE_ENV)
    os.environ[UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[UNSAFE_PICKLE_ENV]
        else:
            os.environ[UNSAFE_PICKLE_ENV] = before


def _at_length(history: torch.Tensor, length: int) -> torch.Tensor:
    """``history`` as TE will have it at the module's next forward: a checkpoint saved with
    another ``amax_history_len`` loads at its own length, and TE's
    ``adjust_amax_history_length`` truncates it or pads it with zeros at the end then
    (reference §4). A copy, only in that case."""
    if history.shape[0] == length:
        return history
    if history.shape[0] > length:
        return history[:length].clone()
    return torch.nn.functional.pad(history, (0, 0, 0, length - history.shape[0]))
