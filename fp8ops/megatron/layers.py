"""Megatron's tensor-parallel linears with the local GEMM in FP8, under fp8ops' delayed scaling.

:class:`Fp8ColumnParallelLinear` and :class:`Fp8RowParallelLinear` subclass Megatron's
``ColumnParallelLinear`` and ``RowParallelLinear`` (``spec.py`` puts them in the four projections
of a GPT layer). Inside an active :class:`~fp8ops.precision.Fp8Scope` the local GEMM runs through
:func:`~fp8ops.precision.linear.fp8_linear`, and Megatron's own mapping functions around it do the
tensor-parallel communication, so the collectives are Megatron's::

    column:  x ─copy_to_tp─► FP8 GEMM with the W shard (+ bias shard) ─[gather_from_tp]─► y
             (copy_to_tp: identity forward, all-reduce of the input gradient in backward)
    row:     x ─[scatter_to_tp]─► FP8 GEMM with the W shard ─reduce_from_tp─► (+ bias) ─► y
             (reduce_from_tp: all-reduce of the partial sums forward, identity backward)

Under sequence parallelism (``config.sequence_parallel``) the residual stream between them holds
each rank's part of the sequence: the column layer all-gathers it first (its input gradient is
reduce-scattered back) and the row layer reduce-scatters its partial sums instead of all-reducing
them. The FP8 cast then sees the gathered input, whose amax is the max of the ranks' parts: the
one TE reaches by reducing each rank's amax over TP, which sequence parallelism requires.

Each rank casts its own shard with the module's scales; the scope all-reduces (MAX) the amaxes
over its group, which contains the TP group, so every shard of a tensor shares one scale, as in TE.
Return values follow Megatron's ``(output, bias)`` convention, ``skip_bias_add`` included.

Outside an active scope (or inside ``scope(enabled=False)``) ``forward`` *is* the parent's, and so
it is for a layer whose ``fp8_enabled`` is False: per-layer admission (``fp8ops.admission``) keeps
such a layer in the base dtype. It keeps its FP8 state, frozen (it records no amax, so its scopes'
updates leave it alone), so every module has the same state layout whether it runs FP8 or not, and
a BF16 override can later be lifted without a gap in the checkpoint. ``fp8_gemms`` (admission sets
it; all three by default) says which of an FP8 layer's GEMMs run FP8, the others in the base
dtype (``fp8ops.precision.gemms``); a tensor none of them reads keeps its slot frozen the same way.

How the recipe and the GEMM reach a layer: ``recipe`` and ``gemm`` constructor arguments, which
``ModuleSpec.params`` carries (``spec.py``); ``gemm`` is the emulated FP8 GEMM by default, or
``torch._scaled_mm``'s (``precision.backend``). The recipe fixes the shape of the module's state
(history length) and its formats, so the state exists from construction, as in fp8ops'
``Fp8Linear`` and TE's modules, and checkpoint state can load before the first forward. The
alternative, TransformerConfig's own ``fp8*`` fields, would switch Megatron onto its Transformer
Engine code paths (``fp8_utils.get_fp8_context`` needs TE). The scope must run the same recipe; a
mismatch raises.

The FP8 state is float32 and lives where the weights live: moving the model (``model.to("cuda")``)
moves it too, and casting the model to another dtype leaves it float32 (``_apply``).

Micro-batches (TE's convention, which Megatron's TE modules follow): ``is_first_microbatch`` is
None by default, and the weight is cast on every call. Set it to True on the first micro-batch of
each step (:func:`mark_first_microbatch` does, for a whole model): the layer then casts the weight,
keeps the FP8 copy and sets the flag to False, so later micro-batches reuse it and the weight's
amax history rolls once per optimizer step. Megatron's ``set_is_first_microbatch()`` only acts when
``config.fp8`` is set, which fp8ops does not set (see above), so the training loop calls
:func:`mark_first_microbatch` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8ops.errors import Fp8opsError
from fp8ops.megatron.compat import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from fp8ops.megatron.quant_config import global_name, recipe_from_quant_config, stateless_recipe
from fp8ops.megatron.te_extra_state import read_extra_state, recipe_differences
from fp8ops.precision import (
    CastRecord,
    DelayedScalingRecipe,
    EmulatedGemm,
    Fp8Gemm,
    Fp8Meta,
    Fp8Scope,
    StatelessRecipe,
    active_scope,
    fp8_linear,
)
from fp8ops.precision.gemms import ALL_GEMMS

if TYPE_CHECKING:  # the telemetry package imports its store (zarr, pandas): not needed to run
    from fp8ops.telemetry.probe import Probe


class _Fp8LocalGemm:
    """What both FP8 layers share: the FP8 state and the local GEMM. Mixed in before Megatron's
    class, so ``self.weight``, ``self.config`` and ``self.tp_group`` are Megatron's."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        recipe: DelayedScalingRecipe | StatelessRecipe,
        gemm: Fp8Gemm | None = None,
        **kwargs,
    ):
        """``recipe`` and ``gemm`` are keyword arguments on top of Megatron's; everything else
        is passed through to the Megatron parent unchanged."""
        super().__init__(input_size, output_size, **kwargs)
        self._init_fp8(recipe, gemm)
        self._refuse(self._unsupported_settings())

    def _unsupported_settings(self) -> dict[str, bool]:
        """Settings of the Megatron parent this layer cannot honour (beyond the shared ones)."""
        return {}

    def _init_fp8(
        self, recipe: DelayedScalingRecipe | StatelessRecipe, gemm: Fp8Gemm | None
    ) -> None:
        # Plain attributes, not buffers: a buffer would enter Megatron's sharded_state_dict as a
        # ShardedTensor with replica semantics to define; the state travels in _extra_state.
        # A stateless recipe keeps no state (fp8_meta None), only what its casts saw this step.
        self.recipe = recipe
        self.own_scaling: str | None = None  # a per-module recipe's kind (finish_init)
        self.phase_recipe: StatelessRecipe | None = None  # run_phase_recipe
        delayed = isinstance(recipe, DelayedScalingRecipe)
        self.fp8_meta = Fp8Meta.fresh(recipe) if delayed else None
        self.cast_record = None if delayed else CastRecord()
        self.fp8_enabled = True  # False: admitted to the base dtype (see module docstring)
        # The GEMMs that run FP8 while fp8_enabled (admission: per-GEMM overrides and
        # module_recipes' gemms); the others run in the base dtype, as with fp8_enabled False.
        self.fp8_gemms = ALL_GEMMS
        self.gemm = gemm or EmulatedGemm()
        self.is_first_microbatch: bool | None = None
        self.probe: Probe | None = None  # telemetry attaches one (fp8ops.telemetry.probe)
        self._weight_fp8 = None  # the step's FP8 weight (delayed: one cast; stateless: two)
        self._weight_fp8_version = -1  # the weight's version counter when it was cast

    def finish_init(self, quantization_config) -> None:
        """Megatron-Core's per-module quantization config, which ``GPTModel`` hands every
        module once the model is built (``TransformerConfig.quant_recipe``, first matching glob;
        ``quant_config.py``): a module it matches runs that recipe instead of the spec's."""
        if quantization_config is not None:
            self._init_fp8(recipe_from_quant_config(quantization_config), self.gemm)
            self.own_scaling = self.recipe.kind

    def run_phase_recipe(self, kind: str | None) -> None:
        """Run the stateless recipe ``kind`` (at TE's defaults in this module's format, as a
        per-module recipe) from the next step on, for a phase of ``precision.schedule``; None:
        the module's own recipe again. Admission calls it between steps.

        The module's delayed-scaling state, if it has one, stays as it is meanwhile, frozen
        as while it runs in the base dtype: no cast of the phase's recipe records an amax in
        it, so the scope's updates leave it alone, and the module picks it up where it left
        it when the phase ends (as TE keeps ``fp8_meta`` while another recipe runs)."""
        if kind == (self.phase_recipe.kind if self.phase_recipe else None):
            return
        if kind is not None and self.own_scaling is not None:
            raise ValueError(
                f"{type(self).__name__} runs its own recipe ({self.own_scaling}) by "
                "module_recipes; a phase moves modules of the run's recipe only"
            )
        self.phase_recipe = None if kind is None else stateless_recipe(kind, self.recipe.fp8_format)
        self._weight_fp8 = None  # cast under one recipe, not to be reused under the other

    def _apply(self, fn, recurse=True):
        # What model.to(...), .cuda() and .cpu() go through: the FP8 state follows the weights
        # to their device, as a buffer would, so casts, the amax all-reduce (NCCL takes device
        # tensors only) and the updates stay on the GPU without a host sync per cast. Only the
        # device: model.to(torch.bfloat16) must not round the float32 scales and histories.
        super()._apply(fn, recurse)
        if not hasattr(self, "recipe"):  # Megatron's __init__ is still running
            return self
        device = self.weight.device
        if self.fp8_meta is not None:
            for state in (self.fp8_meta.forward, self.fp8_meta.backward):
                state.amax_history = state.amax_history.to(device)
                state.scale = state.scale.to(device)
                if state.last_amax is not None:
                    state.last_amax = state.last_amax.to(device)
        else:
            self.cast_record.to(device)
        if self._weight_fp8 is not None:
            self._weight_fp8 = None  # recast on the new device at the next first micro-batch
        return self

    def _refuse(self, unsupported: dict[str, bool]) -> None:
        # Fail when the model is built, not at the first step.
        unsupported = {
            **unsupported,
            "expert layers (is_expert)": self.is_expert,
            # The recomputed forward would run in backward, outside the scope, in high precision.
            "activation recomputation": self.config.recompute_granularity is not None,
        }
        for setting, is_on in unsupported.items():
            if is_on:
                raise NotImplementedError(
                    f"{type(self).__name__} does not support {setting} yet; "
                    "build this layer from Megatron's plain local spec instead"
                )

    def _fp8_local_gemm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scope: Fp8Scope
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` on this rank's shard, FP8 operands, state in ``fp8_meta``."""
        # Only the module's own weight is cached, not one passed to forward (tied embeddings).
        owns_weight = weight is self.weight
        cached = self._reusable_weight() if owns_weight else None
        track = self.probe.track() if self.probe is not None else None
        # A phase's recipe runs without the module's FP8 state, which it leaves frozen; its
        # casts are recorded where the module keeps a record (a stateless run's module).
        meta = self.fp8_meta if self.phase_recipe is None else None
        out, weight_fp8 = fp8_linear(
            x,
            weight,
            bias,
            meta,
            scope,
            gemm=self.gemm,
            cached_weight=cached,
            track=track,
            record=self.cast_record,
            recipe=None if meta is not None else (self.phase_recipe or self.recipe),
            gemms=self.fp8_gemms,
        )
        if self.probe is not None:
            self.probe.fp8_call(x, out, weight, bias, fp8_gemms=self.fp8_gemms)
        if self.is_first_microbatch and owns_weight:
            self._weight_fp8, self._weight_fp8_version = weight_fp8, weight._version
        if self.is_first_microbatch is not None:
            self.is_first_microbatch = False
        return out

    def _reusable_weight(self):
        """The FP8 weight cast on this step's first micro-batch, when this is a later one."""
        if self.is_first_microbatch is not False or self._weight_fp8 is None:
            return None  # None: no micro-batching; or told to reuse before any cast: cast now
        # _version counts in-place writes (an optimizer step is one): reusing a cast of older
        # weights would silently train on stale values.
        if self.weight._version != self._weight_fp8_version:
            raise RuntimeError(
                f"{type(self).__name__}: is_first_microbatch is False but the weight changed "
                "since its FP8 cast; call mark_first_microbatch(model) before the first "
                "micro-batch of every step"
            )
        return self._weight_fp8

    # The FP8 state in checkpoints, under TE's _extra_state names (tensors only). Megatron's
    # load pre-hook passes None for checkpoints without it: the state is then left as it is.
    # A TE module's payload (a model trained with TE's layer spec) loads too, read without
    # running its pickle (fp8ops.megatron.te_extra_state), if its recipe is this module's.
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {} if self.fp8_meta is None else self.fp8_meta.state_dict()

    def set_extra_state(self, state: dict[str, torch.Tensor] | torch.Tensor | None) -> None:
        if state is None:
            return
        if self.fp8_meta is None:  # a stateless recipe keeps nothing; what was saved is not used
            return
        where = f"{type(self).__name__}._extra_state"
        loaded = read_extra_state(state, where=where)
        if loaded is None:  # TE's empty payload: that module had no FP8 state
            return
        differences = recipe_differences(loaded.recipe, self.fp8_meta.recipe)
        if differences:
            raise Fp8opsError(
                f"{where}: the TE state was made under another recipe ({'; '.join(differences)}); "
                "build this model from a manifest with that recipe to load it"
            )
        self.fp8_meta.load_state_dict(loaded.tensors)


class Fp8ColumnParallelLinear(_Fp8LocalGemm, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` (``Y = X A^T``, A split by output rows) with an FP8 GEMM."""

    def _unsupported_settings(self) -> dict[str, bool]:
        return {
            "disable_grad_reduce": self.disable_grad_reduce,
            "defer_embedding_wgrad_compute": self.config.defer_embedding_wgrad_compute,
        }

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        scope = active_scope()
        if scope is None or not self.fp8_enabled:
            if self.probe is not None:
                self.probe.fallback_call(
                    input_,
                    self.weight if weight is None else weight,
                    sequence_group=self.tp_group if self.sequence_parallel else None,
                )
            return super().forward(input_, weight, runtime_gather_output)
        if weight is None:
            weight = self.weight
        if self.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]: gathered; backward reduce-scatters its gradient.
            input_parallel = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=self.tp_group
            )
        else:
            # [s, b, h] replicated on every TP rank; backward all-reduces its gradient.
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        output_parallel = self._fp8_local_gemm(input_parallel, weight, bias, scope)  # [s, b, h/tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class Fp8RowParallelLinear(_Fp8LocalGemm, RowParallelLinear):
    """Megatron's ``RowParallelLinear`` (A split by input columns) with an FP8 GEMM."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        scope = active_scope()
        if scope is None or not self.fp8_enabled:
            if self.probe is not None:
                self.probe.fallback_call(input_, self.weight)
            return super().forward(input_)
        if self.input_is_parallel:
            input_parallel = input_  # [s, b, h/tp]: already this rank's slice
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # The bias is added once, after the reduction, not on every rank's partial sum.
        output_parallel = self._fp8_local_gemm(input_parallel, self.weight, None, scope)
        if self.sequence_parallel:  # partial sums -> this rank's [s/tp, b, h], summed
            output = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


