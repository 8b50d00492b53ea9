"""A Megatron-Core GPT from a manifest's ``model`` section.

The caller owns the process groups (``fp8ops.train.distributed`` for a run; tests do it
themselves)::

    torch.distributed.init_process_group("gloo")      # "nccl" on GPUs
    tp = manifest.topology.tensor_parallel            # the world size is TP x PP x DP
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    recipe = recipe_from_precision(manifest.precision)    # delayed, current, block or mxfp8
    model = build_gpt(manifest, recipe)               # device="cuda" on a GPU
    scope = Fp8Scope(recipe, group=amax_reduction_group(manifest.topology))
    with scope():
        per_token_loss = model(tokens, position_ids, attention_mask=None, labels=labels)

``parallel_state`` is ``fp8ops.megatron.compat.parallel_state`` (Megatron's).

``precision.backend`` picks what runs the FP8 GEMMs: fp8ops' own layers with the emulated GEMM or
with ``torch._scaled_mm`` (one spec, another ``gemm`` argument), or Megatron's Transformer Engine
spec (``te_backend.py``), which refuses where TE cannot run.
"""

from __future__ import annotations

import torch

from fp8ops.errors import Fp8opsError
from fp8ops.megatron import compat
from fp8ops.megatron.compat import (
    GPTModel,
    get_gpt_layer_local_spec,
    get_num_layers_to_build,
    get_transformer_layer_offset,
    parallel_state,
    tensor_parallel,
)
from fp8ops.megatron.config import DTYPES, gpt_model_args, transformer_config
from fp8ops.megatron.cpu_shims import apply_cpu_shims
from fp8ops.megatron.init import init_by_global_name
from fp8ops.megatron.layers import fp8_modules
from fp8ops.megatron.quant_config import quant_recipe
from fp8ops.megatron.rope import set_rope_scaling
from fp8ops.megatron.spec import with_fp8_projections, with_sequence_parallel_norms
from fp8ops.megatron.te_backend import build_gpt_te, te_projections
from fp8ops.megatron.te_telemetry import te_telemetry_modules
from fp8ops.precision import DelayedScalingRecipe, EmulatedGemm, ScaledMmGemm, StatelessRecipe
from fp8ops.precision.scaled_mm import (
    ask_one_call_block_gemms,
    block_scaled_mm_unsupported,
    scaled_mm_unsupported,
)

# precision.backend -> the GEMM of fp8ops' FP8 layers ("te" builds Transformer Engine's instead).
GEMMS = {"emulated": EmulatedGemm, "scaled_mm": ScaledMmGemm}


def build_gpt(
    manifest,
    recipe: DelayedScalingRecipe | StatelessRecipe | None,
    *,
    device: torch.device | str | None = None,
) -> GPTModel:
    """The manifest's GPT on this rank, its four projections per layer in FP8 under ``recipe``.

    ``recipe=None`` builds the same model from Megatron's plain local spec: the high-precision
    reference. Both draw each initial weight from ``seeds.model`` and its global name
    (``init.py``), so they start identical, at every TP and PP; a manifest that names a base
    (``model.init_checkpoint``) is built with Megatron's own draws instead, for the base to
    overwrite (the caller loads it, or a checkpoint). Megatron's parallel state must be
    initialised (module docstring). On a machine without CUDA this applies the CPU shims
    (``cpu_shims.py``) first. The model is in
    ``precision.base_dtype`` on ``device`` (default: the CPU), its FP8 state with it. All four
    projections of every layer are built FP8-capable; which of them run FP8 is per-layer
    admission's decision (``fp8ops.admission``).

    ``precision.backend`` chooses the GEMM those projections run (``GEMMS``); ``te`` builds
    Megatron's Transformer Engine spec instead (:func:`~fp8ops.megatron.te_backend.build_gpt_te`),
    which refuses on a machine without a GPU and TE. Whether each FP8 module's per-rank GEMM
    fits the backend is admission's to decide (``fp8ops.admission.fp8_gemm_sizes``), not this.
    """
    backend = manifest.precision.backend
    if recipe is not None and backend == "te":
        return build_gpt_te(manifest)
    apply_cpu_shims()
    model_cfg, topology = manifest.model, manifest.topology
    _check_parallel_state(topology)
    device = torch.device("cpu" if device is None else device)
    if recipe is not None:
        check_gemms_run(manifest, device)

    # Seeds Megatron's RNG tracker as Megatron-LM's initialisation does. Megatron draws the
    # weights from torch's default generator (use_cpu_initialization) in build order, which
    # depends on the pipeline stage; init_by_global_name below draws them again by name (when
    # no base is loaded over them).
    torch.manual_seed(manifest.seeds.model)
    tensor_parallel.model_parallel_cuda_manual_seed(manifest.seeds.model)

    local_spec = get_gpt_layer_local_spec(
        normalization=model_cfg.normalization, qk_layernorm=model_cfg.qk_layernorm
    )
    if recipe is None:
        layer_spec = local_spec
    else:
        layer_spec = with_fp8_projections(local_spec, recipe, GEMMS[backend]())
    config = transformer_config(manifest)
    if topology.sequence_parallel:
        # A block spec lists the layers this pipeline stage builds, not the model's.
        layer_spec = with_sequence_parallel_norms(layer_spec, get_num_layers_to_build(config))
    if recipe is not None:
        # Megatron's GPTModel hands each matched projection its per-module recipe itself,
        # matching this stage's layers by their global numbers.
        config.quant_recipe = quant_recipe(
            manifest.precision, layer_offset=get_transformer_layer_offset(config)
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        # This pipeline stage's part: the embedding on the first, the LM head on the last.
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **gpt_model_args(manifest),
    )
    set_rope_scaling(model, model_cfg)
    # A fine-tuning run's weights come from its base (model.init_checkpoint), which overwrites
    # every one: drawing each whole weight again on every rank first would be wasted work.
    if model_cfg.init_checkpoint is None:
        init_by_global_name(
            model,
            config,
            manifest.seeds.model,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )
    # The local spec's torch norms are created in float32 whatever params_dtype says; casting
    # the whole model is what Megatron's Float16Module does to the module it wraps (the wrapper
    # itself would prefix every name with "module."). The FP8 state follows the device only.
    return model.to(device=device, dtype=DTYPES[manifest.precision.base_dtype])


