"""``fp8ops manifest from-hf``: a manifest for fine-tuning a Hugging Face checkpoint.

The ``model`` section is what ``config.json`` means (``config.model_fields``), the base the
checkpoint itself with its files' fingerprint; the ``tokenizer`` section is the checkpoint's own
``tokenizer.json``, fingerprinted. The rest are defaults a fine-tune of a pretrained model
starts from: TE's delayed-scaling recipe (hybrid formats, a 1024-step amax history), the
small-GEMM rule on so that GEMMs too small to gain from FP8 stay in bf16, from 1 B parameters
the first and last layers' projections in bf16 (the layers FP8 recipes for large models most
often spare), an LLM's learning rate, and the built-in tasks as data until ``--data`` names a
file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fp8ops.hf import checkpoint as files
from fp8ops.hf.config import CONFIG, HfCheckpointError, check_window, model_fields, read_config
from fp8ops.manifest import Manifest, parse_manifest
from fp8ops.manifest.canonical import to_yaml

DEFAULT_SEQ_LENGTH = 2048
# Below this many parameters the first and last layers stay in FP8 too: a small model has too
# few layers for two of them to be spared.
FIRST_LAST_BF16_PARAMETERS = 1_000_000_000


def manifest_from_hf(
    hf_dir: Path,
    *,
    name: str | None = None,
    seq_length: int | None = None,
    tensor_parallel: int = 1,
    data: Path | None = None,
) -> Manifest:
    """The manifest (module docstring) for fine-tuning ``hf_dir``."""
    from fp8ops.data.tokenizer import tokenizer_for
    from fp8ops.manifest.schema import TokenizerConfig

    hf_dir = Path(hf_dir)
    if not files.is_hf_checkpoint(hf_dir):
        raise HfCheckpointError(
            f"{hf_dir}: not a Hugging Face checkpoint directory (it needs {CONFIG} and "
            f"{files.SINGLE} or {files.INDEX})"
        )
    config = read_config(hf_dir)
    source = str(hf_dir / CONFIG)
    fields = model_fields(config, source=source)
    context = config.get("max_position_embeddings")
    seq_length = seq_length or min(context or DEFAULT_SEQ_LENGTH, DEFAULT_SEQ_LENGTH)
    if context is not None and seq_length > context:
        raise HfCheckpointError(
            f"--seq-length {seq_length} exceeds {source}'s max_position_embeddings {context}, "
            "the longest context the model was trained for; give at most that"
        )
    check_window(config, seq_length, source=source)
    if not (hf_dir / "tokenizer.json").is_file():
        raise HfCheckpointError(
            f"{hf_dir}: no tokenizer.json; fp8ops reads a Hugging Face tokenizer from its "
            "tokenizer.json (save it with the tokenizer's save_pretrained)"
        )
    tokenizer = TokenizerConfig(kind="huggingface", path=str(hf_dir))
    tokenizer = tokenizer.model_copy(update={"fingerprint": tokenizer_for(tokenizer).fingerprint()})
    parameters = _parameters(fields)
    include = ["*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2"]
    exclude = []
    if parameters >= FIRST_LAST_BF16_PARAMETERS and fields["num_layers"] > 2:
        exclude = ["decoder.layers.0.*", f"decoder.layers.{fields['num_layers'] - 1}.*"]
    document: dict[str, Any] = {
        "schema_version": 1,
        "name": name or _name(hf_dir),
        "precision": {
            "base_dtype": "bf16",
            "fp8_format": "hybrid",
            "scaling": "delayed",
            "amax_history_len": 1024,
            "amax_compute_algo": "max",
            "include_modules": include,
            "exclude_modules": exclude,
            "small_gemm": {"enabled": True},
        },
        "model": {
            **fields,
            "seq_length": seq_length,
            "init_checkpoint": str(hf_dir),
            "fingerprint": files.fingerprint(hf_dir),
        },
        "tokenizer": tokenizer.model_dump(mode="json", exclude_defaults=True),
        "data": {
            **({"kind": _data_kind(data), "path": str(data)} if data else {"kind": "tasks"}),
            "split_version": 2,
            "pad_to": "longest",
        },
        "optimizer": {"name": "adamw", "lr": 1.0e-5, "min_lr": 1.0e-6, "weight_decay": 0.0},
        "schedule": {
            "train_steps": 100,
            "warmup_steps": 10,
            "micro_batch_size": 1,
            "global_batch_size": 8,
            "lr_decay": "cosine",
            "log_interval": 10,
            "eval_interval": 50,
            "checkpoint_interval": 50,
        },
        "topology": {"tensor_parallel": tensor_parallel},
    }
    return parse_manifest(yaml.safe_dump(document), source=f"the manifest made from {hf_dir}")


def render(manifest: Manifest, hf_dir: Path) -> str:
    header = (
        f"# Fine-tune the Hugging Face checkpoint {hf_dir} (written by fp8ops manifest from-hf).\n"
        "# model and tokenizer come from its config.json and tokenizer.json; review the rest.\n"
    )
    return header + to_yaml(manifest)


def _parameters(fields: dict) -> int:
    hidden, layers = fields["hidden_size"], fields["num_layers"]
    heads, groups = fields["num_attention_heads"], fields["num_query_groups"]
    head_dim = fields["kv_channels"] or hidden // heads
    attention = hidden * (heads + 2 * groups) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * fields["ffn_hidden_size"]
    embeddings = fields["vocab_size"] * hidden * (1 if fields["tied_embeddings"] else 2)
    return layers * (attention + mlp) + embeddings


def _data_kind(path: Path) -> str:
    """'chat' for a file of conversations (its first line holds "messages"), else 'jsonl'."""
    import json

    try:
        with Path(path).open(encoding="utf-8-sig") as lines:
            first = next((line for line in lines if line.strip()), "")
        line = json.loads(first) if first else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "jsonl"  # the data's own checks name the file and what is wrong with it
    return "chat" if isinstance(line, dict) and "messages" in line else "jsonl"


def _name(hf_dir: Path) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", hf_dir.resolve().name.lower()).strip("-._")
    return name or "hf-model"