FP8_PARALLEL_LINEARS = (Fp8ColumnParallelLinear, Fp8RowParallelLinear)


def fp8_modules(model: nn.Module) -> dict[str, Fp8ColumnParallelLinear | Fp8RowParallelLinear]:
    """The model's FP8 linears by fully qualified name, in module order, with each layer named
    by its global number: under pipeline parallelism a stage's ``decoder.layers.0`` is the
    model's layer ``offset + 0`` (Megatron's ``layer_number``, 1-based), as checkpoints,
    telemetry and manifests name it."""
    return {
        global_layer_name(model, name): m
        for name, m in model.named_modules()
        if isinstance(m, FP8_PARALLEL_LINEARS)
    }


def global_layer_name(model: nn.Module, name: str) -> str:
    """``decoder.layers.{i}.rest`` with this stage's local ``i`` replaced by the global layer
    (Megatron's ``layer_number`` - 1); other names, and layers without a number (a model not
    built by Megatron's ``TransformerBlock``), as they are."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local = name[len(prefix) :].partition(".")[0]
    number = getattr(model.get_submodule(prefix + local), "layer_number", None)
    if number is None:
        return name
    return global_name(name, layer_offset=number - 1 - int(local))


def mark_first_microbatch(model: nn.Module) -> None:
    """Before the first micro-batch of a step: every FP8 linear casts its weight once and reuses
    that FP8 copy for the step's later micro-batches. Megatron's TE linears keep the same flag
    (``TELinear.is_first_microbatch``), so they are marked too."""
    for module in model.modules():
        if hasattr(module, "is_first_microbatch"):
            module.is_first_microbatch = True
