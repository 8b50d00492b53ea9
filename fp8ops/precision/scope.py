"""The FP8 scope: fp8ops' equivalent of ``te.fp8_autocast`` under delayed scaling.

Usage::

    scope = Fp8Scope(recipe, group=amax_reduction_group)
    with scope():                # every FP8 module used inside registers once
        loss = model(batch)      # casts max-accumulate amaxes into history row 0
    # outermost exit in grad mode: one all_reduce(MAX) of all forward amaxes, then the update
    loss.backward()              # the first module's backward ends with the backward update

Timing follows TE (reference §2.4): the forward update runs at the exit of the outermost
scope, only when grad is enabled; the backward update runs once per backward pass, at the end
of the backward of the first FP8 module that ran in the scope (it runs last). Every update
covers all registered modules, whether they ran or not: one that did not run has amax 0 and
is left untouched by the kernel's zero gate.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.scaling import update_delayed_scaling
from fp8ops.precision.state import Fp8Meta
from fp8ops.precision.stateless import StatelessRecipe

# The innermost active (scope, enabled) pair. A context variable: a new thread starts with
# no active scope (its modules run in high precision), as a new thread under TE does not
# inherit the autocast state either.
_ACTIVE: contextvars.ContextVar[tuple[Fp8Scope, bool] | None] = contextvars.ContextVar(
    "fp8ops_active_scope", default=None
)


def active_scope() -> Fp8Scope | None:
    """The scope FP8 modules should use now, or None (run in high precision)."""
    current = _ACTIVE.get()
    if current is None or not current[1]:
        return None
    return current[0]


class Fp8Scope:
    """A recipe, its amax reduction group and the modules registered under them."""

    def __init__(
        self, recipe: DelayedScalingRecipe | StatelessRecipe, group: dist.ProcessGroup | None = None
    ):
        """A stateless recipe's modules register nothing: the scope only says FP8 is on, and
        which recipe (no amax is reduced and nothing is updated at its exit)."""
        self.recipe = recipe
        self.group = group
        self._metas: list[Fp8Meta] = []
        self._registered: set[int] = set()
        self._depth = 0
        self._outermost_enabled = False
        self._first_module_pending = False

    @contextlib.contextmanager
    def __call__(self, enabled: bool = True) -> Iterator[Fp8Scope]:
        """Enter the scope. ``enabled=False`` nested inside runs its modules in high precision."""
        outer = _ACTIVE.get()
        if outer is not None and outer[0] is not self:
            # TE keeps one process-wide autocast depth; two scope objects nested would each
            # update at their own exit, in the middle of the other's step.
            raise RuntimeError(
                "another Fp8Scope is active; nest the same scope (scope(enabled=False)) instead"
            )
        token = _ACTIVE.set((self, enabled))
        self._depth += 1
        if self._depth == 1:
            self._outermost_enabled = enabled
            self._first_module_pending = True
        try:
            yield self
        finally:
            self._depth -= 1
            _ACTIVE.reset(token)
            # As TE's autocast_exit: only an enabled outermost scope, only in grad mode.
            if self._depth == 0 and self._outermost_enabled and torch.is_grad_enabled():
                self.reduce_and_update(forward=True)

    # -- called by FP8 modules -----------------------------------------------------------

    def register(self, meta: Fp8Meta) -> None:
        """Add a module's state to every later update (once; repeated calls are no-ops)."""
        if id(meta) in self._registered:
            return
        if meta.recipe != self.recipe:
            # One update covers all modules with the scope's recipe: a module built for
            # another history length, format, margin or algorithm would be updated wrongly.
            raise ValueError(
                f"module FP8 state was built for {meta.recipe} but the scope runs {self.recipe}; "
                "build the module and the scope from the same recipe"
            )
        self._registered.add(id(meta))
        self._metas.append(meta)

    def claim_backward_update(self) -> bool:
        """True for exactly the first FP8 module run in an outermost scope: its backward
        runs last, so it is the one that triggers the backward update."""
        claimed, self._first_module_pending = self._first_module_pending, False
        return claimed

    # -- the update ----------------------------------------------------------------------

    def reduce_and_update(self, forward: bool) -> None:
        """All-reduce (MAX) every registered module's row-0 amaxes, then update them all.

        One collective and one update call for all modules, as TE concatenates its buffers.
        """
        if not self._metas:
            return
        states = [meta.direction(forward) for meta in self._metas]
        amax = torch.cat([s.amax_history[0] for s in states])
        if self._should_reduce():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        history, scale = update_delayed_scaling(
            torch.cat([s.amax_history for s in states], dim=1),
            torch.cat([s.scale for s in states]),
            amax,
            fp8_max=states[0].fp8.max,
            margin=self.recipe.margin,
            algo=self.recipe.amax_compute_algo,
        )
        # Back into every module's own tensors in one call instead of two per module: a GPU
        # step is bound by the host's time per call. Every module of a direction has the same
        # slots (state.py), so the results are laid out per module first, one contiguous block
        # each, as the destinations are: only then is it one multi-tensor kernel on a GPU
        # (otherwise _foreach_copy_ copies pair by pair).
        modules, width = len(states), states[0].scale.numel()
        per_module_history = history.reshape(history.shape[0], modules, width).transpose(0, 1)
        # The amax each slot fed this update, where it fed one (TE's kernel skips a slot whose
        # amax is 0): what telemetry reports, with a history of any length. (Row 0 is never
        # negative or NaN, so a reduced 0 means every rank's was 0, which the kernel's fallback
        # to this rank's row 0 would give too.)
        last = torch.where(amax != 0, amax, torch.cat([s.last_amax for s in states]))
        torch._foreach_copy_(
            [s.amax_history for s in states]
            + [s.scale for s in states]
            + [s.last_amax for s in states],
            list(per_module_history.contiguous().unbind(0))
            + list(scale.reshape(modules, width).unbind(0))
            + list(last.reshape(modules, width).unbind(0)),
        )

    def _should_reduce(self) -> bool:
        return (
            self.recipe.reduce_amax
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.group) > 1
        )
