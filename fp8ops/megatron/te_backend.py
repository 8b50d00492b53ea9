"""The Transformer Engine path: Megatron's TE layer spec under TE's own delayed scaling.

On a GPU machine with Transformer Engine, the production model is Megatron's TE GPT spec
(``TELayerNormColumnParallelLinear`` and friends), its FP8 state in TE's ``fp8_meta`` and its
scope TE's ``fp8_autocast``. Megatron enters that scope itself: with ``config.fp8`` set and the
delayed recipe, ``TransformerBlock.forward`` wraps the whole decoder pass in ``get_fp8_context``,
which builds a ``DelayedScaling`` from the config's fp8 fields (set here from the manifest) and
takes Megatron's amax reduction group; the autocast's exit then reduces and updates once per
micro-batch forward, the cadence fp8ops' own scope follows. Module names match the emulated spec
(``spec.py``), so telemetry and manifests' globs name the same modules on both.

Per-module BF16 under delayed scaling. Megatron's own BF16 first and last layers are refused
under delayed scaling (its per-layer contexts would reduce amaxes once per layer, reference
§7). Every projection is built, by ModuleSpec, as a subclass of its TE class
(:func:`bf16_capable`) that carries fp8ops' ``fp8_enabled`` flag, as fp8ops' own FP8 layers do.
With the flag False its forward runs inside a *nested, disabled* TE autocast, the mechanism
Megatron 0.16's ``quant_recipe`` overrides use too: TE then neither casts its GEMMs nor records
an amax for it, and the nested exit does not reduce (only the outermost, enabled exit does,
``FP8GlobalStateManager.autocast_exit``). A module that ran in FP8 before stays registered in
TE's amax buffer (TE registers once per module), with a zero amax each step, which TE's fused
update neither rolls nor rescales: its state stays frozen. TE's unfused Python update
(``NVTE_UNFUSED_FP8_UPDATE=1``) would roll it, and differs from the fused kernel fp8ops'
update reproduces, so it is refused. Every other module's amaxes are reduced and updated once
per step as before. :func:`build_gpt_te` sets the flag for the modules named in
``precision.overrides`` (approved fallbacks) and in ``bf16_modules``.

Everywhere else :func:`te_available` is False and :func:`build_gpt_te` refuses with the fallback
to use, so callers and tests skip cleanly. The trainer runs a TE model as it runs fp8ops' own:
admission lists and switches its projections (``fp8ops.admission``), and its telemetry,
checkpoints and cross-rank checks read TE's own ``fp8_meta`` through
``te_telemetry.te_telemetry_modules`` (``model.fp8_state_modules`` chooses). Its scope is TE's
autocast, which Megatron enters; fp8ops' ``Fp8Scope`` stays out.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterable
from dataclasses import replace

import torch

from fp8ops.errors import Fp8opsError
from fp8ops.megatron import compat
from fp8ops.megatron.config import DTYPES, gpt_model_args, transformer_config
from fp8ops.megatron.rope import set_rope_scaling
from fp8ops.megatron.te_state import is_te_projection

UNFUSED_UPDATE_ENV = "NVTE_UNFUSED_FP8_UPDATE"  # TE's switch to its Python scaling update
# TE >= 2.15 makes it every recipe's default backward_override (read when TE is imported), and
# DelayedScaling asserts that it is None: Megatron's recipe and TE's default one would fail.
BACKWARD_OVERRIDE_ENV = "NVTE_BACKWARD_OVERRIDE"

# TE's FP8 GEMMs take inputs whose leading dimensions (the tokens) multiply to a multiple of 8
# (transformer_engine/pytorch/utils.py::assert_dim_for_fp8_exec).
FP8_TOKEN_MULTIPLE = 8


def te_available() -> bool:
    """True where Transformer Engine's PyTorch side imports (CUDA and TE installed)."""
    return compat.transformer_engine_pytorch() is not None


def te_transformer_config(manifest):
    """The manifest's TransformerConfig with Megatron's FP8 fields set from its recipe."""
    precision = manifest.precision
    algo = precision.amax_algo
    # What Megatron's config cannot carry to TE must be refused, not dropped.
    if not precision.enabled:
        raise Fp8opsError(
            "precision.enabled is false: a run without FP8 needs no TE spec; build it with "
            "fp8ops.megatron.build_gpt(manifest, None)"
        )
    if algo.kind not in ("max", "most_recent"):
        raise Fp8opsError(
            f"precision.amax_compute_algo {precision.amax_compute_algo!r}: Megatron's TE path "
            "supports only 'max' and 'most_recent'; use one of them, or the emulated backend"
        )
    if manifest.model.seq_length % FP8_TOKEN_MULTIPLE:
        raise Fp8opsError(
            f"model.seq_length {manifest.model.seq_length}: TE's FP8 GEMMs take token counts in "
            f"multiples of {FP8_TOKEN_MULTIPLE}, and a batch holds whole sequences; use a "
            f"multiple of {FP8_TOKEN_MULTIPLE}, or the emulated backend"
        )
    if not precision.reduce_amax:
        raise Fp8opsError(
            "precision.reduce_amax is false, but Megatron always builds TE's DelayedScaling with "
            "amax reduction on; use true, or the emulated backend"
        )
    unfused = os.environ.get(UNFUSED_UPDATE_ENV, "0")
    if not _reads_as_zero(unfused):  # as TE reads it, int(): "00" is off, "1" and "x" are not
        raise Fp8opsError(
            f"{UNFUSED_UPDATE_ENV}={unfused}: TE's unfused scaling update rolls the history of a "
            "module held in BF16 and computes scales in another order than the fused kernel "
            "fp8ops' update reproduces bit for bit; unset it for the TE backend"
        )
    if BACKWARD_OVERRIDE_ENV in os.environ:
        raise Fp8opsError(
            f"{BACKWARD_OVERRIDE_ENV}={os.environ[BACKWARD_OVERRIDE_ENV]!r}: TE makes it the "
            "default backward_override of every recipe, and its DelayedScaling accepts none (an "
            "assertion when Megatron builds the recipe); unset it for the TE backend"
        )
    return replace(
        transformer_config(manifest),
        fp8=precision.fp8_format,
        fp8_recipe="delayed",
        fp8_margin=precision.margin,
        fp8_amax_history_len=precision.amax_history_len,
        fp8_amax_compute_algo=algo.kind,
        tp_only_amax_red=manifest.topology.amax_reduction == "tp_cp",
        use_cpu_initialization=False,
    )


