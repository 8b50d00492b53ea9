"""The manifest package: schema, canonical hash, diff, revisions and the store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import Field, ValidationError
from support.example_manifests import LLAMA, MINIMAL, TINY

from fp8ops.errors import ManifestError, RevisionError
from fp8ops.manifest import (
    Manifest,
    ManifestStore,
    Telemetry,
    canonical_dict,
    canonical_json,
    content_dict,
    derive,
    diff_manifests,
    load_manifest,
    manifest_hash,
    parse_assignments,
    parse_manifest,
    to_yaml,
    write_manifest,
)
from fp8ops.manifest.schema import Globs, _Section, added_field
from fp8ops.manifest.yaml_io import load_yaml_value


def with_change(m: Manifest, path: str, value: Any) -> Manifest:
    """``m`` with one dotted field replaced (no revision bookkeeping, unlike ``derive``)."""
    data = content_dict(m)
    *sections, field = path.split(".")
    node = data
    for section in sections:
        node = node[section]
    node[field] = value
    return Manifest.model_validate(data)


@pytest.fixture(scope="module")
def tiny() -> Manifest:
    return load_manifest(TINY)


# --------------------------------------------------------------------------------------
# The examples
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TINY, LLAMA], ids=lambda p: p.name)
def test_example_manifests_validate(path):
    m = load_manifest(path)
    assert m.schema_version == 1
    assert m.revision.number == 0
    assert m.precision.scaling == "delayed"
    assert m.precision.fp8_format == "hybrid"


def test_tiny_manifest_runs_every_projection_in_fp8(tiny):
    assert tiny.precision.small_gemm.enabled is False
    assert len(tiny.precision.include_modules) == 4
    assert tiny.precision.exclude_modules == ()
    assert (tiny.model.num_layers, tiny.model.hidden_size, tiny.model.ffn_hidden_size) == (
        4,
        128,
        512,
    )
    assert (tiny.precision.amax_history_len, tiny.precision.amax_compute_algo) == (16, "max")
    assert tiny.tokenizer.kind == "byte" and tiny.data.kind == "tasks"
    assert tiny.topology.world_size == 1


def test_production_manifest_shapes_pass_its_small_gemm_rule():
    m = load_manifest(LLAMA)
    tp, h, ffn = m.topology.tensor_parallel, m.model.hidden_size, m.model.ffn_hidden_size
    head_dim = h // m.model.num_attention_heads
    qkv_out = (m.model.num_attention_heads + 2 * m.model.num_query_groups) * head_dim
    per_rank = {  # (K, N) of each projection on one TP rank
        "linear_qkv": (h, qkv_out // tp),
        "linear_proj": (h // tp, h),
        "linear_fc1": (h, 2 * ffn // tp),  # swiglu: gate and up
        "linear_fc2": (ffn // tp, h),
    }
    rule = m.precision.small_gemm
    for name, (k, n) in per_rank.items():
        assert min(k, n) >= rule.min_dim, name
        assert 2 * k * n >= rule.min_flops_per_token, name
    assert m.topology.world_size == 8


def test_manifest_is_frozen_all_the_way_down(tiny):
    with pytest.raises(ValidationError, match="frozen"):
        tiny.precision.margin = 3
    assert isinstance(tiny.precision.include_modules, tuple)


# --------------------------------------------------------------------------------------
# Canonical form and hash
# --------------------------------------------------------------------------------------

REORDERED = """\
# Same run as MINIMAL: sections and keys in another order, comments, flow style.
schedule: {global_batch_size: 8, train_steps: 10}   # flow mapping
data:
    kind: tasks       # four-space indent
model: {vocab_size: 256, seq_length: 64, num_attention_heads: 4,
        ffn_hidden_size: 256, hidden_size: 64, num_layers: 2}
name: "minimal"
schema_version: 1
"""

EXPLICIT_DEFAULTS = (
    MINIMAL
    + """\
precision:
  base_dtype: bf16
  fp8_format: hybrid
  scaling: delayed
  amax_history_len: 1024
  amax_compute_algo: max
  margin: 0
  reduce_amax: true
  include_modules: ["*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2"]
  exclude_modules: []
