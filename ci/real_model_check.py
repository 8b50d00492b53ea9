"""Check (not a test): a fine-tuned run exported to Hugging Face form answers as fp8ops did.

    .venv/bin/python ci/real_model_check.py runs/smollm2-135m-chat [--out DIR] [--json PATH]

1. ``fp8ops checkpoints export RUN --format hf --out DIR --verify`` (timed): the latest
   checkpoint as safetensors, config.json and the tokenizer, its logits compared with
   transformers' reading of it.
2. The run's last capability evaluation (``capability/step_N.jsonl``): each item's prompt,
   rendered by the chat template, and fp8ops' greedy answer.
3. transformers loads the export (``from_pretrained``, bf16 and float32) and answers each prompt
   greedily, stopping at the tokenizer's end-of-turn token.

Prints a table: items, answers equal to fp8ops' (bf16, float32), exact-match accuracy of each.
fp8ops evaluated an FP8 run under its FP8 casts, transformers runs bf16 or float32: answers
the model is unsure of may differ between them; both are reported as measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="Where to export (default: a temporary one).")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8ops.data.tasks import Example, check
    from fp8ops.manifest import load_manifest

    def right(item: dict, generated: str) -> bool:  # fp8ops' own exact-match rule
        return check(Example(item["prompt"], item["answer"]), generated)

    out = args.out or Path(tempfile.mkdtemp(prefix="export-")) / "hf"
    started = time.perf_counter()
    export = subprocess.run(
        [str(REPO / ".venv/bin/fp8ops"), "checkpoints", "export", str(args.run_dir)]
        + ["--format", "hf", "--out", str(out), "--verify"],
        capture_output=True,
        text=True,
    )
    if export.returncode != 0:
        raise SystemExit(f"export failed:\n{export.stdout}{export.stderr}")
    export_s = time.perf_counter() - started
    summary = json.loads((out / "fp8ops_export.json").read_text())

    evaluations = sorted((args.run_dir / "capability").glob("step_*.jsonl"))
    if not evaluations:
        raise SystemExit(f"{args.run_dir}: no capability evaluation to compare with")
    items = [json.loads(line) for line in evaluations[-1].read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    new_tokens = load_manifest(args.run_dir / "manifest.yaml").capability.max_new_tokens

    # fp8ops' own greedy answers for the same checkpoint outside FP8, in float32: what the
    # export must reproduce (the run's own evaluation ran under its FP8 casts).
    from fp8ops.data import build_data, tokenizer_for
    from fp8ops.evaluate.capability import evaluate_capability
    from fp8ops.train.export import checkpoint_model

    with checkpoint_model(args.run_dir, None, float32=True) as found:
        run_tokenizer = tokenizer_for(found.manifest.tokenizer)
        data = build_data(found.manifest, run_tokenizer)
        examples = list(data.eval.examples[: len(items)])
        assert [e.prompt for e in examples] == [i["prompt"] for i in items]
        own = evaluate_capability(found.model, examples, found.manifest, run_tokenizer)
    own_answers = [record["generated"] for record in own]

    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
        answers = []
        for item in items:
            ids = tokenizer(item["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
            with torch.no_grad():
                generated = model.generate(
                    ids,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.eos_token_id,
                )
            text = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=False)
            answers.append(text.split(tokenizer.eos_token)[0])
        name = str(dtype).removeprefix("torch.")
        results[name] = {
            "same_as_fp8ops": sum(a == i["generated"] for a, i in zip(answers, items, strict=True)),
            "same_as_fp8ops_float32": sum(
                a == b for a, b in zip(answers, own_answers, strict=True)
            ),
            "correct": sum(right(i, a) for a, i in zip(answers, items, strict=True)),
            "answers": answers,
        }
    fp8ops_correct = sum(bool(i["correct"]) for i in items)

    table = Table(title=f"{args.run_dir}: exported, reloaded by transformers, {len(items)} items")
    for column in ("model", "answers equal to the run's (FP8)", "to fp8ops float32", "exact match"):
        table.add_column(column, justify="right")
    own_correct = sum(right(i, a) for a, i in zip(own_answers, items, strict=True))
    table.add_row(
        f"fp8ops, the run's evaluation ({evaluations[-1].stem}, FP8)",
        "-",
        "-",
        f"{fp8ops_correct}/{len(items)}",
    )
    table.add_row("fp8ops float32, no FP8", "-", "-", f"{own_correct}/{len(items)}")
    for name, result in results.items():
        table.add_row(
            f"transformers {name}",
            f"{result['same_as_fp8ops']}/{len(items)}",
            f"{result['same_as_fp8ops_float32']}/{len(items)}",
            f"{result['correct']}/{len(items)}",
        )
    console = Console()
    console.print(table)
    comparison = summary.get("verification") or {}
    console.print(
        f"export: {export_s:.1f} s, {summary['tensors']} tensors, {summary['dtype']}; logits "
        f"within {comparison.get('max_abs_logit_difference', float('nan')):.2g} of transformers "
        "(float32)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "export_s": export_s,
                    "export": summary,
                    "fp8ops_correct": fp8ops_correct,
                    **results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
