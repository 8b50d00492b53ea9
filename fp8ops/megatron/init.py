"""Initial weights that depend on ``seeds.model`` and on nothing about the topology.

Megatron draws every weight from one generator in the order its modules are built. Under
``use_cpu_initialization`` each rank draws a weight whole and keeps its tensor-parallel slice,
so TP does not change the model; but a pipeline stage builds only its own layers, and its
generator reaches them after other draws than the unpipelined model's. So every random weight
is drawn again here from a generator seeded by ``seeds.model`` and the weight's global name
(``decoder.layers.{global layer}.…``), with the initialisation Megatron gave it (its config's
``init_method``, ``output_layer_init_method`` or ``embedding_init_method``), whole and in
float32, then cast and sliced as Megatron slices it. The model is the same at every TP and PP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from fp8ops.megatron.layers import global_layer_name

# The last two parts of a random weight's name -> the config attribute of its initialisation
# (Megatron's: attention's output and fc2 scaled by depth; embeddings by their own std).
INIT_METHODS = {
    "linear_qkv.weight": "init_method",
    "linear_fc1.weight": "init_method",
    "linear_proj.weight": "output_layer_init_method",
    "linear_fc2.weight": "output_layer_init_method",
    "output_layer.weight": "init_method",
    "word_embeddings.weight": "embedding_init_method",
    "position_embeddings.weight": "embedding_init_method",
}
# A tied output layer on the last stage is a copy of the first stage's embedding.
TIED_COPY = ("output_layer.weight", "embedding.word_embeddings.weight")


def init_by_global_name(model: nn.Module, config, seed: int, tp_rank: int, tp_size: int) -> None:
    """Draw every random weight of ``model`` (this rank's part of a Megatron GPT) again from
    ``seed`` and its global name (module docstring). Every other parameter (biases, norms)
    must be constant as Megatron built it; one that is not is refused by name, since a weight
    drawn here by the wrong rule would make a model that differs by topology."""
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for name, param in model.named_parameters():
            global_name = global_layer_name(model, name)
            if tied and global_name == TIED_COPY[0]:
                global_name = TIED_COPY[1]
            method = INIT_METHODS.get(".".join(global_name.split(".")[-2:]))
            if method is None:
                if param.numel() and not bool((param == param.flatten()[0]).all()):
                    raise RuntimeError(
                        f"{name}: a parameter drawn at random that fp8ops does not know how to "
                        "draw by its global name (fp8ops/megatron/init.py, INIT_METHODS)"
                    )
                continue
            torch.manual_seed(_seed(seed, global_name))
            param.copy_(_this_rank(param, _init_method(config, method), tp_rank, tp_size))


def _init_method(config, attribute: str) -> Callable[[torch.Tensor], object]:
    # Megatron before 0.16 has no embedding_init_method: embeddings took init_method.
    return getattr(config, attribute, None) or config.init_method


def _seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _this_rank(param: torch.Tensor, init: Callable, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The whole weight drawn in float32 by ``init`` and cast to the parameter's dtype, then this
    TP rank's slice, as Megatron's ``_initialize_affine_weight_cpu`` takes it (its chunks of
    ``size / stride`` rows, every ``tp_size``-th from ``tp_rank``)."""
    split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    dim = param.partition_dim if split else 0
    shape = list(param.shape)
    shape[dim] *= tp_size if split else 1
    whole = torch.empty(shape, dtype=torch.float32)
    init(whole)
    whole = whole.to(param.dtype)
    if not split:
        return whole
    chunk = param.shape[dim] // getattr(param, "partition_stride", 1)
    return torch.cat(torch.split(whole, chunk, dim=dim)[tp_rank::tp_size], dim=dim)
