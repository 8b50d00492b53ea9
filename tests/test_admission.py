"""Per-layer FP8 admission on a real Megatron GPT at TP=1: the decisions and their reasons, globs
that match nothing, fp8_enabled in training, layers.json and ``fp8ops inspect``."""

import importlib.util
import json
import os

import pytest
import torch

if importlib.util.find_spec("megatron") is None:  # not importorskip: fp8ops.megatron imports it
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.admission import (
    AdmissionError,
    admitted_under,
    apply_admission,
    decide_admission,
    per_rank_shape,
    small_gemm_verdict,
)
from fp8ops.cli import main
from fp8ops.errors import ManifestError
from fp8ops.manifest import SmallGemmRule, derive, manifest_hash, parse_manifest
from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_modules
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope
from fp8ops.run.records import (
    AdmissionTable,
    GemmShape,
    LayersFileError,
    read_layers_json,
    write_layers_json,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

# Two layers of width 64: qkv 64 -> 192, proj 64 -> 64, fc1 64 -> 256, fc2 256 -> 64.
MANIFEST = """\
schema_version: 1
name: admission-test
precision:
  amax_history_len: 8
  small_gemm: {enabled: false}
model:
  num_layers: 2
  hidden_size: 64
  ffn_hidden_size: 256
  num_attention_heads: 4
  seq_length: 16
  vocab_size: 256
data:
  kind: tasks
schedule:
  train_steps: 10
  micro_batch_size: 2
  global_batch_size: 2
"""
LAYERS = range(2)
PROJECTIONS = {
    "self_attention.linear_qkv": "qkv",
    "self_attention.linear_proj": "proj",
    "mlp.linear_fc1": "fc1",
    "mlp.linear_fc2": "fc2",
}
GLOBAL_SHAPES = {"qkv": (64, 192), "proj": (64, 64), "fc1": (64, 256), "fc2": (256, 64)}
NORMS = [
    f"decoder.layers.{i}.{n}" for i in LAYERS for n in ("input_layernorm", "pre_mlp_layernorm")
]
NORMS.append("decoder.final_layernorm")


def projections(layer=None):
    layers = LAYERS if layer is None else [layer]
    return {
        f"decoder.layers.{i}.{name}": kind for i in layers for name, kind in PROJECTIONS.items()
    }


@pytest.fixture(scope="module", autouse=True)
def _megatron_tp1(megatron_tp1):
    """Every test here runs on a one-rank TP=1 Megatron (tests/conftest.py)."""


@pytest.fixture(scope="module")
def manifest():
    return parse_manifest(MANIFEST, "admission-test")


@pytest.fixture(scope="module")
def recipe(manifest):
    return DelayedScalingRecipe.from_precision(manifest.precision)


@pytest.fixture(scope="module")
def model(manifest, recipe):
    """Shared by the tests that only decide: deciding reads the model, never changes it."""
    return build_gpt(manifest, recipe)


def revised(manifest, **precision_changes):
    changes = {f"precision.{field}": value for field, value in precision_changes.items()}
    return derive(manifest, changes, "admission test")


def decide(model, manifest, **precision_changes):
    m = revised(manifest, **precision_changes) if precision_changes else manifest
    return decide_admission(model, m.precision, tensor_parallel=1)


def codes(table):
    return {row.fqn: row.reason.code for row in table.rows}


# -- decisions -----------------------------------------------------------------------------------


def test_default_globs_admit_the_four_projections_of_every_layer(model, manifest):
    table = decide(model, manifest)
    expected = dict.fromkeys(projections(), "fp8")
    expected |= {
        "embedding.word_embeddings": "embedding",
        "embedding.position_embeddings": "embedding",
        "output_layer": "lm_head",
    } | dict.fromkeys(NORMS, "norm")
    assert codes(table) == expected
    assert table.fp8_fqns == tuple(fqn for fqn in codes(table) if fqn in projections())

    for fqn, kind in projections().items():
        row = table.row(fqn)
        assert row.kind == kind
        assert row.parallel == ("column" if kind in ("qkv", "fc1") else "row")
        assert (row.global_shape.k, row.global_shape.n) == GLOBAL_SHAPES[kind]
        assert row.rank_shape == row.global_shape  # TP=1
        weight = model.get_submodule(fqn).weight  # [N, K]
        assert list(weight.shape) == [row.rank_shape.n, row.rank_shape.k]
        assert (row.precision, row.params_dtype) == ("fp8", "bf16")
        assert (row.formats.forward, row.formats.backward) == ("E4M3", "E5M2")  # hybrid
        assert "precision.include_modules[" in row.reason.text

    embedding, lm_head = table.row("embedding.word_embeddings"), table.row("output_layer")
    assert (embedding.parallel, embedding.precision) == ("vocab", "bf16")
    assert (embedding.global_shape.k, embedding.global_shape.n) == (256, 64)  # vocab x hidden
    assert table.row("embedding.position_embeddings").kind == "position_embedding"
    assert (lm_head.kind, lm_head.parallel, lm_head.formats) == ("lm_head", "column", None)
    assert "LM head is never FP8" in lm_head.reason.text
    for fqn in NORMS:
        assert table.row(fqn).kind == "norm" and table.row(fqn).precision == "bf16"
    assert table.summary() == "8 of 16 modules FP8; 8 in bf16: 2 embedding, 1 LM head, 5 norm"


def test_an_exclude_glob_moves_exactly_layer_0s_projections_to_the_base_dtype(model, manifest):
    table = decide(model, manifest, exclude_modules=["decoder.layers.0.*"])
    for fqn in projections(0):
        row = table.row(fqn)
        assert (row.precision, row.reason.code, row.formats) == ("bf16", "excluded", None)
        assert row.reason.text == "excluded by precision.exclude_modules[0] 'decoder.layers.0.*'"
    assert table.fp8_fqns == tuple(fqn for fqn in codes(table) if fqn in projections(1))
    # The glob also matches layer 0's norms; they keep their own reason.
    assert table.row("decoder.layers.0.input_layernorm").reason.code == "norm"
    assert table.summary().startswith("4 of 16 modules FP8; 12 in bf16: 4 excluded, ")


def test_an_override_is_its_own_reason_and_counted_in_the_summary(model, manifest):
    fc1 = "decoder.layers.1.mlp.linear_fc1"
    table = decide(model, manifest, overrides=[{"module": fc1, "reason": "saturates"}])
    assert table.row(fc1).reason.code == "override"
    assert table.row(fc1).reason.text == "BF16 override (written in the manifest): saturates"
    assert table.summary() == (
        "7 of 16 modules FP8; 9 in bf16: 1 override, 2 embedding, 1 LM head, 5 norm"
    )


def test_an_override_of_some_gemms_keeps_the_module_fp8_and_says_why_per_gemm(model, manifest):
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    table = decide(
        model, manifest, overrides=[{"module": fc2, "reason": "grads", "gemms": ["wgrad", "dgrad"]}]
    )
    row = table.row(fc2)
    assert (row.precision, row.reason.code, row.fp8_gemms) == ("fp8", "fp8", ("fprop",))
    assert row.gemms.fprop.reason == row.reason
    for gemm in (row.gemms.dgrad, row.gemms.wgrad):
        assert (gemm.precision, gemm.reason.code) == ("bf16", "override")
        assert gemm.reason.text == (
            "BF16 override of dgrad and wgrad (written in the manifest): grads"
        )
    assert row.gemm_summary() == "fprop fp8; dgrad, wgrad bf16"
    assert table.summary() == (
        "8 of 16 modules FP8; 8 in bf16: 2 embedding, 1 LM head, 5 norm; "
        "1 FP8 with some GEMMs in the base dtype"
    )
    # Every other module: all three GEMMs as the module, for its reason.
    for other in table.rows:
        if other.fqn != fc2:
            assert {g.reason for _, g in other.gemms.items()} == {other.reason}
            assert {g.precision for _, g in other.gemms.items()} == {other.precision}


def test_a_module_recipe_of_some_gemms_and_an_override_of_the_rest_leave_no_fp8_gemm(
    model, manifest
):
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    entry = {**recipe_entry(["decoder.layers.0.*"]), "gemms": ["fprop"]}
    table = decide(model, manifest, module_recipes=[entry])
    row = table.row(fc1)
    assert (row.scaling, row.fp8_gemms) == ("current", ("fprop",))
    assert row.gemms.wgrad.reason.code == "module_recipe"
    assert "precision.module_recipes[0] runs fprop of these modules" in row.gemms.wgrad.reason.text
    both = decide(
        model,
        manifest,
        module_recipes=[entry],
        overrides=[{"module": fc1, "reason": "all of it", "gemms": ["fprop"]}],
    ).row(fc1)
    assert (both.precision, both.reason.code, both.fp8_gemms, both.scaling) == (
        "bf16",
        "override",
        (),
        None,
    )
    assert both.reason.text.endswith("; no GEMM left in FP8")


def test_a_per_gemm_override_of_a_module_that_never_runs_fp8_is_refused(model, manifest):
    overrides = [
        {"module": "output_layer", "reason": "x", "gemms": ["wgrad"]},
        {"module": "decoder.layers.0.mlp.linear_fc1", "reason": "y", "gemms": ["wgrad"]},
        {"module": "decoder.final_layernorm", "reason": "z", "gemms": ["fprop"]},
    ]
    with pytest.raises(AdmissionError) as found:
        decide(model, manifest, overrides=overrides)
    message = str(found.value)
    assert "precision.overrides[0].gemms: output_layer is the LM head, which never runs FP8" in (
        message
    )
    assert "precision.overrides[2].gemms: decoder.final_layernorm is a norm" in message
    assert "overrides[1]" not in message


def test_applied_admission_sets_each_modules_fp8_gemms(manifest, recipe):
    model = build_gpt(manifest, recipe)
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    table = decide(model, manifest, overrides=[{"module": fc2, "reason": "g", "gemms": ["wgrad"]}])
    apply_admission(table, model)
    modules = fp8_modules(model)
    assert modules[fc2].fp8_gemms == {"fprop", "dgrad"} and modules[fc2].fp8_enabled
    assert all(m.fp8_gemms == {"fprop", "dgrad", "wgrad"} for n, m in modules.items() if n != fc2)


def test_a_bf16_twins_table_decided_again_admits_what_the_fp8_model_admits(model, manifest):
    """``admitted_under``: a dual-track control's layers.json (the plain model, FP8 off) says
    which modules the FP8 candidate will run in FP8, under each kind of rule."""
    control = decide_admission(
        build_gpt(manifest, None), revised(manifest, enabled=False).precision, tensor_parallel=1
    )
    assert all(
        row.reason.code in ("fp8_disabled", "embedding", "lm_head", "norm") for row in control.rows
    )
    for changes in (
        {},
        {"exclude_modules": ["decoder.layers.0.*"]},
        {"include_modules": ["*.linear_fc1"]},
        {"overrides": [{"module": "decoder.layers.1.mlp.linear_fc2", "reason": "by hand"}]},
        {"small_gemm": {"enabled": True, "min_dim": 64, "min_flops_per_token": 20000}},
    ):
        candidate = revised(manifest, **changes) if changes else manifest
        expected = decide(model, manifest, **changes).fp8_fqns
        assert admitted_under(control.rows, candidate.precision) == list(expected), changes


def test_a_narrower_include_admits_only_what_it_names(model, manifest):
    table = decide(model, manifest, include_modules=["*.linear_fc1", "*.final_layernorm"])
    for fqn, kind in projections().items():
        assert codes(table)[fqn] == ("fp8" if kind == "fc1" else "not_included"), fqn
    qkv = table.row("decoder.layers.0.self_attention.linear_qkv")
    assert qkv.reason.text == "matched by no glob in precision.include_modules"
    # Including a norm does not make it FP8; the reason says so.
    norm = table.row("decoder.final_layernorm")
    assert norm.reason.code == "norm" and "precision.include_modules[1]" in norm.reason.text


def test_small_gemm_rule_decides_on_the_per_rank_shape(model, manifest):
    # 2*K*N: qkv 24576, proj 8192, fc1 and fc2 32768; min(K, N) is 64 everywhere.
    table = decide(
        model, manifest, small_gemm={"enabled": True, "min_dim": 64, "min_flops_per_token": 20000}
    )
    for fqn, kind in projections().items():
        assert codes(table)[fqn] == ("small_gemm" if kind == "proj" else "fp8"), fqn
    assert table.row("decoder.layers.1.self_attention.linear_proj").reason.text == (
        "small GEMM: K=64, N=64 per rank; "
        "2*K*N 8192 < precision.small_gemm.min_flops_per_token 20000"
    )
    assert "passes precision.small_gemm" in table.row("decoder.layers.1.mlp.linear_fc2").reason.text

    table = decide(
        model, manifest, small_gemm={"enabled": True, "min_dim": 128, "min_flops_per_token": 0}
    )
    assert all(codes(table)[fqn] == "small_gemm" for fqn in projections())
    assert table.row("decoder.layers.0.self_attention.linear_qkv").reason.text == (
        "small GEMM: K=64, N=192 per rank; min(K,N) 64 < precision.small_gemm.min_dim 128"
    )


def test_per_rank_shapes_under_tensor_parallelism():
    # Llama-3-8B's GEMMs at TP=8, against the default rule (min_dim 1024, 2*K*N >= 2**23).
    qkv, fc2 = GemmShape.of(4096, 6144), GemmShape.of(14336, 4096)  # GQA: 4096 + 2*1024
    assert per_rank_shape("column", qkv, 8) == GemmShape.of(4096, 768)  # outputs split
    assert per_rank_shape("row", fc2, 8) == GemmShape.of(1792, 4096)  # inputs split
    assert per_rank_shape("vocab", GemmShape.of(128256, 4096), 2) == GemmShape.of(64128, 4096)
    assert per_rank_shape("replicated", qkv, 8) == qkv
    with pytest.raises(ValueError, match="does not split evenly"):
        per_rank_shape("column", GemmShape.of(64, 192), 5)

    rule = SmallGemmRule()
    assert small_gemm_verdict(rule, per_rank_shape("column", qkv, 1)) is None
    assert small_gemm_verdict(rule, per_rank_shape("column", qkv, 8)) == (
        "small GEMM: K=4096, N=768 per rank; min(K,N) 768 < precision.small_gemm.min_dim 1024 "
        "and 2*K*N 6291456 < precision.small_gemm.min_flops_per_token 8388608"
    )
    assert small_gemm_verdict(rule, per_rank_shape("row", fc2, 8)) is None


def test_a_tensor_parallel_size_the_model_was_not_built_with_is_refused(model, manifest):
    with pytest.raises(ValueError, match="tensor_parallel=2 does not fit the model"):
        decide_admission(model, manifest.precision, tensor_parallel=2)


def test_precision_disabled_runs_nothing_in_fp8(model, manifest):
    table = decide(model, manifest, enabled=False)
    assert table.fp8_fqns == ()
    for fqn in projections():
        assert table.row(fqn).reason.code == "fp8_disabled"
        assert table.row(fqn).reason.text == "precision.enabled is false: no module runs FP8"
    assert table.summary().startswith("0 of 16 modules FP8; 16 in bf16: 8 FP8 disabled, ")


def test_the_plain_spec_has_no_fp8_capable_module(manifest):
    table = decide(build_gpt(manifest, None), manifest)
    for fqn in projections():
        row = table.row(fqn)
        assert (row.precision, row.reason.code) == ("bf16", "not_fp8_capable")
        assert "built from the plain spec" in row.reason.text


def test_globs_that_match_nothing_are_reported_together(model, manifest):
    with pytest.raises(AdmissionError) as info:
        decide(
            model,
            manifest,
            include_modules=["*.linear_qkv", "linear_fc1"],
            exclude_modules=["lm_head"],
        )
    message = str(info.value)
    assert message.startswith("2 module glob(s) in the manifest match no module of this model")
    bare = (
        "precision.include_modules[1] 'linear_fc1': matches nothing; did you mean '*.linear_fc1'?"
    )
    other_stack = (
        "precision.exclude_modules[0] 'lm_head': matches nothing; did you mean 'output_layer'?"
    )
    assert bare in message and other_stack in message
    assert "include_modules[0]" not in message

    with pytest.raises(AdmissionError, match=r"'\*\.linear_qvk'.*did you mean '\*\.linear_qkv'"):
        decide(model, manifest, include_modules=["*.linear_qvk"])


def recipe_entry(globs, scaling="current", approval=None):
    return {"modules": globs, "scaling": scaling, "reason": "r", "approval": approval}


def test_module_recipe_entries_that_would_change_nothing_are_refused_together(model, manifest):
    with pytest.raises(AdmissionError) as info:
        decide(
            model,
            manifest,
            module_recipes=[
                recipe_entry(["decoder.layers.0.*"]),
                recipe_entry(["decoder.layers.0.mlp.*"], "block"),  # all taken by [0]
                recipe_entry(["decoder.final_layernorm", "output_layer"], "block"),
                recipe_entry(["decoder.layers.1.mlp.*"], "mxfp8"),  # kept
            ],
        )
    message = str(info.value)
    assert message.startswith("2 precision.module_recipes entries would change no module's")
    assert (
        "module_recipes[1] (block for decoder.layers.0.mlp.*): every module it matches is "
        "decided by an earlier entry (precision.module_recipes[0])"
    ) in message
    assert (
        "module_recipes[2] (block for decoder.final_layernorm, output_layer): matches only "
        "modules that never run FP8 (lm_head, norm)"
    ) in message
    assert "module_recipes[3]" not in message and "module_recipes[0]" not in message.split(":")[0]


def test_a_module_recipe_in_the_runs_own_recipe_must_keep_modules_from_a_later_entry(
    model, manifest
):
    """Under current scaling, 'current for layer 0's MLP, then block for layer 0' keeps the MLP
    in current scaling: the first match decides. Alone, the same entry does nothing."""
    current = {"scaling": "current", "amax_history_len": 1024}
    carve_out = [
        recipe_entry(["decoder.layers.0.mlp.*"]),
        recipe_entry(["decoder.layers.0.*"], "block"),
    ]
    table = decide(model, manifest, **current, module_recipes=carve_out)
    scaling = {row.fqn: row.scaling for row in table.rows if row.fp8}
    assert scaling["decoder.layers.0.mlp.linear_fc1"] == "current"
    assert scaling["decoder.layers.0.self_attention.linear_qkv"] == "block"
    assert scaling["decoder.layers.1.mlp.linear_fc1"] is None  # the run's own
    idle = [recipe_entry(["decoder.layers.1.*"]), recipe_entry(["decoder.layers.0.*"], "block")]
    with pytest.raises(AdmissionError, match=r"module_recipes\[0\].*the run's own recipe"):
        decide(model, manifest, **current, module_recipes=idle)
    with pytest.raises(ManifestError, match="no later entry gives another"):  # the schema's
        revised(manifest, **current, module_recipes=[recipe_entry(["decoder.layers.1.*"])])
    # An entry runs its recipe at TE's defaults: with the run's own fields set otherwise, it
    # would not keep these modules on the run's recipe.
    with pytest.raises(ManifestError, match="at Transformer Engine's defaults.*power_2_scale"):
        revised(manifest, **current, power_2_scale=True, module_recipes=carve_out)
    # A resume runs what its checkpoint ran: the refusal is for new runs only.
    idle_table = decide_admission(
        model,
        revised(manifest, **current, module_recipes=idle).precision,
        tensor_parallel=1,
        refuse_idle_recipes=False,
    )
    assert idle_table.row("decoder.layers.1.mlp.linear_fc1").scaling == "current"


def test_the_ledgers_entries_may_take_every_module_of_a_written_one(model, manifest):
    """An approved override that stages one module in current scaling goes first; the written
    entry it empties is not refused (the override, not the manifest, moved its module), and a
    ledger entry in the run's own recipe is what brings a module back from a glob."""
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    entries = [recipe_entry([fc1], approval="a" * 64), recipe_entry([fc1], "block")]
    table = decide(model, manifest, module_recipes=entries)
    assert table.row(fc1).scaling == "current"
    current = {"scaling": "current", "amax_history_len": 1024}
    entries = [
        recipe_entry([fc1], approval="b" * 64),
        recipe_entry(["decoder.layers.0.*"], "block"),
    ]
    assert decide(model, manifest, **current, module_recipes=entries).row(fc1).scaling == "current"


# -- applying it: fp8_enabled in training ------------------------------------------------------


def test_applied_admission_freezes_the_fp8_state_of_excluded_modules(manifest, recipe):
    m = revised(manifest, exclude_modules=["decoder.layers.0.*"])
    model = build_gpt(m, recipe)
    table = decide_admission(model, m.precision, tensor_parallel=1)
    apply_admission(table, model)
    modules = fp8_modules(model)
    assert {fqn for fqn, module in modules.items() if module.fp8_enabled} == set(projections(1))

    initial = {fqn: module.fp8_meta.state_dict() for fqn, module in modules.items()}
    scope = Fp8Scope(recipe, group=amax_reduction_group(m.topology))
    generator = torch.Generator().manual_seed(0)
    b, s = m.schedule.micro_batch_size, m.model.seq_length
    for _ in range(2):
        tokens = torch.randint(0, 256, (b, s + 1), generator=generator)
        with scope():
            loss = model(tokens[:, :-1], torch.arange(s).expand(b, s), None, labels=tokens[:, 1:])
        loss.mean().backward()

    for fqn, module in modules.items():
        after = module.fp8_meta.state_dict()
        same = all(torch.equal(after[key], initial[fqn][key]) for key in after)
        assert same == (fqn in projections(0)), fqn


def test_a_table_for_another_model_is_refused(model, manifest):
    table = decide(model, manifest)
    shorter = AdmissionTable(rows=table.rows[:-1], tensor_parallel=1)
    with pytest.raises(AdmissionError, match="only in the model: output_layer"):
        apply_admission(shorter, model)
    with pytest.raises(AdmissionError, match="built them from the plain spec"):
        apply_admission(table, build_gpt(manifest, None))


# -- layers.json ---------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, model, manifest, recipe):
    """A run directory holding the layers.json of layer 0 excluded."""
    m = revised(manifest, exclude_modules=["decoder.layers.0.*"])
    table = decide_admission(model, m.precision, tensor_parallel=1)
    write_layers_json(tmp_path, table, recipe, tensor_parallel=1, manifest_hash=manifest_hash(m))
    return tmp_path


def test_layers_json_round_trip(run_dir, model, manifest, recipe):
    document = read_layers_json(run_dir)
    m = revised(manifest, exclude_modules=["decoder.layers.0.*"])
    table = decide_admission(model, m.precision, tensor_parallel=1)
    assert document.table == table
    assert (document.manifest_hash, document.tensor_parallel) == (manifest_hash(m), 1)
    assert document.recipe.model_dump(exclude_defaults=True) == {
        "fp8_format": "hybrid",
        "amax_history_len": 8,
        "amax_compute_algo": "max",
        "margin": 0,
        "reduce_amax": True,
    }
    raw = json.loads((run_dir / "layers.json").read_text())
    assert raw["schema_version"] == 1 and raw["tensor_parallel"] == 1
    assert raw["rows"][0]["global_shape"] == {"in": 256, "out": 64}

    # The hash is of the content: the same table written again has the same one.
    first = document.table_hash
    write_layers_json(run_dir, table, recipe, tensor_parallel=1, manifest_hash="0" * 64)
    assert read_layers_json(run_dir).table_hash == first
    assert os.listdir(run_dir) == ["layers.json"]  # no temporary file left behind


def test_per_gemm_rows_round_trip_and_uniform_rows_hash_as_before_the_field(
    tmp_path, model, manifest, recipe
):
    """A row whose three GEMMs run as the module hashes as a row of a table written before
    per-GEMM precision (no ``gemms``): a run's table keeps the identity its checkpoints carry.
    Such an older file reads, its FP8 rows running all three GEMMs in FP8."""
    from fp8ops.run.records import table_hash

    fc2 = "decoder.layers.1.mlp.linear_fc2"
    m = revised(manifest, overrides=[{"module": fc2, "reason": "g", "gemms": ["dgrad", "wgrad"]}])
    table = decide_admission(model, m.precision, tensor_parallel=1)
    write_layers_json(tmp_path, table, recipe, tensor_parallel=1, manifest_hash="0" * 64)
    document = read_layers_json(tmp_path)
    assert document.table == table and document.table.row(fc2).fp8_gemms == ("fprop",)

    plain = decide(model, manifest)
    old_rows = tuple(row.model_copy(update={"gemms": None}) for row in plain.rows)
    record = document.recipe
    assert table_hash(plain.rows, record) == table_hash(old_rows, record)
    assert table_hash(table.rows, record) != table_hash(plain.rows, record)
    raw = json.loads((tmp_path / "layers.json").read_text())
    for row in raw["rows"]:
        del row["gemms"]
    raw["rows"] = [r for r in raw["rows"] if r["fqn"] != fc2] + [
        json.loads(plain.row(fc2).model_dump_json(by_alias=True, exclude={"gemms"}))
    ]
    raw["table_hash"] = table_hash(
        tuple(plain.row(r["fqn"]).model_copy(update={"gemms": None}) for r in raw["rows"]), record
    )
    (tmp_path / "layers.json").write_text(json.dumps(raw))
    old = read_layers_json(tmp_path).table
    assert old.row(fc2).gemms is None and old.row(fc2).fp8_gemms == ("fprop", "dgrad", "wgrad")
    assert old.row("output_layer").fp8_gemms == ()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    run_dir, model, manifest, recipe, monkeypatch
):
    before = (run_dir / "layers.json").read_bytes()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_layers_json(
            run_dir, decide(model, manifest), recipe, tensor_parallel=1, manifest_hash="0" * 64
        )
    assert os.listdir(run_dir) == ["layers.json"]
    assert (run_dir / "layers.json").read_bytes() == before


