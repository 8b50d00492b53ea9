"""Megatron's description of the manifest's model: its ``TransformerConfig`` and ``GPTModel``'s
other arguments, the same for both backends (``model.build_gpt``, ``te_backend.build_gpt_te``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8ops.megatron import compat
from fp8ops.megatron.compat import TransformerConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_config(manifest) -> TransformerConfig:
    """Megatron's TransformerConfig for the manifest's model and tensor parallelism."""
    model_cfg = manifest.model
    dtype = DTYPES[manifest.precision.base_dtype]
    swiglu = model_cfg.activation == "swiglu"
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.kv_channels,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.layernorm_epsilon,
        add_bias_linear=model_cfg.add_bias_linear,
        add_qkv_bias=model_cfg.add_qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        activation_func=F.silu if swiglu else F.gelu,
        gated_linear_unit=swiglu,
        tensor_model_parallel_size=manifest.topology.tensor_parallel,
        sequence_parallel=manifest.topology.sequence_parallel,
        pipeline_model_parallel_size=manifest.topology.pipeline_parallel,
        # What stages send each other (fp8ops.megatron.pipeline): activations in the base dtype.
        pipeline_dtype=dtype,
        # Without CUDA there is nothing to synchronise after the batched sends and receives.
        batch_p2p_sync=torch.cuda.is_available(),
        # The pipeline's loss functions return losses already divided by the global batch's
        # token count (fp8ops' per-token loss): the schedule must not divide them again.
        calculate_per_token_loss=True,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        # The manifest has no dropout: fp8ops fine-tunes without it, so a run is reproducible
        # step by step and across TP layouts (Megatron seeds dropout per TP rank).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Every rank draws the full weight from one CPU stream and keeps its shard, so a TP=2
        # model is exactly the TP=1 model split (tests/test_train.py checks TP=2 against TP=1).
        use_cpu_initialization=True,
        **compat.whole_layer_cuda_graphs(),
    )


def gpt_model_args(manifest) -> dict:
    """GPTModel's arguments from the manifest, besides its config and layer spec."""
    model_cfg = manifest.model
    return {
        "vocab_size": padded_vocab_size(model_cfg.vocab_size, manifest.topology.tensor_parallel),
        "max_sequence_length": model_cfg.seq_length,
        "position_embedding_type": model_cfg.position_embedding,
        "rotary_base": model_cfg.rotary_base,
        "share_embeddings_and_output_weights": model_cfg.tied_embeddings,
    }


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """The embedding's row count: ``vocab_size`` padded to a multiple of 128, and further to a
    multiple of 128 x TP only if TP does not divide that.

    Megatron-LM always pads to 128 x TP, so a checkpoint's embedding shape depends on the TP it
    was trained at. Padding that does not depend on TP (for every TP up to 128 that is a power
    of two) lets a base trained at TP=1 load at TP=2, 4 or 8; the padded rows' logits join the
    softmax, so equal padding also keeps losses comparable across layouts.
    """
    padded = math.ceil(vocab_size / divisible_by) * divisible_by
    if padded % tensor_parallel:
        multiple = divisible_by * tensor_parallel
        padded = math.ceil(vocab_size / multiple) * multiple
    return padded
