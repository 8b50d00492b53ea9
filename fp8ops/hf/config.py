"""A Hugging Face ``config.json`` as a manifest's ``model`` section, and back.

Four families map onto Megatron-Core's GPT exactly: Llama (tied or untied embeddings, Llama
3.1/3.2 rope scaling), Qwen2/2.5 (QKV bias), Qwen3 (q/k norm, a head width of its own) and
Mistral. Every key of ``config.json`` is either carried into the model section, checked to hold
the one value fp8ops computes (``hidden_act`` silu, no dropout, ...), or known not to change the
forward pass (token ids, ``transformers_version``). Any other key, or a value fp8ops cannot
honour, is refused naming the file and the key: a dropped key is how conversions go silently
wrong (a dropped rope scaling, a head width recomputed from hidden / heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.files import loads_json

CONFIG = "config.json"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# Keys that do not change the forward pass of a causal LM: what it is, how generation stops,
# how it was first initialised, how transformers caches and loads it.
_METADATA = {
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "max_position_embeddings",
    "_name_or_path",
}
# The keys carried into the model section, and checked, per family.
_ARCHITECTURE = {
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "head_dim",
    "tie_word_embeddings",
    "hidden_act",
    "attention_dropout",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
}
_FAMILY_KEYS = {
    "llama": {"attention_bias", "mlp_bias", "pretraining_tp"},
    "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3": {
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    },
    "mistral": {"sliding_window"},
}
_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "linear": {"rope_type", "rope_theta", "factor"},
    "llama3": {
        "rope_type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


class HfCheckpointError(Fp8opsError):
    """A Hugging Face checkpoint fp8ops cannot import or export exactly."""


def read_config(directory: Path) -> dict[str, Any]:
    """``directory``'s ``config.json`` as a dict, with errors that name the file."""
    path = Path(directory) / CONFIG
    try:
        config = loads_json(path.read_text())
    except FileNotFoundError:
        raise HfCheckpointError(
            f"{path}: not found; a Hugging Face checkpoint directory holds config.json beside "
            "its safetensors files"
        ) from None
    except ValueError as exc:  # not JSON, not UTF-8, nested too deeply
        raise HfCheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise HfCheckpointError(f"{path}: must hold a JSON object")
    return config


def model_fields(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """The manifest ``model`` fields ``config`` means (all but ``seq_length`` and the
    checkpoint fields); refuses what fp8ops cannot compute exactly. ``source`` names the file
    in errors."""

    def refuse(key: str, why: str) -> HfCheckpointError:
        return HfCheckpointError(f"{source}: {key} {why}")

    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise refuse(
            "model_type",
            f"is {family!r}; fp8ops imports {', '.join(sorted(ARCHITECTURES))} (dense causal LMs)",
        )
    known = _METADATA | _ARCHITECTURE | _FAMILY_KEYS[family]
    unknown = sorted(set(config) - known)
    if unknown:
        raise refuse(
            unknown[0],
            f"is not a key fp8ops knows for model_type {family!r} (all unknown: {unknown}); "
            "fp8ops refuses what it cannot honour rather than drop it",
        )
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key not in config:
            raise refuse(key, "is missing")
    if config.get("architectures", [ARCHITECTURES[family]]) != [ARCHITECTURES[family]]:
        raise refuse(
            "architectures",
            f"is {config['architectures']!r}; fp8ops imports [{ARCHITECTURES[family]!r}] for "
            f"model_type {family!r}",
        )
    _require(config, "hidden_act", "silu", refuse)
    _require(config, "attention_dropout", 0.0, refuse, why="fp8ops fine-tunes without dropout")
    _require(config, "pretraining_tp", 1, refuse)

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fields: dict[str, Any] = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "vocab_size": config.get("vocab_size", 32000),
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "position_embedding": "rope",
        "layernorm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "kv_channels": None if head_dim * heads == config["hidden_size"] else head_dim,
        "qk_layernorm": family == "qwen3",
        **_biases(config, family, refuse),
        **_rope(config, refuse),
    }
    if family in ("qwen2", "qwen3"):
        _full_attention_only(config, refuse)
    return fields


def check_window(config: dict[str, Any], seq_length: int, *, source: str) -> None:
    """Mistral's sliding window is full causal attention only where it covers the sequence;
    fp8ops computes full attention, so a shorter window is refused."""
    window = config.get("sliding_window") if config.get("model_type") == "mistral" else None
    if window is not None and window < seq_length:
        raise HfCheckpointError(
            f"{source}: sliding_window is {window}, shorter than model.seq_length {seq_length}; "
            "fp8ops computes full causal attention, which equals the window only up to its "
            f"length: set model.seq_length to at most {window}"
        )


def _require(config, key, value, refuse, *, why: str = "") -> None:
    if key in config and config[key] != value:
        reason = f" ({why})" if why else ""
        raise refuse(key, f"is {config[key]!r}; fp8ops computes only {value!r}{reason}")


def _biases(config, family, refuse) -> dict[str, bool]:
    if family == "qwen2":
        return {"add_bias_linear": False, "add_qkv_bias": True}
    attention, mlp = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    if family == "qwen3" and attention:
        raise refuse(
            "attention_bias",
            "is true: Qwen3's q/k/v/o biases without MLP biases have no Megatron-Core layout",
        )
    if attention != mlp:
        raise refuse(
            "attention_bias" if attention else "mlp_bias",
            f"is true while {'mlp_bias' if attention else 'attention_bias'} is false: "
            "Megatron-Core puts a bias on all four projections or on none (besides QKV)",
        )
    return {"add_bias_linear": attention, "add_qkv_bias": False}