def test_a_corrupt_or_edited_layers_json_is_refused_naming_the_file(run_dir):
    path = run_dir / "layers.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(LayersFileError, match=f"{path}: corrupt layers file: .*Invalid JSON"):
        read_layers_json(run_dir)

    edited = json.loads(text)
    edited["rows"][3]["precision"] = "fp8"
    path.write_text(json.dumps(edited))
    with pytest.raises(LayersFileError, match=r"rows\[3\]: .*runs fp8, but its GEMMs say"):
        read_layers_json(run_dir)
    for gemm in edited["rows"][3]["gemms"].values():  # edited as the row: only the hash tells
        gemm["precision"] = "fp8"
    path.write_text(json.dumps(edited))
    with pytest.raises(LayersFileError, match="table_hash .* does not match its rows"):
        read_layers_json(run_dir)

    edited["rows"][3]["reason"]["code"] = "maybe"
    path.write_text(json.dumps(edited))
    with pytest.raises(LayersFileError, match=r"rows\[3\]\.reason\.code"):
        read_layers_json(run_dir)

    path.unlink()
    with pytest.raises(LayersFileError, match="layers.json: no such file"):
        read_layers_json(run_dir)


# -- fp8ops inspect ------------------------------------------------------------------------------


def inspect(*args, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_inspect_layers_prints_every_module_and_the_summary(run_dir, capsys):
    code, out, _ = inspect(run_dir, "--layers", capsys=capsys)
    assert code == 0
    for fqn in [*projections(), "output_layer", "embedding.word_embeddings", *NORMS]:
        assert fqn in out
    assert "excluded by precision.exclude_modules[0] 'decoder.layers.0.*'" in out
    assert "64 x 192" in out  # qkv, global and per rank
    assert "4 of 16 modules FP8; 12 in bf16: 4 excluded, 2 embedding, 1 LM head, 5 norm" in out
    assert "recipe: hybrid, amax_history_len 8, max, margin 0" in out

    code, out, _ = inspect(run_dir, capsys=capsys)
    assert code == 0 and "4 of 16 modules FP8" in out and "decoder.layers" not in out


def test_inspect_layers_shows_each_gemm_of_a_partly_fp8_module(
    tmp_path, model, manifest, recipe, capsys
):
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    m = revised(manifest, overrides=[{"module": fc2, "reason": "grads", "gemms": ["wgrad"]}])
    table = decide_admission(model, m.precision, tensor_parallel=1)
    write_layers_json(tmp_path, table, recipe, tensor_parallel=1, manifest_hash="0" * 64)
    code, out, _ = inspect(tmp_path, "--layers", capsys=capsys)
    assert code == 0
    assert "fprop, dgrad fp8; wgrad bf16" in " ".join(out.split())
    assert "wgrad: BF16 override of wgrad (written in the manifest): grads" in " ".join(out.split())
    assert "1 FP8 with some GEMMs in the base dtype" in out


def test_inspect_without_a_run_is_a_user_error(tmp_path, capsys):
    code, out, err = inspect(tmp_path / "nowhere", "--layers", capsys=capsys)
    assert (code, out) == (2, "")
    assert err.strip() == f"{tmp_path / 'nowhere'}: no such run directory"

    code, _, err = inspect(tmp_path, capsys=capsys)
    assert code == 2 and "layers.json: no such file" in err
