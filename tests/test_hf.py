"""Hugging Face checkpoints in and out (docs/hf.md), with transformers as the oracle.

The models are tiny ones of each family made here (support/hf_models.py): norms and biases
moved away from 1 and 0, a vocabulary of 300 (padded on import), grouped queries, a 256-token
prompt so that RoPE differences show. Logits are compared in float32, where a correct mapping
agrees to about 3e-7; the bound is 1e-5. The negative controls show the comparison catches the
known traps: a plain chunk of ``linear_fc1`` across TP ranks, Megatron-Core's own llama3 scaling.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
if importlib.util.find_spec("megatron") is None:  # not importorskip: fp8ops.megatron imports it
    pytest.skip("needs megatron-core", allow_module_level=True)

import torch
from safetensors.torch import load_file, save_file
from support.hf_models import FAMILIES, VOCAB, make_hf_model

from fp8ops.hf.checkpoint import INDEX, SINGLE
from fp8ops.hf.config import HfCheckpointError, model_fields, read_config
from fp8ops.hf.export import write_hf
from fp8ops.hf.load import check_coverage, load_hf_weights
from fp8ops.hf.manifest import manifest_from_hf
from fp8ops.hf.mapping import hf_shapes
from fp8ops.hf.verify import our_logits

BOUND = 1e-5
SEQ = 256
WORKER = Path(__file__).parent / "workers" / "hf_parity.py"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Every family's tiny checkpoint: {kind: (directory, transformers model)}."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, make_hf_model(root / kind, kind)) for kind in FAMILIES}


def fp32_model(hf_dir: Path, tp_group):
    from fp8ops.megatron import build_gpt

    manifest = manifest_from_hf(hf_dir, seq_length=SEQ)
    wide = manifest.precision.model_copy(update={"base_dtype": "fp32"})
    manifest = manifest.model_copy(update={"precision": wide})
    model = build_gpt(manifest, None)
    meta = load_hf_weights(model, hf_dir, manifest.model, tp_group=tp_group, field="test")
    return model, manifest, meta


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(7))


# -- config.json ----------------------------------------------------------------------------------


def test_config_json_means_the_model_section(hf_models):
    qwen3 = model_fields(read_config(hf_models["qwen3"][0]), source="qwen3")
    assert qwen3["kv_channels"] == 32 and qwen3["qk_layernorm"] and not qwen3["add_qkv_bias"]
    qwen2 = model_fields(read_config(hf_models["qwen2"][0]), source="qwen2")
    assert qwen2["add_qkv_bias"] and not qwen2["add_bias_linear"] and qwen2["rotary_base"] == 1e6
    tied = model_fields(read_config(hf_models["llama-tied"][0]), source="llama")
    assert tied["tied_embeddings"] and tied["kv_channels"] is None  # 64 / 4 heads
    assert tied["rope_scaling"] == {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64,
    }
    biases = model_fields(read_config(hf_models["llama-biases"][0]), source="llama")
    assert biases["add_bias_linear"] and biases["rope_scaling"] is None
    assert all(
        fields["layernorm_epsilon"] == 1e-5 and fields["num_query_groups"] == 2
        for fields in (qwen2, qwen3, tied, biases)
    )


def test_a_legacy_config_reads_as_transformers_reads_it():
    legacy = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    fields = model_fields(legacy, source="config.json")
    assert fields["rotary_base"] == 500000.0
    assert fields["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert fields["num_query_groups"] == 4 and not fields["tied_embeddings"]


REFUSED = {
    "unknown key": ({"use_fancy_attention": True}, "use_fancy_attention is not a key"),
    "yarn": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        "rope_parameters.rope_type is 'yarn'",
    ),
    "dynamic (legacy)": (
        {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "rope_scaling.rope_type is 'dynamic'",
    ),
    "rope factor missing": (
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
        "rope_parameters.factor is missing",
    ),
    "rope parameter": (
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        },
        "rope_parameters.partial_rotary_factor is not a parameter",
    ),
    "one llama bias": ({"attention_bias": True}, "attention_bias is true while mlp_bias is false"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; fp8ops computes only 'silu'"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout is 0.1"),
    "family": ({"model_type": "gemma2"}, "model_type is 'gemma2'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_from_hf_refuses_what_it_cannot_honour_naming_the_key(case, hf_models, tmp_path, cli):
    change, message = REFUSED[case]
    source = tmp_path / "model"
    shutil.copytree(hf_models["llama-untied"][0], source)
    config = read_config(source) | change
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "m.yaml"
    result = cli("manifest", "from-hf", source, "--out", out)
    assert result.code == 2, result
    assert f"{source / 'config.json'}: {message}" in result.err.replace("\n", " ")
    assert not out.exists()


def test_a_sliding_window_shorter_than_the_sequence_is_refused(hf_models, tmp_path, cli):
    source = tmp_path / "mistral"
    shutil.copytree(hf_models["mistral"][0], source)
    (source / "config.json").write_text(json.dumps(read_config(source) | {"sliding_window": 128}))
    out = tmp_path / "m.yaml"
    result = cli("manifest", "from-hf", source, "--out", out, "--seq-length", 256)
    assert (
        result.code == 2
        and "sliding_window is 128, shorter than model.seq_length 256" in result.err
    )
    assert not out.exists()
    # A window that covers the sequence is full causal attention: accepted.
    assert cli("manifest", "from-hf", source, "--out", out, "--seq-length", 128).code == 0


def test_from_hf_writes_a_manifest_that_validates_with_its_inputs(hf_models, tmp_path, cli):
    hf_dir = hf_models["qwen3"][0]
    out = tmp_path / "qwen3.yaml"
    assert cli("manifest", "from-hf", hf_dir, "--out", out, "--seq-length", 128).code == 0
    result = cli("manifest", "validate", out, "--inputs")
    assert result.code == 0, result
    from fp8ops.manifest import load_manifest

    m = load_manifest(out)
    assert (
        m.model.kv_channels == 32
        and m.model.qk_layernorm
        and m.model.init_checkpoint == str(hf_dir)
    )
    assert m.precision.small_gemm.enabled and m.tokenizer.kind == "huggingface"
    assert m.model.fingerprint is not None and m.tokenizer.fingerprint is not None
    # Refused over an existing file, which stays as it was.
    before = out.read_text()
    assert cli("manifest", "from-hf", hf_dir, "--out", out).code == 2 and out.read_text() == before


# -- the mapping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_the_plan_uses_every_tensor_once(kind, tp, hf_models):
    manifest = manifest_from_hf(hf_models[kind][0], seq_length=SEQ, tensor_parallel=tp)
    check_coverage(manifest.model, 384, tp)  # raises on a tensor used twice or rows left out


def test_kv_heads_not_divisible_by_tp_are_refused_before_the_run(hf_models, tmp_path, cli):
    hf_dir = hf_models["llama-untied"][0]  # 2 key/value groups
    out = tmp_path / "m.yaml"
    assert cli("manifest", "from-hf", hf_dir, "--out", out, "--seq-length", 128).code == 0
    run = tmp_path / "run"
    result = cli("train", out, "--run-dir", run, "--set", "topology.tensor_parallel=4")
    assert result.code == 2
    assert "model.num_query_groups: must be divisible by topology.tensor_parallel (4)" in result.err
    assert not run.exists()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_fp32_logits_equal_transformers_at_tp1(kind, hf_models, megatron_tp1):
    from fp8ops.megatron.compat import parallel_state

    hf_dir, reference = hf_models[kind]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    model, manifest, meta = fp32_model(hf_dir, tp_group)
    assert meta["fingerprint"] == manifest.model.fingerprint
    tokens = prompt()
    ours = our_logits(model, tokens, VOCAB, tp_group)
    with torch.no_grad():
        theirs = reference(tokens).logits
    assert (ours - theirs).abs().max().item() < BOUND


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_hf_to_fp8ops_to_hf_is_bit_exact(kind, hf_models, megatron_tp1, tmp_path):
    from fp8ops.megatron.compat import parallel_state

    hf_dir, _ = hf_models[kind]
    model, manifest, _ = fp32_model(hf_dir, parallel_state.get_tensor_model_parallel_group())
    out = tmp_path / "out"
    write_hf(model, manifest.model, out, source=hf_dir, tokenizer_dir=hf_dir)
    source, exported = load_file(str(hf_dir / SINGLE)), {}
    for name in json.loads((out / INDEX).read_text())["weight_map"].values():
        exported |= load_file(str(out / name))
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[k], source[k]) for k in source)
    assert ("lm_head.weight" in exported) == (not manifest.model.tied_embeddings)
    assert exported["model.embed_tokens.weight"].shape[0] == VOCAB  # padding rows dropped
    assert model.embedding.word_embeddings.weight.shape[0] == 384  # ... which the import added
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    assert read_config(out) == read_config(hf_dir) | {"dtype": "float32"}


def test_an_export_refuses_an_existing_directory_and_leaves_no_partial(
    hf_models, megatron_tp1, tmp_path
):
    from fp8ops.megatron.compat import parallel_state

    hf_dir, _ = hf_models["qwen2"]
    model, manifest, _ = fp32_model(hf_dir, parallel_state.get_tensor_model_parallel_group())
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(HfCheckpointError, match="already exists"):
        write_hf(model, manifest.model, out, source=hf_dir)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # A source of another model is refused before anything is written.
    with pytest.raises(HfCheckpointError, match="does not mean the run's model section"):
        write_hf(model, manifest.model, tmp_path / "new", source=hf_models["llama-biases"][0])
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()


# -- refused imports ------------------------------------------------------------------------------


def _damage(directory: Path, how: str) -> str:
    """Damage the checkpoint; returns what the error must say."""
    path = directory / SINGLE
    tensors = load_file(str(path))
    key = "model.layers.1.mlp.up_proj.weight"
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
        return f"{path}: not a whole safetensors file"
    if how == "missing":
        del tensors[key]
        message = f"tensor {key!r} is missing"
    elif how == "extra":
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
        message = (
            f"{path}: holds 'model.layers.1.mlp.extra.weight', which this model has no place for"
        )
    else:
        tensors[key] = tensors[key][:-1].clone()
        message = f"{path}: {key!r} has shape [95, 64], but the model in config.json needs [96, 64]"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return message


@pytest.mark.parametrize("how", ["missing", "extra", "misshapen", "truncated"])
def test_a_damaged_checkpoint_is_refused_before_the_run(how, hf_models, tmp_path, cli):
    hf_dir = tmp_path / "model"
    shutil.copytree(hf_models["llama-untied"][0], hf_dir)
    out = tmp_path / "m.yaml"
    assert cli("manifest", "from-hf", hf_dir, "--out", out, "--seq-length", 128).code == 0
    message = _damage(hf_dir, how)
    run = tmp_path / "run"
    result = cli("train", out, "--run-dir", run)
    assert result.code == 2, result
    assert message in result.err.replace("\n", " ")
    assert not run.exists()


def test_a_manifest_that_is_not_the_checkpoints_model_is_refused(hf_models, tmp_path, cli):
    hf_dir = hf_models["qwen2"][0]
    out = tmp_path / "m.yaml"
    assert cli("manifest", "from-hf", hf_dir, "--out", out, "--seq-length", 128).code == 0
    run = tmp_path / "run"
    result = cli("train", out, "--run-dir", run, "--set", "model.layernorm_epsilon=1e-6")
    assert result.code == 2
    assert "model.layernorm_epsilon is 1e-06 but config.json means 1e-05" in result.err
    assert not run.exists()


# -- TP 2 -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fp32_logits_equal_transformers_at_tp2_and_the_controls_fail(hf_models, tmp_path):
    dirs = [str(hf_models[kind][0]) for kind in FAMILIES]
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(WORKER), str(tmp_path), *dirs],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    result = json.loads((tmp_path / "tp2.json").read_text())
    controls = {k: result.pop(k) for k in list(result) if k.startswith("control")}
    assert result.keys() == FAMILIES.keys()
    assert all(difference < BOUND for difference in result.values()), result
    # Both traps load without error; only the logits show them.
    assert controls["control: plain fc1 chunk"] > 1e-2, controls
    assert controls["control: Megatron's llama3 scaling"] > 1e-3, controls


def test_the_tensor_shapes_follow_the_model_section(hf_models):
    manifest = manifest_from_hf(hf_models["qwen3"][0], seq_length=SEQ)
    shapes = hf_shapes(manifest.model)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (128, 64)  # 4 heads of 32
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert "lm_head.weight" in shapes


def test_a_sharded_checkpoint_reads_as_the_single_file_does(hf_models, megatron_tp1, tmp_path):
    from fp8ops.megatron.compat import parallel_state

    hf_dir, reference = hf_models["llama-untied"]
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    shutil.copy(hf_dir / "tokenizer.json", sharded)
    shutil.copy(hf_dir / "tokenizer_config.json", sharded)
    assert not (sharded / SINGLE).exists() and len(list(sharded.glob("*.safetensors"))) > 2
    tp_group = parallel_state.get_tensor_model_parallel_group()
    model, _, _ = fp32_model(sharded, tp_group)
    single, _, _ = fp32_model(hf_dir, tp_group)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), single.parameters(), strict=True)
    )
    # An index that names the wrong file for a tensor is refused, naming both.
    index = json.loads((sharded / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][key] = files[1]
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        HfCheckpointError, match=f"names '{key}' in {files[1]}, which does not hold it"
    ):
        fp32_model(sharded, tp_group)


def test_the_tp2_plan_puts_whole_query_groups_and_both_halves_of_fc1_on_each_rank(hf_models):
    from fp8ops.hf.mapping import shard_plan

    manifest = manifest_from_hf(hf_models["llama-biases"][0], seq_length=SEQ, tensor_parallel=2)
    plan = shard_plan(manifest.model, 384, 2, 1)  # rank 1 of 2
    attn = "model.layers.0.self_attn."
    # 4 heads of 16 in 2 groups: rank 1 holds group 1, its 2 query heads, then its key and value.
    assert [
        (p.key, p.start, p.stop)
        for p in plan["decoder.layers.0.self_attention.linear_qkv.weight"].pieces
    ] == [
        (attn + "q_proj.weight", 32, 64),
        (attn + "k_proj.weight", 16, 32),
        (attn + "v_proj.weight", 16, 32),
    ]
    # fc1 is [gate; up] on every rank: rank 1 holds the second half of each (96 / 2).
    mlp = "model.layers.0.mlp."
    fc1 = plan["decoder.layers.0.mlp.linear_fc1.weight"]
    assert [(p.key, p.start, p.stop) for p in fc1.pieces] == [
        (mlp + "gate_proj.weight", 48, 96),
        (mlp + "up_proj.weight", 48, 96),
    ]
    fc2 = plan["decoder.layers.0.mlp.linear_fc2.weight"]
    assert fc2.dim == 1 and [(p.start, p.stop, p.dim) for p in fc2.pieces] == [(48, 96, 1)]
    # Row-parallel biases are whole on every rank; the vocabulary's padding is rank 1's tail.
    assert [(p.start, p.stop) for p in plan["decoder.layers.0.mlp.linear_fc2.bias"].pieces] == [
        (0, 64)
    ]
    embedding = plan["embedding.word_embeddings.weight"].pieces
    assert [(p.key, p.start, p.stop) for p in embedding] == [
        ("model.embed_tokens.weight", 192, 300),
        (None, 108, 192),
    ]


def test_a_model_fp8ops_did_not_import_exports_with_a_config_that_means_it(
    hf_models, megatron_tp1, tmp_path
):
    from transformers import AutoModelForCausalLM

    from fp8ops.megatron.compat import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    for kind in ("qwen3", "llama-tied", "qwen2"):
        hf_dir, reference = hf_models[kind]
        model, manifest, _ = fp32_model(hf_dir, tp_group)
        out = tmp_path / kind
        write_hf(model, manifest.model, out)  # no source: config.json made from the model section
        reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        tokens = prompt()
        with torch.no_grad():
            assert (reloaded(tokens).logits - reference(tokens).logits).abs().max().item() < BOUND
    # A model section no family holds is refused before anything is written.
    odd = manifest.model.model_copy(update={"qk_layernorm": True})
    with pytest.raises(
        HfCheckpointError, match="qk_layernorm with add_qkv_bias has no Hugging Face"
    ):
        write_hf(model, odd, tmp_path / "odd")
    assert not (tmp_path / "odd").exists()


def test_an_export_whose_check_fails_leaves_nothing(hf_models, megatron_tp1, tmp_path):
    from fp8ops.megatron.compat import parallel_state

    hf_dir, _ = hf_models["mistral"]
    model, manifest, _ = fp32_model(hf_dir, parallel_state.get_tensor_model_parallel_group())
    seen = []

    def failing_check(written: Path) -> dict:
        seen.append(sorted(p.name for p in written.iterdir()))
        raise HfCheckpointError("the comparison failed")

    with pytest.raises(HfCheckpointError, match="the comparison failed"):
        write_hf(model, manifest.model, tmp_path / "out", source=hf_dir, check=failing_check)
    assert "config.json" in seen[0]  # it ran on the written files, before the rename
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_shard_holding_a_tensor_its_index_does_not_name_is_refused(hf_models, tmp_path):
    from fp8ops.hf.checkpoint import weight_files

    _, reference = hf_models["qwen2"]
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / INDEX).read_text())
    counts = Counter(index["weight_map"].values())  # a file that still holds named tensors
    dropped = next(k for k, f in sorted(index["weight_map"].items()) if counts[f] > 1)
    file = index["weight_map"].pop(dropped)
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        HfCheckpointError, match=f"{file}: holds '{dropped}', which {INDEX} does not name"
    ):
        weight_files(sharded)