def _rope(config, refuse) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or the legacy ``rope_theta`` + ``rope_scaling``."""
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    params = dict(config.get(key) or {})
    if "type" in params and "rope_type" not in params:  # the oldest spelling
        params["rope_type"] = params.pop("type")
    kind = params.get("rope_type", "default")
    if kind not in _ROPE_KEYS:
        raise refuse(
            f"{key}.rope_type",
            f"is {kind!r}; fp8ops computes RoPE exactly for {sorted(_ROPE_KEYS)} only",
        )
    extra = sorted(set(params) - _ROPE_KEYS[kind])
    if extra:
        raise refuse(f"{key}.{extra[0]}", f"is not a parameter fp8ops computes for {kind!r}")
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if "rope_theta" in params and "rope_theta" in config and config["rope_theta"] != base:
        raise refuse("rope_theta", f"is {config['rope_theta']} but {key}.rope_theta is {base}")
    if kind == "default":
        return {"rotary_base": float(base), "rope_scaling": None}
    missing = sorted(_ROPE_KEYS[kind] - {"rope_type", "rope_theta"} - set(params))
    if missing:
        raise refuse(f"{key}.{missing[0]}", f"is missing; {kind!r} scaling needs it")
    scaling: dict[str, Any] = {"type": kind, "factor": float(params["factor"])}
    if kind == "llama3":
        scaling |= {
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        }
    return {"rotary_base": float(base), "rope_scaling": scaling}


def differences(config: dict[str, Any], model_cfg, *, source: str) -> list[str]:
    """Where the manifest's model section is not the model ``config`` means, field by field,
    each value as the schema holds it (a head count left null means one group per head)."""
    wanted = model_fields(config, source=source)
    expected = type(model_cfg).model_validate({**model_cfg.model_dump(), **wanted})
    section = model_cfg.model_dump(mode="json")
    meant = expected.model_dump(mode="json")

    def effective(values: dict, name: str):
        if name == "num_query_groups":
            return values[name] or values["num_attention_heads"]
        if name == "kv_channels":
            return values[name] or values["hidden_size"] // values["num_attention_heads"]
        return values[name]

    return [
        f"model.{name} is {section[name]!r} but {CONFIG} means {meant[name]!r}"
        for name in wanted
        if effective(section, name) != effective(meant, name)
    ]


def _full_attention_only(config, refuse) -> None:
    if config.get("use_sliding_window"):
        raise refuse("use_sliding_window", "is true; fp8ops computes full attention in every layer")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise refuse(
            "layer_types", f"is {layer_types!r}; fp8ops computes full attention in every layer"
        )


def config_for(model_cfg, *, dtype: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of an export: ``source`` (the imported checkpoint's) with ``dtype``
    set, or, for a model fp8ops did not import, the Llama, Qwen2 or Qwen3 config that means the
    model section. Either way it must map back to the same model section."""
    if source is not None:
        config = {**source, "dtype": dtype}
        config.pop("torch_dtype", None)
        return config
    problems = [
        f"{name} is {getattr(model_cfg, name)!r} (Hugging Face's families need {want!r})"
        for name, want in (
            ("normalization", "RMSNorm"),
            ("activation", "swiglu"),
            ("position_embedding", "rope"),
        )
        if getattr(model_cfg, name) != want
    ]
    if problems:
        raise HfCheckpointError(
            "model: " + "; ".join(problems) + ": this model has no Hugging Face form; export it "
            "as an fp8ops weights checkpoint (--format fp8ops)"
        )
    if model_cfg.qk_layernorm and model_cfg.add_qkv_bias:
        raise HfCheckpointError(
            "model: qk_layernorm with add_qkv_bias has no Hugging Face family (Qwen3 has no QKV "
            "bias); export it as an fp8ops weights checkpoint (--format fp8ops)"
        )
    family = "qwen3" if model_cfg.qk_layernorm else "qwen2" if model_cfg.add_qkv_bias else "llama"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "num_hidden_layers": model_cfg.num_layers,
        "hidden_size": model_cfg.hidden_size,
        "intermediate_size": model_cfg.ffn_hidden_size,
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_key_value_heads": model_cfg.num_query_groups or model_cfg.num_attention_heads,
        "head_dim": model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads,
        "vocab_size": model_cfg.vocab_size,
        "rms_norm_eps": model_cfg.layernorm_epsilon,
        "tie_word_embeddings": model_cfg.tied_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg.seq_length,
        "rope_parameters": {"rope_type": "default", "rope_theta": model_cfg.rotary_base},
        "dtype": dtype,
    }
    if family == "llama":
        config |= {
            "attention_bias": model_cfg.add_bias_linear,
            "mlp_bias": model_cfg.add_bias_linear,
        }
    elif model_cfg.add_bias_linear:
        raise HfCheckpointError(
            f"model: add_bias_linear is true, which {ARCHITECTURES[family]} cannot hold; export "
            "it as an fp8ops weights checkpoint (--format fp8ops)"
        )
    scaling = model_cfg.rope_scaling
    if scaling is not None:
        config["rope_parameters"] |= {"rope_type": scaling.type, "factor": scaling.factor}
        if scaling.type == "llama3":
            config["rope_parameters"] |= {
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            }
    return config
