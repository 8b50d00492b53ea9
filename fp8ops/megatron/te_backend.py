"""The Transformer Engine path: Megatron's TE layer spec under TE's own delayed scaling.

On a GPU machine with Transformer Engine, the production model is Megatron's TE GPT spec
(``TELayerNormColumnParallelLinear`` and friends), its FP8 state in TE's ``fp8_meta`` and its
scope TE's ``fp8_autocast``. Megatron enters that scope itself: with ``config.fp8`` set and the
delayed recipe, ``TransformerBlock.forward`` wraps the whole decoder pass in ``get_fp8_context``,
which builds a ``DelayedScaling`` from the config's fp8 fields (set here from the manifest) and
takes Megatron's amax reduction group; the autocast's exit then reduces and updates once per
micro-batch forward, the cadence fp8ops' own scope follows. Module names match the emulated spec
(``spec.py``), so telemetry and manifests' globs name the same modules on both.

Everywhere else :func:`te_available` is False and :func:`build_gpt_te` refuses with the fallback
to use, so callers and tests skip cleanly. Per-module BF16 overrides inside the TE autocast and
telemetry from TE's buffers are the GPU issue's work; admission's decisions apply to the emulated
backend only for now.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fp8ops.errors import Fp8opsError
from fp8ops.megatron import compat


def te_available() -> bool:
    """True where Transformer Engine's PyTorch side imports (CUDA and TE installed)."""
    return compat.transformer_engine_pytorch() is not None


def te_transformer_config(manifest):
    """The manifest's TransformerConfig with Megatron's FP8 fields set from its recipe."""
    from fp8ops.megatron.model import transformer_config

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
    if not precision.reduce_amax:
        raise Fp8opsError(
            "precision.reduce_amax is false, but Megatron always builds TE's DelayedScaling with "
            "amax reduction on; use true, or the emulated backend"
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


def build_gpt_te(manifest):
    """The manifest's GPT from Megatron's TE spec, on the GPU; weights drawn from
    ``seeds.model`` as :func:`~fp8ops.megatron.build_gpt` draws them. Megatron's parallel state
    must be initialised."""
    if not te_available():
        raise Fp8opsError(
            "the Transformer Engine backend needs a CUDA GPU and transformer_engine.pytorch; "
            "neither is usable here, so use the emulated backend (fp8ops.megatron.build_gpt)"
        )
    from fp8ops.megatron.model import DTYPES, padded_vocab_size

    model_cfg, topology = manifest.model, manifest.topology
    torch.manual_seed(manifest.seeds.model)
    compat.tensor_parallel.model_parallel_cuda_manual_seed(manifest.seeds.model)
    model = compat.GPTModel(
        config=te_transformer_config(manifest),
        transformer_layer_spec=compat.te_gpt_layer_spec(),
        vocab_size=padded_vocab_size(model_cfg.vocab_size, topology.tensor_parallel),
        max_sequence_length=model_cfg.seq_length,
        position_embedding_type=model_cfg.position_embedding,
    )
    return model.to(device="cuda", dtype=DTYPES[manifest.precision.base_dtype])
