"""Tiny GGUF files written here the way llama.cpp's converter writes them: a Hugging Face Llama
made by support/hf_models.py, its query and key rows permuted per head into llama.cpp's order,
its matrices quantized to Q8_0 (norms kept in float32), its BPE vocabulary and merges as GGUF
tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, param = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{param}"


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of query/key rows (convert_hf_to_gguf.py's ``permute``)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path: Path, hf_dir: Path, *, architecture: str = "llama", extra: dict | None = None):
    """Write ``hf_dir`` (a Llama checkpoint with a BPE tokenizer.json) as the GGUF file ``path``;
    ``extra``: more ``llama.*`` float metadata, to test refusals."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    for key, value in (extra or {}).items():
        writer.add_float32(f"{architecture}.{key}", value)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    # GPT-2 style GGUF vocabularies hold <|endoftext|>; transformers adds it when one does not.
    padding = ["<|endoftext|>"] + [f"<unused{i}>" for i in range(config["vocab_size"])]
    tokens += padding[: config["vocab_size"] - len(tokens)]
    special = {added["content"] for added in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end_of_text|>{% endfor %}"
    )
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if name.endswith("q_proj.weight"):
            value = permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = permute(value, groups)
        if value.ndim == 2:
            quantized = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                gguf_name(name),
                quantized,
                raw_shape=quantized.shape,
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
