"""Tiny Hugging Face checkpoints made here, offline: the oracle models of the import tests.

Each is a transformers model of one of the four families fp8ops imports, built from a seed with
its norm weights moved away from 1 and its biases away from 0 (a dropped or swapped norm or bias
would otherwise not change the logits), a vocabulary that is not a multiple of 128, grouped
queries, and a small byte-level BPE tokenizer saved beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

EOT = "<|end_of_text|>"
TEXTS = ["add 12 39 = 51", "Q: What is 5 plus 1?\nA: 6", "naïve café, 24 °C", "sort 3142 = 1234"]
VOCAB = 300  # not a multiple of 128: the embedding is padded on import, trimmed on export
# A llama3 scaling with other parameters than Megatron-Core's built-in ones: only fp8ops' own
# frequencies compute it exactly.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_SCALING}),
    "llama-untied": ("llama", {"tie_word_embeddings": False, "rope_scaling": LLAMA3_SCALING}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2": ("qwen2", {"rope_theta": 1_000_000.0}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # 4 heads of 32 in a width of 64
    "mistral": ("mistral", {"sliding_window": None}),
}


def make_tokenizer(directory: Path, *, config: bool = True, extra: str = "") -> Path:
    """A byte-level BPE of about 300 ids with EOT as a special token, saved into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # EOT is not id 0, as in real tokenizers (Llama 3: 128001): nothing may take 0 for it.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|pad|>", EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([*TEXTS, extra] * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    return directory


def make_hf_model(directory: Path, kind: str, *, seed: int = 0, **config):
    """Save the tiny ``kind`` model (a key of ``FAMILIES``; ``config`` overrides its fields)
    with a tokenizer into ``directory``; returns the transformers model, in eval mode."""
    import torch
    import transformers

    family, fields = FAMILIES[kind]
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }[family]
    settings = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 1,
        **fields,
        **config,
    }
    torch.manual_seed(seed)
    model = getattr(transformers, classes[1])(getattr(transformers, classes[0])(**settings))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.eval()
    model.save_pretrained(directory)
    make_tokenizer(Path(directory))
    return model


# ChatML, as SmolLM2 and Qwen write it: a default system turn when the conversation has none.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_chat_tokenizer(directory: Path, *, template: str | None = CHATML) -> Path:
    """A byte-level BPE with ChatML's turn markers as special tokens, ``<|im_end|>`` its
    end-of-document (end-of-turn) token, and ``template`` as its chat template (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([*TEXTS, "system user assistant helpful"] * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
