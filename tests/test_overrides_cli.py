"""``fp8ops overrides ...`` through the real entry point (in-process): output, exit codes and
messages, on the run directory of tests/test_ledger.py (tests/support/ledger_run.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

if importlib.util.find_spec("megatron") is None:  # the layer table comes from the real model
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.ledger_run import FC1, QKV, admit_tiny_gpt, make_run_dir

from fp8ops.overrides import Ledger

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def admitted(megatron_tp1):
    return admit_tiny_gpt()


@pytest.fixture
def run_dir(tmp_path, admitted, monkeypatch):
    monkeypatch.setenv("FP8OPS_USER", "ana")  # who acts when --user is not given
    return make_run_dir(tmp_path / "run", admitted)


def staged_id(run_dir, module=FC1):
    return next(o.id for o in Ledger(run_dir).overrides().values() if o.module == module)


def test_stage_approve_list_verify(cli, run_dir):
    result = cli("overrides", "stage", run_dir, FC1, QKV, "--reason", "saturation since step 110")
    assert result.code == 0, result.err
    fc1 = staged_id(run_dir)
    assert f"staged {fc1[:12]}: {FC1} to bf16 (staged)" in result.out
    assert f"approve: fp8ops overrides approve {run_dir} {fc1[:12]}" in result.out
    assert Ledger(run_dir).get(fc1).who == "ana"  # from FP8OPS_USER

    result = cli("overrides", "approve", run_dir, fc1[:7], "--user", "ben", "--note", "agreed")
    assert (result.code, result.out) == (0, f"approved {fc1[:12]}: {FC1} to bf16 (approved)\n")

    result = cli("overrides", "list", run_dir)
    assert result.code == 0
    header, _, *rows = result.out.splitlines()
    assert header.split() == [
        "id",
        "module",
        "to",
        "status",
        "who",
        "decided",
        "by",
        "reason",
        "step",
    ]
    assert rows[0].split()[:6] == [fc1[:12], FC1, "bf16", "approved", "ana", "ben"]
    assert rows[1].split()[3:5] == ["staged", "ana"] and rows[1].split()[-1] == "120"

    records = [
        json.loads(line)
        for line in cli("overrides", "list", run_dir, "--json").out.split("\n")
        if line
    ]
    assert [(r["module"], r["status"], r["decided_by"]) for r in records] == [
        (FC1, "approved", "ben"),
        (QKV, "staged", None),
    ]
    assert records[0]["triggers"][0]["value"] == "nan"  # JSON-safe, as alerts.jsonl writes it

    result = cli("overrides", "verify", run_dir)
    assert result.out == (
        f"{run_dir}/overrides.jsonl: 3 record(s), hash chain intact; 1 approved, 1 staged\n"
    )


def test_reject_revoke_and_list_all(cli, run_dir):
    cli("overrides", "stage", run_dir, FC1, QKV, "--reason", "r")
    fc1, qkv = staged_id(run_dir), staged_id(run_dir, QKV)
    result = cli("overrides", "reject", run_dir, fc1, "--reason", "transient", "--user", "ben")
    assert result.out == f"rejected {fc1[:12]}: {FC1} to bf16 (rejected)\n"
    cli("overrides", "approve", run_dir, qkv, "--user", "ben")
    Ledger(run_dir).record_applied([qkv], step=150, revision="e" * 64)
    result = cli("overrides", "revoke", run_dir, qkv, "--reason", "fixed upstream")
    assert result.out.splitlines() == [
        f"revoked {qkv[:12]}: {QKV} to bf16 (revoked)",
        f"  {QKV} runs in BF16 until the next resume, then in FP8 again",
    ]
    listed = cli("overrides", "list", run_dir).out
    assert "revoked, lift at resume" in listed and fc1[:12] not in listed
    assert fc1[:12] in cli("overrides", "list", run_dir, "--all").out


def test_refusals_exit_2_with_the_reason(cli, run_dir):
    cli("overrides", "stage", run_dir, FC1, "--reason", "r")
    fc1 = staged_id(run_dir)
    cases = [
        (("approve", run_dir, fc1), f"ana staged override {fc1[:12]}"),
        (("stage", run_dir, FC1, "--reason", "again"), f"already has an open override: {fc1[:12]}"),
        (("stage", run_dir, "output_layer", "--reason", "r"), "already runs in bf16, not FP8"),
        (("stage", run_dir, "decoder.layers.0.mlp.linear_fc9", "--reason", "r"), "did you mean"),
        (("approve", run_dir, "abc"), "'abc' is not an override id"),
        (("verify", run_dir.parent / "nowhere"), "no such run directory"),
    ]
    for args, message in cases:
        result = cli("overrides", *args)
        assert (result.code, result.out) == (2, ""), args
        assert message in result.err and "Traceback" not in result.err, args


def test_verify_names_the_damaged_line(cli, run_dir):
    assert "no ledger yet" in cli("overrides", "verify", run_dir).out
    cli("overrides", "stage", run_dir, FC1, QKV, "--reason", "r")
    path = run_dir / "overrides.jsonl"
    path.write_text(path.read_text().replace('"reason":"r"', '"reason":"R"', 1))
    result = cli("overrides", "verify", run_dir)
    assert result.code == 2
    assert result.err.startswith(f"{path}, line 1: the record's hash does not match its content")


def test_export_te(cli, run_dir, tmp_path):
    cli("overrides", "stage", run_dir, FC1, "--reason", "r")
    assert "nothing to export" in cli("overrides", "export-te", run_dir).err
    cli("overrides", "approve", run_dir, staged_id(run_dir), "--user", "ben")

    printed = yaml.safe_load(cli("overrides", "export-te", run_dir).out)
    section = printed["fp8ops_bf16_overrides"]
    pattern = section["layers"]["layer_name_regex_pattern"]
    assert pattern == r"^(?:decoder\.layers\.0\.mlp\.linear_fc1)$"

    out = tmp_path / "te.yaml"
    result = cli("overrides", "export-te", run_dir, "-o", out, "--names", "inferred")
    assert (result.code, result.out) == (0, f"wrote {out}\n")
    layers = yaml.safe_load(out.read_text())["fp8ops_bf16_overrides"]["layers"]
    assert layers["layer_name_regex_pattern"] == r"^(?:model\.decoder\.layers\.1\.mlp\.linear_fc1)$"
    assert cli("overrides", "export-te", run_dir, "--names", "te").code == 2
