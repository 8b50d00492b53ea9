"""A Hugging Face model fine-tuned in FP8 and exported back (docs/hf.md): transformers reloads
the export and gives fp8ops' own logits for the checkpoint it came from.

Its own module: the commands run in this process and set up Megatron's parallel state
themselves, which test_hf.py's module-wide TP=1 state would collide with."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
if importlib.util.find_spec("megatron") is None:  # not importorskip: fp8ops.megatron imports it
    pytest.skip("needs megatron-core", allow_module_level=True)

import torch
from safetensors.torch import load_file
from support.hf_models import VOCAB, make_hf_model

from fp8ops.hf.checkpoint import INDEX, SINGLE
from fp8ops.hf.config import read_config
from fp8ops.hf.verify import our_logits

BOUND = 1e-5


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(7))


@pytest.mark.slow
def test_a_fine_tune_in_fp8_exports_what_transformers_reloads(tmp_path, cli):
    from transformers import AutoModelForCausalLM

    from fp8ops.run import read_run_record
    from fp8ops.train.export import checkpoint_model

    hf_dir = tmp_path / "llama-tied"
    make_hf_model(hf_dir, "llama-tied")
    manifest = tmp_path / "m.yaml"
    assert cli("manifest", "from-hf", hf_dir, "--out", manifest, "--seq-length", 128).code == 0
    run = tmp_path / "run"
    steps = ["--set", "schedule.train_steps=3", "--set", "schedule.warmup_steps=1"]
    small = ["--set", "precision.small_gemm.enabled=false", "--set", "capability.items=4"]
    result = cli(
        "train",
        manifest,
        "--run-dir",
        run,
        *steps,
        *small,
        "--set",
        "schedule.eval_iters=1",
        "--verify",
    )
    assert result.code == 0, result
    record = read_run_record(run)
    verification = record.model.init_hf_verification
    assert verification["passed"] and verification["dtype"] == "bfloat16"
    assert record.model.init_fingerprint_scheme == "hf-files"
    layers = json.loads((run / "layers.json").read_text())
    fp8 = [row["fqn"] for row in layers["rows"] if row["precision"] == "fp8"]
    assert len(fp8) == 8, layers["rows"]  # all four projections of both layers

    out = tmp_path / "export"
    result = cli("checkpoints", "export", run, "--format", "hf", "--out", out, "--verify")
    assert result.code == 0, result
    summary = json.loads((out / "fp8ops_export.json").read_text())
    assert summary["verification"]["max_abs_logit_difference"] < BOUND
    assert read_config(out)["dtype"] == "bfloat16" and read_config(out)["tie_word_embeddings"]
    exported = {}
    for name in json.loads((out / INDEX).read_text())["weight_map"].values():
        exported |= load_file(str(out / name))
    assert exported.keys() == load_file(str(hf_dir / SINGLE)).keys()  # tied: no lm_head
    assert all(t.dtype == torch.bfloat16 for t in exported.values())

    # Independently of the export's own check: the fine-tuned weights differ from the base,
    # and transformers' model of the export gives fp8ops' logits for the checkpoint.
    base = load_file(str(hf_dir / SINGLE))
    assert any(not torch.equal(exported[k], base[k].to(torch.bfloat16)) for k in base)
    tokens = prompt()
    with checkpoint_model(run, None, float32=True) as found:
        ours = our_logits(found.model, tokens, VOCAB, found.tp_group)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        theirs = reloaded(tokens).logits
    assert (ours - theirs).abs().max().item() < BOUND
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    # --verify is a transformers check: refused for the fp8ops format.
    result = cli("checkpoints", "export", run, "--out", tmp_path / "fp8", "--verify")
    assert result.code == 2 and "only with --format hf" in result.err
    assert not (tmp_path / "fp8").exists()
    # A second export over the first is refused and leaves it whole.
    before = sorted(p.name for p in out.iterdir())
    assert cli("checkpoints", "export", run, "--format", "hf", "--out", out).code == 2
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.slow
def test_a_chat_fine_tune_renders_through_the_template_and_evaluates_by_generation(tmp_path, cli):
    from support.hf_models import make_chat_tokenizer

    from fp8ops.run import read_run_record

    hf_dir = tmp_path / "chat-model"
    make_hf_model(hf_dir, "llama-tied", vocab_size=320)
    make_chat_tokenizer(hf_dir)  # ChatML turn markers; <|im_end|> ends each turn
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"add {a} {b}"},
                        {"role": "assistant", "content": str(a + b)},
                    ],
                    "buckets": {"size": "small" if a < 10 else "big"},
                }
            )
            + "\n"
            for a in range(20)
            for b in range(10)
        )
    )
    manifest = tmp_path / "m.yaml"
    made = cli(
        "manifest", "from-hf", hf_dir, "--out", manifest, "--seq-length", 128, "--data", data
    )
    assert made.code == 0, made
    run = tmp_path / "run"
    steps = ["--set", "schedule.train_steps=3", "--set", "schedule.warmup_steps=1"]
    small = ["--set", "precision.small_gemm.enabled=false", "--set", "capability.items=6"]
    result = cli(
        "train", manifest, "--run-dir", run, *steps, *small, "--set", "schedule.eval_iters=1"
    )
    assert result.code == 0, result
    source = read_run_record(run).data.source
    assert source["conversations"] == 200 and len(source["chat_template_sha256"]) == 64
    items = [
        json.loads(line)
        for line in next((run / "capability").glob("*.jsonl")).read_text().splitlines()
    ]
    assert len(items) == 6
    assert all(item["prompt"].endswith("<|im_start|>assistant\n") for item in items)
    assert all(item["answer"].isdigit() for item in items)
