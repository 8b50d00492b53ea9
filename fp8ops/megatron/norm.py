"""The norm a GPT layer uses under sequence parallelism on a machine without Apex.

Megatron's local spec takes Apex's ``FusedLayerNorm`` when Apex is installed and otherwise
``WrappedTorchNorm`` (torch's ``LayerNorm`` / ``RMSNorm``), which refuses sequence parallelism:
under it each tensor-parallel rank normalises its part of the sequence, so a norm's weight
gradient is a partial sum that must be summed over TP before the step, and only
``FusedLayerNorm`` marks its parameters ``sequence_parallel`` for that. :class:`SequenceParallelNorm`
is torch's norm with that mark; ``spec.with_sequence_parallel_norms`` puts it in the layer and
block specs, and fp8ops' optimizers sum the marked gradients (Megatron's
``finalize_model_grads`` rule).
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """torch's ``LayerNorm`` or ``RMSNorm`` (``config.normalization``) built from Megatron's norm
    arguments, its parameters marked ``sequence_parallel`` as ``config`` says."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        # Megatron's norm signature; unused, as in WrappedTorchNorm (config.normalization decides).
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"no sequence-parallel norm for {config.normalization!r}")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