optimizer: {name: adamw, lr: 1e-5, min_lr: 0, beta2: 0.95, clip_grad: 1}
revision: {number: 0, parent: null, reason: null}
topology: {tensor_parallel: 1, amax_reduction: tp_dp_cp}
"""
)


@pytest.mark.parametrize(
    "text",
    [REORDERED, EXPLICIT_DEFAULTS, MINIMAL.replace("\n", "  # comment\n")],
    ids=["reordered-flow-comments", "explicit-defaults", "trailing-comments"],
)
def test_hash_ignores_form(text):
    assert manifest_hash(parse_manifest(text, "a")) == manifest_hash(parse_manifest(MINIMAL, "b"))


def test_hash_ignores_number_spelling():
    spellings = ["1e-4", "1.0e-4", "0.0001", "+1E-4"]
    hashes = {
        manifest_hash(parse_manifest(MINIMAL + f"optimizer: {{lr: {s}}}\n", s)) for s in spellings
    }
    assert len(hashes) == 1
    # and a YAML integer in a float field is that float
    as_int = parse_manifest(MINIMAL + "gates: {loss_gap: 1}\n", "int")
    as_float = parse_manifest(MINIMAL + "gates: {loss_gap: 1.0}\n", "float")
    assert manifest_hash(as_int) == manifest_hash(as_float)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("name", "tiny-gpt-cpu-2"),
        ("precision.margin", 1),
        ("precision.amax_history_len", 32),
        ("precision.amax_compute_algo", "most_recent"),
        ("precision.fp8_format", "e4m3"),
        ("precision.reduce_amax", False),
        ("precision.include_modules", ["*.linear_qkv"]),
        ("precision.exclude_modules", ["*.layers.0.*"]),
        ("model.num_layers", 6),
        ("optimizer.lr", 3e-3),
        ("schedule.train_steps", 41),
        ("seeds.data", 1),
        ("topology.amax_reduction", "tp_cp"),
        ("gates.loss_gap", 0.02),
        ("telemetry.error_sample_every", 7),
    ],
)
def test_hash_changes_with_meaning(tiny, path, value):
    changed = with_change(tiny, path, value)
    assert manifest_hash(changed) != manifest_hash(tiny)
    assert [c.path for c in diff_manifests(tiny, changed)] == [path]


def test_canonical_json_is_sorted_and_compact(tiny):
    text = canonical_json(tiny)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert text.startswith('{"alerts":')
    assert len(manifest_hash(tiny)) == 64


@pytest.mark.parametrize("path", [TINY, LLAMA], ids=lambda p: p.name)
def test_to_yaml_round_trips(path):
    m = load_manifest(path)
    text = to_yaml(m)
    assert manifest_hash(m) in text.splitlines()[1]
    assert manifest_hash(parse_manifest(text, "round-trip")) == manifest_hash(m)


def test_to_yaml_quotes_strings_that_look_like_floats(tiny):
    child = derive(tiny, {"precision.margin": 1}, "1e-5")
    assert parse_manifest(to_yaml(child), "x").revision.reason == "1e-5"


# --------------------------------------------------------------------------------------
# Hashes across fp8ops versions
# --------------------------------------------------------------------------------------

# The shipped manifests' hashes. A run's checkpoints, its stored revisions and their parent
# links all name a manifest by hash, so a change of the hash of a manifest that did not change
# refuses every existing run's resume. If this fails after a schema change: declare the new field
# with ``schema.added_field``, not ``Field``, and give it the default that means what runs did
# before. (The files themselves are never edited: a change is a new revision.)
SHIPPED_HASHES = {
    "tiny-gpt-cpu-base.yaml": "147bb0a27e1e7e7e18bd66a0ba07a88ce341c6af5348f6d2eba23e73a8813ee9",
    "tiny-gpt-cpu.yaml": "e3401e12090da85ef349b9b7b1848eb4c57b28efa02a86271f0caa44f8c68dcf",
    "llama3-8b-h100.yaml": "e43d286bfcaf197c8a13a910c8ba6cd68badab08aadc1dda6828d607caf0cbb5",
    "llama3-8b-h100-r1.yaml": "5f2ea22db9f025dced89bd8a475ad7ef6d858843f35c6a251f5bdd5b3b0d460c",
    "smollm2-135m-chat.yaml": "05d3e92a4377d5c9400bf27c9d7c9aaadc8b5340f9bfebe46d5c1a09be5a2e1a",
}


def test_shipped_manifests_keep_their_hashes():
    shipped = {p.name: manifest_hash(load_manifest(p)) for p in TINY.parent.glob("*.yaml")}
    assert shipped == SHIPPED_HASHES
    r1 = load_manifest(TINY.parent / "llama3-8b-h100-r1.yaml")
    assert r1.revision.parent == SHIPPED_HASHES["llama3-8b-h100.yaml"]


class _LaterTelemetry(Telemetry):
    # What a later fp8ops adding a field looks like.
    error_sample_modules: Globs = added_field(
        (), added_in="9.9.0", description="Modules whose FP8 error is sampled; () for all."
    )


class _LaterReview(_Section):
    quorum: int = Field(1, description="Approvals an override needs.")


class _LaterManifest(Manifest):
    telemetry: _LaterTelemetry = Field(default_factory=_LaterTelemetry)
    later_review: _LaterReview = added_field(default_factory=_LaterReview, added_in="9.9.0")


def test_a_field_added_later_keeps_existing_hashes_until_it_is_used(tiny):
    data = content_dict(tiny)
    later = _LaterManifest.model_validate(data)
    assert manifest_hash(later) == manifest_hash(tiny)
    assert content_dict(later)["telemetry"]["error_sample_modules"] == []  # still in the content
    # Written out at its default, it means the same run.
    data["telemetry"]["error_sample_modules"] = []
    data["later_review"] = {"quorum": 1}
    assert manifest_hash(_LaterManifest.model_validate(data)) == manifest_hash(tiny)
    # Used, it changes the hash, and the diff names it.
    data["telemetry"]["error_sample_modules"] = ["*.linear_fc2"]
    used = _LaterManifest.model_validate(data)
    assert manifest_hash(used) != manifest_hash(tiny)
    assert [(c.path, c.old, c.new) for c in diff_manifests(later, used)] == [
        ("telemetry.error_sample_modules", [], ["*.linear_fc2"])
    ]
    data["later_review"] = {"quorum": 2}
    assert "later_review" in canonical_dict(_LaterManifest.model_validate(data))
    # At its default, the canonical YAML leaves it out, so an older fp8ops reads the file.
    assert manifest_hash(parse_manifest(to_yaml(later), "older reader")) == manifest_hash(tiny)


def test_diff_reports_changes_by_path(tiny):
    assert diff_manifests(tiny, tiny) == []
    other = derive(tiny, {"precision.margin": 2, "alerts.underflow.stop": 0.5}, "why")
    changes = {c.path: c for c in diff_manifests(tiny, other)}
    assert set(changes) == {
        "precision.margin",
        "alerts.underflow.stop",
        "revision.number",
        "revision.parent",
        "revision.reason",
    }
    assert (changes["precision.margin"].old, changes["precision.margin"].new) == (0, 2)
    assert changes["alerts.underflow.stop"].old is None
    assert all(c.kind == "changed" for c in changes.values())


# --------------------------------------------------------------------------------------
# Loading details
# --------------------------------------------------------------------------------------


def test_unreadable_file_is_a_manifest_error(tmp_path, monkeypatch):
    path = tmp_path / "m.yaml"
    path.write_text(MINIMAL)

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod cannot stop root, who runs CI
    with pytest.raises(ManifestError) as exc:
        load_manifest(path)
    assert str(exc.value) == f"{path}: cannot read: Permission denied"


def test_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + MINIMAL.encode())
    assert manifest_hash(load_manifest(path)) == manifest_hash(parse_manifest(MINIMAL, "m"))


def test_strict_types_reject_quoted_numbers():
    with pytest.raises(ManifestError) as exc:
        parse_manifest(MINIMAL + "precision: {amax_history_len: '16'}\n", "m.yaml")
    assert "precision.amax_history_len: must be an integer (got string '16'" in str(exc.value)
    assert "without quotes" in str(exc.value)


def test_every_problem_is_listed_with_its_line():
    text = MINIMAL + "precision:\n  margin: -1\n  amax_history_len: 0\noptimizer: {lr: 0}\n"
    with pytest.raises(ManifestError) as exc:
        parse_manifest(text, "m.yaml")
    lines = str(exc.value).splitlines()
    assert lines[0] == "m.yaml: 3 problems"
    assert "  precision.amax_history_len: must be >= 1 (got 0) [line 17]" in lines
    assert "  precision.margin: must be >= 0 (got -1) [line 16]" in lines
    assert "  optimizer.lr: must be > 0 (got 0) [line 18]" in lines


def test_duplicate_keys_are_all_reported():
    text = MINIMAL + "name: again\nprecision: {margin: 1, margin: 2}\n"
    with pytest.raises(ManifestError) as exc:
        parse_manifest(text, "m.yaml")
    message = str(exc.value)
    assert "name: duplicate key (first at line 2) [line 15]" in message
    assert "precision.margin: duplicate key (first at line 16) [line 16]" in message


def test_yaml_anchors_and_merge_keys_are_not_duplicates():
    text = (
        MINIMAL
        + "alerts:\n  saturation: &s {observe: 0.001}\n  underflow: {<<: *s, observe: 0.002}\n"
    )
    assert parse_manifest(text, "m.yaml").alerts.underflow.observe == 0.002


def test_levels_blame_the_written_level_not_the_default():
    with pytest.raises(ManifestError) as exc:
        parse_manifest(MINIMAL + "alerts: {saturation: {degrade: 0.5}}\n", "m.yaml")
    assert "alerts.saturation.degrade: must be <= stop (0.01, its default) (got 0.5)" in str(
        exc.value
    )
    turned_off = parse_manifest(MINIMAL + "alerts: {saturation: {degrade: 0.5, stop: null}}\n", "m")
    assert turned_off.alerts.saturation.stop is None


def test_amax_algo_is_parsed_by_the_precision_package():
    m = parse_manifest(
        MINIMAL + "precision: {amax_history_len: 16, amax_compute_algo: 'trimmed_max:2'}\n", "m"
    )
    assert (m.precision.amax_algo.kind, m.precision.amax_algo.k) == ("trimmed_max", 2)


# --------------------------------------------------------------------------------------
# Revisions
# --------------------------------------------------------------------------------------


def test_parse_assignments_reads_yaml_values():
    assert parse_assignments(
        ["precision.margin=1", "optimizer.lr=1e-5", "alerts.underflow.stop=null", "name=x=y"]
    ) == {"precision.margin": 1, "optimizer.lr": 1e-5, "alerts.underflow.stop": None, "name": "x=y"}
    with pytest.raises(ManifestError, match="expected PATH=VALUE"):
        parse_assignments(["precision.margin"])


def test_derive_links_to_its_parent(tiny):
    child = derive(tiny, parse_assignments(["precision.margin=1"]), "more headroom")
    assert child.precision.margin == 1
    assert child.revision.number == 1
    assert child.revision.parent == manifest_hash(tiny)
    assert child.revision.reason == "more headroom"
    grandchild = derive(child, {"precision.include_modules[3]": "*.mlp.linear_fc2"}, "narrower")
    assert grandchild.revision.number == 2
    assert grandchild.precision.include_modules[3] == "*.mlp.linear_fc2"


@pytest.mark.parametrize(
    ("changes", "reason", "message"),
    [
        ({"precision.margin": -1}, "r", "precision.margin: must be >= 0 (got -1)"),
        ({"precision.margn": 1}, "r", "precision.margn: unknown key (did you mean margin?)"),
        ({"precision.margin.x": 1}, "r", "precision.margin is a value, not a section"),
        ({"precision.include_modules[9]": "x"}, "r", "include_modules has no item [9]"),
        ({"precision..margin": 1}, "r", "not a field path"),
        ({"revision.number": 5}, "r", "revision.number: set by derive"),
        ({"precision.margin": 0}, "r", "nothing to derive"),
        ({"precision.margin": 1}, "  ", "revision.reason: a derived revision needs a non-empty"),
        ({}, "r", "no changes given"),
        # The sections the dual-track evaluation reads.
        ({"capability.items": 0}, "r", "capability.items: must be >= 1 (got 0)"),
        ({"capability.interval": 0}, "r", "capability.interval: must be >= 1 (got 0)"),
        (
            {"telemetry.error_sample_tokens": 0},
            "r",
            "telemetry.error_sample_tokens: must be >= 1 (got 0)",
        ),
        (
            {"telemetry.error_sample_tokens": "512"},
            "r",
            "telemetry.error_sample_tokens: must be an integer or null",
        ),
        (
            {"gates.bucket_significance": 1.5},
            "r",
            "gates.bucket_significance: must be < 1 (got 1.5)",
        ),
        ({"gates.resume_loss_jump": -1}, "r", "gates.resume_loss_jump: must be >= 0 (got -1)"),
        (
            {"dualtrack.fallback_modules": [""]},
            "r",
            "dualtrack.fallback_modules[0]: must be a non-empty module glob",
        ),
        (
            {"precision.backend": "cuda"},
            "r",
            "precision.backend: must be 'emulated', 'scaled_mm' or 'te' (got 'cuda')",
        ),
    ],
)
def test_derive_rejects(tiny, changes, reason, message):
    with pytest.raises(ManifestError) as exc:
        derive(tiny, changes, reason, source="parent.yaml with --set")
    assert str(exc.value).startswith("parent.yaml with --set: ")
    assert message in str(exc.value)


@pytest.fixture
def chain_of_three(tmp_path, tiny):
    store = ManifestStore(tmp_path / "store")
    first = derive(tiny, {"precision.margin": 1}, "headroom")
    second = derive(first, {"precision.amax_history_len": 32}, "longer window")
    paths = [store.put(m) for m in (tiny, first, second)]
    return store, [tiny, first, second], paths


def test_store_keeps_a_verifiable_chain(chain_of_three):
    store, manifests, paths = chain_of_three
    assert [p.name for p in paths] == [f"{manifest_hash(m)}.yaml" for m in manifests]
    assert store.verify() == 3
    assert store.heads() == [manifest_hash(manifests[2])]
    chain = store.chain(manifest_hash(manifests[2])[:10])  # a unique prefix will do
    assert [manifest_hash(m) for m in chain] == [manifest_hash(m) for m in manifests]


def test_put_is_idempotent_and_leaves_no_temporary_files(chain_of_three):
    store, manifests, paths = chain_of_three
    before = paths[1].stat().st_mtime_ns
    assert store.put(manifests[1]) == paths[1]
    assert paths[1].stat().st_mtime_ns == before  # not rewritten
    assert sorted(os.listdir(store.directory)) == sorted(p.name for p in paths)


def test_put_never_overwrites_different_content(tmp_path, tiny):
    store = ManifestStore(tmp_path)
    target = store.path_for(manifest_hash(tiny))
    impostor = to_yaml(with_change(tiny, "precision.margin", 7))
    target.write_text(impostor)
    with pytest.raises(RevisionError, match="refusing to overwrite"):
        store.put(tiny)
    assert target.read_text() == impostor


def test_put_failure_leaves_nothing_behind(tmp_path, tiny, monkeypatch):
    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        ManifestStore(tmp_path).put(tiny)
    assert os.listdir(tmp_path) == []


def test_store_detects_a_file_edited_in_place(chain_of_three):
    store, _, paths = chain_of_three
    paths[1].write_text(paths[1].read_text().replace("margin: 1", "margin: 2"))
    with pytest.raises(RevisionError) as exc:
        store.verify()
    assert str(paths[1]) in str(exc.value)
    assert "the file was changed after it was stored" in str(exc.value)
    with pytest.raises(RevisionError, match=paths[1].name):
        store.chain(paths[2].stem)


def test_store_detects_a_missing_parent(chain_of_three):
    store, _, paths = chain_of_three
    paths[0].unlink()
    with pytest.raises(RevisionError) as exc:
        store.verify()
    assert f"{paths[1]}: parent {paths[0].stem} is not in the store" in str(exc.value)
    with pytest.raises(RevisionError, match=f"parent {paths[0].stem} is not in the store"):
        store.chain(paths[2].stem)


def test_store_detects_a_skipped_revision_number(tmp_path, tiny):
    store = ManifestStore(tmp_path)
    store.put(tiny)
    data = canonical_dict(tiny)
    data["precision"]["margin"] = 1
    data["revision"] = {"number": 2, "parent": manifest_hash(tiny), "reason": "skips one"}
    path = store.put(Manifest.model_validate(data))
    with pytest.raises(RevisionError, match="revision number 2 does not follow its parent's"):
        store.verify()
    with pytest.raises(RevisionError, match=path.name):
        store.chain(path.stem)


def test_store_reports_a_corrupt_file(chain_of_three):
    store, _, paths = chain_of_three
    paths[2].write_text("schema_version: [\n")
    with pytest.raises(RevisionError) as exc:
        store.verify()
    assert f"{paths[2]}: line 2, column 1: YAML syntax error" in str(exc.value)


def test_write_manifest_refuses_to_overwrite(tmp_path, tiny):
    out = tmp_path / "m.yaml"
    write_manifest(tiny, out)
    write_manifest(tiny, out)  # same content: fine
    with pytest.raises(ManifestError, match="refusing to overwrite"):
        write_manifest(with_change(tiny, "precision.margin", 1), out)
    assert manifest_hash(load_manifest(out)) == manifest_hash(tiny)
    assert yaml.safe_load(out.read_text())["precision"]["margin"] == 0


def test_an_alias_bomb_is_refused_by_line_before_it_is_expanded():
    """Nine anchors of nine aliases each: 9^9 nodes from a dozen lines. Every command reads
    manifests through this loader; it must answer at once, naming the entry."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for previous, anchor in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{anchor}: &{anchor} [{', '.join([f'*{previous}'] * 9)}]")
    text = MINIMAL.rstrip("\n") + "\n" + "\n".join(lines) + "\nextra: *i\n"
    started = time.process_time()
    with pytest.raises(ManifestError) as exc:
        parse_manifest(text, "bomb.yaml")
    assert time.process_time() - started < 5.0  # measured 0.01 s; expanding it takes hours
    line = text.splitlines().index(lines[-1]) + 1
    message = str(exc.value)
    assert message.startswith(f"bomb.yaml: YAML aliases (*name) expand i (line {line})"), message
    assert "more than the 100000 a manifest may hold" in message
    # A --set value is read by the same loader.
    value = "[&a [x, x, x, x, x, x, x, x, x, x]"
    for previous, anchor in zip("abcde", "bcdef"):
        value += f", &{anchor} [{', '.join([f'*{previous}'] * 10)}]"
    with pytest.raises(yaml.YAMLError, match="expand"):
        load_yaml_value(value + "]")
    # A few anchors and merges, as a manifest may use them, load.
    assert load_yaml_value("[&a [1, 2], *a, *a]") == [[1, 2]] * 3


