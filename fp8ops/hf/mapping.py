"""Which rows of which Hugging Face tensors make each Megatron-Core parameter on a TP rank.

One table serves import and export. For every parameter of the GPT (by its name in Megatron's
local spec), :func:`shard_plan` lists the pieces its rank's shard is made of, in order along
the shard's first dimension: a row range of a Hugging Face tensor (or a column range, for the
row-parallel projections), or zero rows (the vocabulary padding). Import reads exactly those
ranges (safetensors' lazy slices) and joins them; export at TP 1 cuts the full parameter at the
same boundaries and joins each Hugging Face tensor's pieces back in row order.

The layouts that matter (they load without error when wrong, and only logits show it):

- ``linear_qkv`` is per query group: for each group, its ``heads / groups`` query heads, then
  its key head, then its value head. A TP rank holds whole groups, so ``groups % TP == 0``.
- ``linear_fc1`` is ``[gate; up]`` on every rank: rank r holds gate's r-th chunk, then up's.
  (A plain chunk of the fused full tensor gives each rank the wrong halves.)
- ``linear_proj`` and ``linear_fc2`` split their columns; norms are whole on every rank.
- The embedding (and an untied output layer) is padded with zero rows up to Megatron's padded
  vocabulary; export drops them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of Hugging Face tensor ``key`` (columns, if ``dim`` is 1); ``key``
    None: ``stop - start`` rows of zeros."""

    key: str | None
    start: int
    stop: int
    dim: int = 0

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Shard:
    """One parameter of a rank: its pieces, joined along ``dim``, and the full Hugging Face
    shapes they come from (checked before any is read)."""

    pieces: tuple[Piece, ...]
    dim: int = 0


def hf_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this model holds, with its shape."""
    hidden, ffn = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    heads = model_cfg.num_attention_heads
    groups = model_cfg.num_query_groups or heads
    head_dim = model_cfg.kv_channels or hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (model_cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not model_cfg.tied_embeddings:
        shapes["lm_head.weight"] = (model_cfg.vocab_size, hidden)
    for layer in range(model_cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (groups * head_dim, hidden),
            p + "self_attn.v_proj.weight": (groups * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
        if model_cfg.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if model_cfg.add_bias_linear or model_cfg.add_qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (groups * head_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (groups * head_dim,)
        if model_cfg.add_bias_linear:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
            shapes[p + "mlp.gate_proj.bias"] = (ffn,)
            shapes[p + "mlp.up_proj.bias"] = (ffn,)
            shapes[p + "mlp.down_proj.bias"] = (hidden,)
    return shapes


def shard_plan(model_cfg, padded_vocab: int, tp: int, rank: int) -> dict[str, Shard]:
    """Each Megatron parameter of TP rank ``rank`` of ``tp``, by its local-spec name, as the
    pieces of Hugging Face tensors it is made of (module docstring). The manifest's own
    rules guarantee that ``tp`` divides the heads, the key/value groups and the MLP width."""
    hidden, ffn = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    heads = model_cfg.num_attention_heads
    groups = model_cfg.num_query_groups or heads
    head_dim = model_cfg.kv_channels or hidden // heads

    def whole(key: str, size: int) -> Shard:
        return Shard((Piece(key, 0, size),))

    def rows(key: str, size: int) -> Piece:  # this rank's chunk of a column-parallel tensor
        return Piece(key, rank * size // tp, (rank + 1) * size // tp)

    def columns(key: str, size: int) -> Shard:  # this rank's chunk of a row-parallel tensor
        return Shard((Piece(key, rank * size // tp, (rank + 1) * size // tp, dim=1),), dim=1)

    def vocab(key: str) -> Shard:
        start, stop = rank * padded_vocab // tp, (rank + 1) * padded_vocab // tp
        real = Piece(key, min(start, model_cfg.vocab_size), min(stop, model_cfg.vocab_size))
        pad = Piece(None, real.size, stop - start)
        return Shard(tuple(p for p in (real, pad) if p.size))

    def qkv(attn: str, suffix: str) -> Shard:  # this rank's whole query groups, in order
        per_group = heads // groups * head_dim
        pieces = []
        for group in range(rank * groups // tp, (rank + 1) * groups // tp):
            pieces += [
                Piece(f"{attn}q_proj.{suffix}", group * per_group, (group + 1) * per_group),
                Piece(f"{attn}k_proj.{suffix}", group * head_dim, (group + 1) * head_dim),
                Piece(f"{attn}v_proj.{suffix}", group * head_dim, (group + 1) * head_dim),
            ]
        return Shard(tuple(pieces))

    plan = {
        "embedding.word_embeddings.weight": vocab("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": whole("model.norm.weight", hidden),
    }
    if not model_cfg.tied_embeddings:
        plan["output_layer.weight"] = vocab("lm_head.weight")
    for layer in range(model_cfg.num_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        plan |= {
            mc + "input_layernorm.weight": whole(hf + "input_layernorm.weight", hidden),
            mc + "pre_mlp_layernorm.weight": whole(hf + "post_attention_layernorm.weight", hidden),
            mc + "self_attention.linear_qkv.weight": qkv(attn, "weight"),
            mc + "self_attention.linear_proj.weight": columns(
                attn + "o_proj.weight", heads * head_dim
            ),
            mc + "mlp.linear_fc1.weight": Shard(
                (rows(mlp + "gate_proj.weight", ffn), rows(mlp + "up_proj.weight", ffn))
            ),
            mc + "mlp.linear_fc2.weight": columns(mlp + "down_proj.weight", ffn),
        }
        if model_cfg.qk_layernorm:
            plan[mc + "self_attention.q_layernorm.weight"] = whole(attn + "q_norm.weight", head_dim)
            plan[mc + "self_attention.k_layernorm.weight"] = whole(attn + "k_norm.weight", head_dim)
        if model_cfg.add_bias_linear or model_cfg.add_qkv_bias:
            plan[mc + "self_attention.linear_qkv.bias"] = qkv(attn, "bias")
        if model_cfg.add_bias_linear:
            # Row-parallel biases are whole on every rank (added once, after the reduction).
            plan[mc + "self_attention.linear_proj.bias"] = whole(attn + "o_proj.bias", hidden)
            plan[mc + "mlp.linear_fc1.bias"] = Shard(
                (rows(mlp + "gate_proj.bias", ffn), rows(mlp + "up_proj.bias", ffn))
            )
            plan[mc + "mlp.linear_fc2.bias"] = whole(mlp + "down_proj.bias", hidden)
    return plan


# Megatron's TE spec fuses the two layer norms into the linears that follow them.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def parameter_names(plan: dict[str, Shard], model_names: set[str]) -> dict[str, str]:
    """The model's own name for each planned parameter: the local spec's, or the TE spec's."""
    names = {}
    for name in plan:
        names[name] = name
        for local, te in TE_NAMES.items():
            if name.endswith(local) and name not in model_names:
                names[name] = name.removesuffix(local) + te
    return names
