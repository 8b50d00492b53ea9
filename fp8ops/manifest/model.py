"""The ``model`` section: the network, a Megatron-Core GPT."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8ops.manifest.base import NonEmptyStr, Section, Sha256, added_field, raise_problems


class RopeScaling(Section):
    """Rotary frequencies stretched for a longer context, as Hugging Face's ``rope_type`` names
    the two fp8ops computes exactly (Llama 3.1/3.2 use ``llama3``)."""

    type: Literal["llama3", "linear"] = Field(
        description=(
            "'llama3': low frequencies divided by factor, high ones kept, a smooth blend "
            "between; 'linear': every frequency divided by factor."
        )
    )
    factor: float = Field(gt=0, description="How far the context is stretched.")
    low_freq_factor: float = Field(1.0, gt=0, description="'llama3' only: the blend's low end.")
    high_freq_factor: float = Field(4.0, gt=0, description="'llama3' only: the blend's high end.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, description="'llama3' only: the context the model was first trained at."
    )

    @model_validator(mode="after")
    def _blend_ordered(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise_problems(
                "RopeScaling",
                [
                    (
                        ("high_freq_factor",),
                        self.high_freq_factor,
                        f"must exceed low_freq_factor ({self.low_freq_factor})",
                    )
                ],
            )
        return self


class ModelConfig(Section):
    """The network: a Megatron-Core GPT, dense layers."""

    arch: Literal["gpt"] = Field(
        "gpt", description="Model family; Megatron-Core GPT is the only one."
    )
    num_layers: int = Field(ge=1, description="Transformer layers.")
    hidden_size: int = Field(ge=1, description="Model width.")
    ffn_hidden_size: int = Field(ge=1, description="MLP inner width (per gate for swiglu).")
    num_attention_heads: int = Field(ge=1, description="Attention heads; must divide hidden_size.")
    num_query_groups: int | None = Field(
        None,
        ge=1,
        description="Key/value heads for grouped-query attention; null means one per head (MHA).",
    )
    seq_length: int = Field(ge=1, description="Tokens per sequence.")
    vocab_size: int = Field(ge=1, description="Vocabulary size (before Megatron's padding for TP).")
    normalization: Literal["LayerNorm", "RMSNorm"] = Field(
        "LayerNorm", description="Normalization layer; never FP8."
    )
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation.")
    position_embedding: Literal["learned_absolute", "rope"] = Field(
        "learned_absolute", description="Position encoding."
    )
    # What Hugging Face's Llama, Qwen and Mistral need (fp8ops manifest from-hf sets them); the
    # defaults are Megatron-Core's, which every run before them trained with.
    layernorm_epsilon: float = added_field(
        1e-5, added_in="0.1.0", gt=0, description="The norms' epsilon (HF: rms_norm_eps)."
    )
    add_bias_linear: bool = added_field(
        True,
        added_in="0.1.0",
        description="A bias on all four projections (Megatron's default; HF Llama, Qwen, Mistral: "
        "false).",
    )
    add_qkv_bias: bool = added_field(
        False, added_in="0.1.0", description="A bias on the QKV projection alone (Qwen2)."
    )
    kv_channels: int | None = added_field(
        None,
        added_in="0.1.0",
        ge=1,
        description="Width of one attention head (HF: head_dim); null: hidden_size / heads.",
    )
    qk_layernorm: bool = added_field(
        False, added_in="0.1.0", description="A norm on each query and key head (Qwen3)."
    )
    tied_embeddings: bool = added_field(
        False,
        added_in="0.1.0",
        description="The output layer shares the input embedding (HF: tie_word_embeddings).",
    )
    rotary_base: float = added_field(
        10000.0, added_in="0.1.0", gt=0, description="RoPE's base (HF: rope_theta)."
    )
    rope_scaling: RopeScaling | None = added_field(
        None, added_in="0.1.0", description="RoPE frequency scaling; null: none."
    )
    init_checkpoint: NonEmptyStr | None = Field(
        None,
        description=(
            "Checkpoint to fine-tune from: an fp8ops weights checkpoint (a run's final/) or a "
            "Hugging Face directory (config.json and safetensors); null initialises from "
            "seeds.model."
        ),
    )
    fingerprint: Sha256 | None = Field(
        None, description="sha256 of the initial weights, checked when the run starts."
    )

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        problems = []
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(
                (
                    ("hidden_size",),
                    self.hidden_size,
                    f"must be divisible by num_attention_heads ({self.num_attention_heads})",
                )
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            problems.append(
                (
                    ("num_query_groups",),
                    self.num_query_groups,
                    f"must divide num_attention_heads ({self.num_attention_heads})",
                )
            )
        if self.position_embedding != "rope":
            for name, default in (("rotary_base", 10000.0), ("rope_scaling", None)):
                if getattr(self, name) != default:
                    problems.append(
                        ((name,), getattr(self, name), "applies only to position_embedding 'rope'")
                    )
        raise_problems("ModelConfig", problems)
        return self
