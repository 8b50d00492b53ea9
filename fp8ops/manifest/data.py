"""The ``tokenizer`` and ``data`` sections: how text becomes token ids, and which text."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8ops.manifest.base import NonEmptyStr, Section, Sha256, added_field, raise_problems


class TokenizerConfig(Section):
    """How text becomes token ids."""

    kind: Literal["byte", "sentencepiece", "huggingface"] = Field(
        "byte",
        description=(
            "'byte': raw UTF-8 bytes, ids 0-255, no file. 'huggingface': path's tokenizer.json, "
            "read with the tokenizers library (pip install 'fp8ops[hf]'). 'sentencepiece' is "
            "refused: convert the model to a tokenizer.json."
        ),
    )
    path: NonEmptyStr | None = Field(
        None,
        description="A tokenizer.json or the directory holding it; required unless kind is 'byte'.",
    )
    fingerprint: Sha256 | None = Field(
        None,
        description=(
            "sha256 of what the tokenizer does (for 'huggingface': its tokenizer.json and "
            "end-of-document token), checked when the run starts."
        ),
    )
    eod_token: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "'huggingface' only: the token that ends every document and answer, one of the "
            "file's added tokens (Llama 3: <|end_of_text|>); null: the eos_token of the "
            "tokenizer_config.json beside the file."
        ),
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> TokenizerConfig:
        problems = []
        if self.kind == "byte" and self.path is not None:
            problems.append(
                (("path",), self.path, "must be null for kind 'byte' (it needs no file)")
            )
        if self.kind == "byte" and self.eod_token is not None:
            problems.append(
                (("eod_token",), self.eod_token, "must be null for kind 'byte' (id 0 ends text)")
            )
        if self.kind == "sentencepiece":
            problems.append(
                (
                    ("kind",),
                    self.kind,
                    (
                        "is not supported: convert the model to a tokenizer.json (transformers' "
                        "LlamaTokenizerFast does) and use kind 'huggingface'"
                    ),
                )
            )
        if self.kind == "huggingface" and self.path is None:
            problems.append((("path",), None, f"required for kind '{self.kind}'"))
        raise_problems("TokenizerConfig", problems)
        return self


class DataConfig(Section):
    """Training and evaluation data (built by ``fp8ops.data``)."""

    kind: Literal["corpus", "tasks", "jsonl", "chat"] = Field(
        description=(
            "'corpus': fp8ops' built-in byte-level text corpus (the docstrings of a fixed list of "
            "Python standard-library modules, present wherever Python is), for pre-training; "
            "loss on every token. 'tasks': fp8ops' built-in supervised tasks with checkable "
            "answers and evaluation buckets, generated from seeds.data; loss on the answers. "
            "'jsonl': your file at path, one JSON object per line, either {\"text\": ...} "
            '(pre-training) or {"prompt": ..., "answer": ..., "buckets": {...}} (SFT). '
            "'chat': your file at path, one conversation per line, "
            '{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...], '
            '"buckets": {...}}, rendered by the tokenizer\'s own chat template; loss on the '
            "assistant's turns only."
        )
    )
    path: NonEmptyStr | None = Field(
        None, description="The JSONL file; required for 'jsonl', null for the built-in kinds."
    )
    fingerprint: Sha256 | None = Field(
        None,
        description=(
            "sha256 of the data as fp8ops reads it, checked when the run starts; null records "
            "it without checking."
        ),
    )
    num_examples: int = Field(
        6000,
        ge=2,
        description="For 'tasks': how many examples to generate (train and evaluation together).",
    )
    eval_fraction: float = Field(
        0.1, ge=0, le=0.5, description="Fraction of documents held out for evaluation."
    )
    split_version: Literal[1, 2] = added_field(
        1,
        added_in="0.1.0",
        description=(
            "How the held-out split is drawn (docs/data.md). 2: a problem is held out whatever "
            "the order of operands that give its answer (built-in tasks) or the whitespace of "
            "its prompt (jsonl); the evaluation split, and jsonl text before packing, in hash "
            "order, so any prefix is a fair sample. 1: the split of runs made before version 2 "
            "existed (kept so that they resume on the same data); new manifests should use 2."
        ),
    )
    pad_to: Literal["seq_length", "longest"] = added_field(
        "seq_length",
        added_in="0.1.0",
        description=(
            "How far each micro-batch is padded. 'seq_length': every row to model.seq_length. "
            "'longest': to the micro-batch's longest row, rounded up to a multiple of 16 (FP8 "
            "GEMMs' alignment), at most seq_length: SFT examples much shorter than seq_length "
            "then cost their own length, not seq_length. The loss is the same (padding sits "
            "after a row's tokens, which causal attention never lets them see), but FP8 amaxes "
            "see fewer padding positions, so the runs are not bit-identical. No effect on "
            "pre-training windows, which are full."
        ),
    )

    as_chat: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "kind 'tasks' only: each task rendered as a conversation (the prompt a user turn, "
            "the answer the assistant's) by the tokenizer's chat template, as kind 'chat' renders "
            "its file: for fine-tuning a chat model on checkable answers."
        ),
    )
    overlong: Literal["drop", "truncate"] = added_field(
        "drop",
        added_in="0.1.0",
        description=(
            "Conversations (kind 'chat', or tasks with as_chat): one longer than "
            "model.seq_length + 1 tokens is dropped, or truncated to that length (its loss on the "
            "assistant tokens left); either way counted in the run's data record and said at "
            "start. Other data refuses an example that does not fit."
        ),
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> DataConfig:
        problems = []
        if self.kind in ("jsonl", "chat") and self.path is None:
            problems.append((("path",), None, f"required for kind '{self.kind}'"))
        if self.kind not in ("jsonl", "chat") and self.path is not None:
            problems.append(
                (("path",), self.path, f"must be null for kind '{self.kind}' (it reads no file)")
            )
        if self.as_chat and self.kind != "tasks":
            problems.append(
                (("as_chat",), True, f"only for kind 'tasks' (kind '{self.kind}' is not)")
            )
        raise_problems("DataConfig", problems)
        return self