def _reads_as_zero(value: str) -> bool:
    try:
        return int(value) == 0
    except ValueError:
        return False


PROJECTIONS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@functools.cache
def bf16_capable(te_class: type) -> type:
    """``te_class`` (a Megatron TE linear) with fp8ops' ``fp8_enabled`` flag: while it is False,
    the module runs in its parameters' dtype inside the outer delayed-scaling autocast (module
    docstring). One subclass per TE class, named after it."""

    def __init__(self, *args, **kwargs):
        te_class.__init__(self, *args, **kwargs)
        self.fp8_enabled = True

    def forward(self, *args, **kwargs):
        if self.fp8_enabled:
            return te_class.forward(self, *args, **kwargs)
        with _te_autocast_disabled():
            return te_class.forward(self, *args, **kwargs)

    return type(
        f"{te_class.__name__}Bf16Capable",
        (te_class,),
        {"__init__": __init__, "forward": forward, "__doc__": bf16_capable.__doc__},
    )


def _te_autocast_disabled():
    te = compat.transformer_engine_pytorch()
    # TE 2.9 added autocast (fp8_autocast is deprecated); both take enabled= and restore the
    # outer state.
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    return autocast(enabled=False)


def with_bf16_capable_projections(layer_spec, wrap=bf16_capable):
    """A copy of a GPT layer spec whose four projections are built as ``wrap(their class)``
    (a class or a ModuleSpec's module); the layer spec itself is not modified."""
    layer = layer_spec.submodules
    blocks = {"self_attention": layer.self_attention, "mlp": layer.mlp}
    for path in PROJECTIONS:
        block_name, slot = path.split(".")
        block = blocks[block_name]
        current = getattr(compat.block_submodules(block), slot)
        if isinstance(current, compat.ModuleSpec):
            swapped = replace(current, module=wrap(current.module))
        else:
            swapped = wrap(current)
        blocks[block_name] = compat.with_block_submodules(block, **{slot: swapped})
    return replace(layer_spec, submodules=replace(layer, **blocks))


def bf16_module_names(manifest, extra: Iterable[str] = ()) -> set[str]:
    """The projections to run in BF16: approved fallbacks (``precision.overrides``) and
    ``extra``, each checked to be one of the model's projections."""
    names = {o.module for o in manifest.precision.overrides} | set(extra)
    known = {
        f"decoder.layers.{i}.{p}" for i in range(manifest.model.num_layers) for p in PROJECTIONS
    }
    unknown = sorted(names - known)
    if unknown:
        raise Fp8opsError(
            f"BF16 overrides name {', '.join(unknown)}, which are not projections of this "
            f"{manifest.model.num_layers}-layer model (decoder.layers.<i>.<{'|'.join(PROJECTIONS)}>)"
        )
    return names


def te_projections(model) -> dict:
    """The decoder's BF16-capable TE projections (:func:`bf16_capable`) by fully qualified
    name, in module order."""
    return {
        name: module
        for name, module in model.named_modules()
        if is_te_projection(module) and name.split(".", 1)[0] == "decoder"
    }


def set_bf16_modules(model, names: Collection[str]) -> None:
    """Run the named projections in BF16 from the next forward (the others in FP8)."""
    for name, module in te_projections(model).items():
        module.fp8_enabled = name not in names


def build_gpt_te(manifest, bf16_modules: Iterable[str] = ()):
    """The manifest's GPT from Megatron's TE spec, on the GPU. Its weights are drawn from
    ``seeds.model`` by TE's own initialisation, each TP rank its shard from Megatron's per-rank
    CUDA seed: not the weights :func:`~fp8ops.megatron.build_gpt` draws on the CPU, nor at TP=2
    the TP=1 weights split. A run from ``model.init_checkpoint`` (fine-tuning) loads the same
    weights on either backend. Megatron's parallel state must be initialised. The projections
    in ``precision.overrides`` and ``bf16_modules`` run in BF16 inside the delayed-scaling
    autocast (module docstring)."""
    if not te_available():
        raise Fp8opsError(
            "the Transformer Engine backend needs a CUDA GPU and transformer_engine.pytorch; "
            "neither is usable here, so use the emulated backend (fp8ops.megatron.build_gpt)"
        )
    names = bf16_module_names(manifest, bf16_modules)
    model_cfg = manifest.model
    torch.manual_seed(manifest.seeds.model)
    compat.tensor_parallel.model_parallel_cuda_manual_seed(manifest.seeds.model)
    model = compat.GPTModel(
        config=te_transformer_config(manifest),
        transformer_layer_spec=with_bf16_capable_projections(
            compat.te_gpt_layer_spec(qk_layernorm=model_cfg.qk_layernorm)
        ),
        **gpt_model_args(manifest),
    )
    set_rope_scaling(model, model_cfg)
    set_bf16_modules(model, names)
    return model.to(device="cuda", dtype=DTYPES[manifest.precision.base_dtype])