def fp8_state_modules(model: GPTModel, recipe: DelayedScalingRecipe) -> dict:
    """The projections whose FP8 state a run observes, checkpoints and compares across ranks,
    by fully qualified name: fp8ops' own FP8 linears; on a TE model (``build_gpt_te``), TE's
    projections seen through ``te_telemetry`` as the same ``fp8_meta`` (TE's own tensors). On a
    TE model each call attaches telemetry hooks of its own: call it once per model, as the
    trainer does."""
    if te_projections(model):
        return te_telemetry_modules(model, recipe)
    return fp8_modules(model)


def check_gemms_run(manifest, device: torch.device) -> None:
    """Refuse a run whose FP8 GEMMs this device lacks, before anything is built or written
    (``build_gpt`` calls it; so does ``fp8ops dualtrack`` for every track before the first):
    on ``scaled_mm``, FP8 ``_scaled_mm`` at all, and the block-scaled GEMMs where the run or a
    module of it runs block scaling. (``te`` refuses in ``build_gpt_te``.)"""
    precision = manifest.precision
    if not precision.enabled or precision.backend != "scaled_mm":
        return
    reason = scaled_mm_unsupported(device)
    if reason is not None:
        raise Fp8opsError(
            f"precision.backend 'scaled_mm' cannot run here: {reason}; use precision.backend "
            "'emulated' (the same FP8 casts and scaling, multiplied in float32)"
        )
    fields = [("precision.scaling", precision.scaling)] + [
        (f"precision.module_recipes[{i}].scaling", entry.scaling)
        for i, entry in enumerate(precision.module_recipes)
    ]
    field = next((field for field, scaling in fields if scaling == "block"), None)
    reason = None if field is None else block_scaled_mm_unsupported(device)
    if reason is not None:
        raise Fp8opsError(
            f"{field} 'block' on precision.backend 'scaled_mm' cannot run here: {reason}; "
            "use precision.backend 'emulated' (the same casts, multiplied in float32)"
        )
    if field is not None:  # which block GEMMs run in one call: decided here, not mid-step
        hybrid = precision.fp8_format == "hybrid"
        ask_one_call_block_gemms(device, hybrid, (DTYPES[precision.base_dtype],))


def amax_reduction_group(topology) -> torch.distributed.ProcessGroup:
    """The group an :class:`~fp8ops.precision.Fp8Scope` reduces amaxes over, per
    ``topology.amax_reduction``: Megatron's TP x DP x CP group, or TP x CP for ``tp_cp``."""
    return compat.amax_reduction_group(tp_only=topology.amax_reduction == "tp_cp")


def _check_parallel_state(topology) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron's parallel state is not initialised: call "
            "parallel_state.initialize_model_parallel(tensor_model_parallel_size=...) "
            "after torch.distributed.init_process_group (see fp8ops/megatron/model.py)"
        )
    layout = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    )
    wanted = (topology.tensor_parallel, topology.pipeline_parallel, topology.data_parallel)
    if layout != wanted:
        raise ValueError(
            f"topology (tensor_parallel, pipeline_parallel, data_parallel) = {wanted}, but "
            f"Megatron's parallel state was initialised with TP, PP, DP = {layout}"
        )