@pytest.mark.parametrize("depth", [150, 1000])
def test_a_manifest_nested_past_the_depth_limit_is_refused_not_a_traceback(depth):
    """Past 100 levels: refused by line; past what PyYAML's recursive composer can read (about
    330 on CPython's default limit): refused all the same, not a RecursionError traceback."""
    with pytest.raises(ManifestError, match="nest") as exc:
        parse_manifest(MINIMAL + "notes: " + "[" * depth + "]" * depth + "\n", "deep.yaml")
    assert str(exc.value).startswith("deep.yaml: YAML error: ")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"optimizer.lr": 3e38}, "optimizer.lr: must be <= 3.4e+37: AdamW's first step divides"),
        ({"optimizer.lr": 1e39, "optimizer.name": "sgd"}, "optimizer.lr: must be <= 3.40282e+38"),
        ({"optimizer.eps": 1e-50}, "optimizer.eps: must be >= 1.17549e-38"),
        ({"optimizer.clip_grad": 1e39}, "optimizer.clip_grad: must be <= 3.40282e+38"),
        ({"optimizer.lr": 1.0, "optimizer.weight_decay": 1e39}, "lr x weight_decay must be <="),
        ({"seeds.model": 2**64}, "seeds.model: must be <= 4294967295"),
        ({"seeds.data": -1}, "seeds.data: must be >= 0"),
    ],
)
def test_numbers_the_optimizer_arithmetic_cannot_hold_are_refused_by_field(changes, says):
    """float32 main weights: AdamW's step size lr / (1 - beta1) and lr x weight_decay must be
    float32 numbers (3e38 crashed inside AdamW); eps below float32's smallest normal is lost."""
    with pytest.raises(ManifestError) as exc:
        derive(load_manifest(TINY), changes, "test")
    assert says in str(exc.value), str(exc.value)
    # The bound is the arithmetic's, not a guess: just inside it loads.
    assert derive(load_manifest(TINY), {"optimizer.lr": 3.4e37}, "test").optimizer.lr == 3.4e37
