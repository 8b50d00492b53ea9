"""Benchmark (not a test): building JSONL data, byte tokenizer against a tokenizer.json.

    .venv/bin/python ci/bench_data.py [--documents N] [--examples N] [--repeats N]

Writes a seeded JSONL text file of N documents (50 to 300 words each) and a JSONL SFT file of N
short examples, trains a small byte-level BPE tokenizer.json on the text (the tokenizers
library, as ``tokenizer.kind: huggingface`` reads it), then times ``build_data`` and the data's
fingerprint: the text with each tokenizer at seq_length 1024, the SFT file with the bytes at
seq_length 4096 (where padding would dominate). Each repeat runs in a fresh process so that its
peak memory (``ru_maxrss``) is its own. Prints the median seconds and the largest peak.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

WORDS = "the of and to in is was for on that with as by at from this be are or an it not which"

# Run in a child: build the data once and hash it (as a run does), print seconds and peak RSS
# (KiB) as JSON.
CHILD = """
import json, resource, sys, time
from fp8ops.data import build_data
from fp8ops.manifest.load import parse_manifest
manifest = parse_manifest(sys.argv[1], "bench.yaml")
start = time.perf_counter()
data = build_data(manifest)
data.fingerprint  # every run hashes what it trains on
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": peak, "windows": len(data.train) + len(data.eval)}))
"""


def write_inputs(directory: Path, documents: int, examples: int) -> tuple[Path, Path, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng, words = random.Random(0), WORDS.split()
    texts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(50, 300))) for _ in range(documents)
    ]
    data = directory / "text.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    sft = directory / "sft.jsonl"
    rows = (
        {
            "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + ": ",
            "answer": " ".join(rng.choice(words) for _ in range(rng.randint(1, 20))),
        }
        for _ in range(examples)
    )
    sft.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return data, sft, directory / "tokenizer.json"


def manifest(data: Path, tokenizer: Path | None, seq_length: int) -> str:
    section = (
        ""
        if tokenizer is None
        else f"tokenizer: {{kind: huggingface, path: '{tokenizer}', eod_token: '<|end_of_text|>'}}\n"
    )
    return (
        "schema_version: 1\nname: bench\n"
        "model: {num_layers: 2, hidden_size: 64, ffn_hidden_size: 256, num_attention_heads: 4, "
        f"seq_length: {seq_length}, vocab_size: 512}}\n"
        f"data: {{kind: jsonl, path: '{data}'}}\n"
        "schedule: {train_steps: 10, global_batch_size: 8}\n" + section
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=40_000)
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name, value, least in (
        ("--documents", args.documents, 100),
        ("--examples", args.examples, 100),
        ("--repeats", args.repeats, 1),
    ):
        if value < least:
            parser.error(f"{name} must be at least {least}")
    with tempfile.TemporaryDirectory() as tmp:
        text, sft, tokenizer_json = write_inputs(Path(tmp), args.documents, args.examples)
        table = Table(title=f"build_data on JSONL files, {args.repeats} runs each")
        columns = (
            "data",
            "tokenizer",
            "seq_length",
            "seconds (median)",
            "peak RSS (MiB, largest)",
            "sequences",
        )
        for column in columns:
            table.add_column(column, justify="left" if column in columns[:2] else "right")
        text_label = f"text, {args.documents:,} docs ({text.stat().st_size / 1e6:.1f} MB)"
        sft_label = f"SFT, {args.examples:,} examples ({sft.stat().st_size / 1e6:.1f} MB)"
        cases = (
            (text_label, text, "byte", None, 1024),
            (text_label, text, "tokenizer.json (BPE)", tokenizer_json, 1024),
            (sft_label, sft, "byte", None, 4096),
        )
        for label, data, tokenizer_label, tokenizer, seq_length in cases:
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, manifest(data, tokenizer, seq_length)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            table.add_row(
                label,
                tokenizer_label,
                str(seq_length),
                f"{statistics.median(r['seconds'] for r in runs):.2f}",
                f"{max(r['peak_kib'] for r in runs) / 1024:.0f}",
                f"{runs[0]['windows']:,}",
            )
        Console(width=120).print(table)


if __name__ == "__main__":
    main()
