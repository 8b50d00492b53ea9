"""Rotary frequencies as Hugging Face computes them, for ``model.rope_scaling``.

Megatron-Core's own llama3 scaling takes only the factor: it fixes the blend at
``low_freq_factor=1``, ``high_freq_factor=4`` and an original context of 8192, so any other
values would load without error and give other logits. fp8ops computes the frequencies from all
four parameters instead, in float32 and in the same operations as transformers'
``_compute_llama3_parameters`` (and ``linear``: every frequency divided by the factor), and sets
them on the model's rotary embedding before its first forward: ``RotaryEmbedding.forward`` is
cached per sequence length, so a later assignment would be ignored for lengths already seen.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, base: float, scaling=None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies of RoPE with base ``base``, scaled by
    ``scaling`` (a manifest ``RopeScaling``, or None)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base**steps)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def set_rope_scaling(model, model_cfg) -> None:
    """Give ``model``'s rotary embedding the frequencies of ``model_cfg.rope_scaling`` (a no-op
    without scaling). Call it before the model's first forward (module docstring)."""
    if model_cfg.rope_scaling is None:
        return
    rotary = model.rotary_pos_emb
    head_dim = rotary.inv_freq.numel() * 2
    rotary.inv_freq = inverse_frequencies(
        head_dim, model_cfg.rotary_base, model_cfg.rope_scaling
    ).to(rotary.inv_freq.device)
    type(rotary).forward.cache_clear()
