"""``fp8ops overrides ...`` through the real entry point (in-process): output, exit codes and
messages, on the run directory of tests/test_ledger.py (tests/support/ledger_run.py)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import yaml

if importlib.util.find_spec("megatron") is None:  # the layer table comes from the real model
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.fifo import without_waiting
from support.ledger_run import (
    FC1,
    QKV,
    admit_tiny_gpt,
    append_by_hand,
    checkpoint_record,
    forged_proposal,
    lock_to,
    make_run_dir,
)

from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash
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


def test_stage_some_gemms(cli, run_dir):
    result = cli("overrides", "stage", run_dir, FC1, "--reason", "r", "--gemms", "wgrad, dgrad")
    assert result.code == 0, result.err
    fc1 = staged_id(run_dir)
    assert f"staged {fc1[:12]}: {FC1} to bf16 (dgrad, wgrad) (staged)" in result.out
    assert Ledger(run_dir).get(fc1).gemms == ("dgrad", "wgrad")
    row = cli("overrides", "list", run_dir).out.splitlines()[2].split()
    assert row[:5] == [fc1[:12], FC1, "bf16", "(dgrad,", "wgrad)"]
    listed = json.loads(cli("overrides", "list", run_dir, "--json").out)
    assert listed["gemms"] == ["dgrad", "wgrad"]
    for given, words in (
        ("wgard", "'wgard' is not a GEMM"),
        ("", "empty"),
        ("wgrad,wgrad", "twice"),
    ):
        result = cli("overrides", "stage", run_dir, QKV, "--reason", "r", "--gemms", given)
        assert result.code == 2 and "--gemms: " in result.err and words in result.err


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


def _refused_on_read(cli, run_dir, *words):
    """``verify`` and ``list`` both exit 2 with ``words`` in the message, printing nothing."""
    for command in ("verify", "list"):
        result = cli("overrides", command, run_dir)
        assert (result.code, result.out) == (2, ""), (command, result.out)
        assert all(w in result.err for w in words), (command, result.err)
        assert "Traceback" not in result.err


def test_a_self_approval_written_by_hand_is_refused_on_an_unsigned_ledger(cli, run_dir):
    """Issue 49, defect 2: the two-person rule held only for signed ledgers on read. The issue's
    steps: ana stages, her `approve` is refused, and the same record appended by hand (chain
    recomputed) passed `verify` ("1 approved", exit 0) and was applied by the next resume."""
    cli("overrides", "stage", run_dir, FC1, "--reason", "x")  # as ana ($FP8OPS_USER)
    fc1 = staged_id(run_dir)
    assert cli("overrides", "approve", run_dir, fc1).code == 2  # the writer refuses
    append_by_hand(run_dir, {"kind": "approved", "override": fc1, "who": "ana", "note": None})
    _refused_on_read(
        cli,
        run_dir,
        f"{run_dir}/overrides.jsonl, line 2: the approved record by ana",
        "cannot approve it too",
        "restore it from a copy",
    )
    # Nothing appends to it either, and a resume's read refuses it (tests/test_ledger.py).
    result = cli("overrides", "reject", run_dir, fc1, "--reason", "r", "--user", "ben")
    assert result.code == 2 and "line 2" in result.err


def test_a_policy_approval_written_by_hand_is_refused_on_an_unsigned_ledger(cli, run_dir):
    """No person's signature is asked of a policy's approval; on an unsigned ledger it must still
    name a policy of the run's manifest chain that could have written it (this run has none)."""
    from fp8ops.overrides.ledger import policy_approver

    proposal = forged_proposal(run_dir)
    policy = json.loads((run_dir / "status.json").read_text())["manifest"]
    append_by_hand(
        run_dir,
        {
            "kind": "approved",
            "override": proposal["hash"],
            "who": policy_approver(policy),
            "note": None,
            "policy": policy,
        },
    )
    _refused_on_read(cli, run_dir, "line 2: the approved record by auto-degrade policy")
    assert "no revision of this run's manifest chain with alerts.auto_degrade" in (
        cli("overrides", "verify", run_dir).err
    )


def test_a_proposal_written_by_hand_as_a_person_is_refused_on_an_unsigned_ledger(cli, run_dir):
    """Only the alert engine proposes: a ``proposed`` record in a person's name (which anyone
    may approve, unlike a staging) is refused on read, as `propose` under that name is."""
    forged_proposal(run_dir, who="ana")
    _refused_on_read(cli, run_dir, "line 1: the proposed record by ana", "only the alert engine")


def test_a_tightened_review_rule_holds_against_a_record_written_by_hand(
    cli, admitted, tmp_path, monkeypatch
):
    """A self-approval the run allowed when it was written (and a checkpoint anchored) still
    reads; after the rule is tightened, the command refuses a new one, and so does a read of
    the same record written by hand (it held only for signed ledgers, or any revision)."""
    monkeypatch.setenv("FP8OPS_USER", "ana")
    run = make_run_dir(tmp_path / "run", admitted, allow_self_approval=True)
    cli("overrides", "stage", run, FC1, "--reason", "x")
    assert cli("overrides", "approve", run, staged_id(run)).code == 0  # allowed then
    checkpoint_record(run, Ledger(run).anchor())
    tight = load_manifest(run / "manifest.yaml")
    lock_to(run, derive(tight, {"review.allow_self_approval": False}, "two people now"))
    assert cli("overrides", "verify", run).code == 0  # the anchored self-approval stands
    cli("overrides", "stage", run, QKV, "--reason", "y")
    qkv = staged_id(run, QKV)
    refused = cli("overrides", "approve", run, qkv)
    assert refused.code == 2 and "cannot approve it too" in refused.err
    append_by_hand(run, {"kind": "approved", "override": qkv, "who": "ana", "note": None})
    _refused_on_read(cli, run, "line 4: the approved record by ana", "cannot approve it too")


def test_a_revision_slipped_into_a_checkpoints_chain_is_refused(cli, run_dir):
    """The ledger's rules are read from the newest checkpoint's revision chain: a revision that
    allows self-approval, stored in manifests/ and its name added to that chain, would let a
    self-approval written by hand pass. The chain must be the checkpoint's own."""
    from fp8ops.checkpoint.meta import META_FILE

    cli("overrides", "stage", run_dir, FC1, "--reason", "x")
    checkpoint = checkpoint_record(run_dir, Ledger(run_dir).anchor())
    locked = load_manifest(run_dir / "manifest.yaml")
    loose = derive(locked, {"review.allow_self_approval": True}, "forged")
    ManifestStore(run_dir / "manifests").put(loose)
    append_by_hand(
        run_dir, {"kind": "approved", "override": staged_id(run_dir), "who": "ana", "note": None}
    )
    record = json.loads((checkpoint / META_FILE).read_text())
    for chain in ([manifest_hash(loose), record["manifest"]], [*record["revisions"], "0" * 64]):
        (checkpoint / META_FILE).write_text(json.dumps({**record, "revisions": chain}))
        _refused_on_read(cli, run_dir, "its revision chain", "the checkpoint disagrees with itself")


def test_escape_sequences_in_a_name_or_reason_are_refused_written_or_by_hand(cli, run_dir):
    """A reason (or name) carrying terminal escapes cleared a reviewer's screen in `overrides
    list` and painted "approved by security team" over it; a newline added a row of its own.
    The commands refuse it, and a record written by hand with one is refused on read."""
    paint = "x\x1b[2J\x1b[1;1Happroved by security team"
    result = cli("overrides", "stage", run_dir, FC1, "--reason", paint)
    assert result.code == 2 and "a reason holds a control character (U+001B" in result.err
    result = cli("overrides", "stage", run_dir, FC1, "--reason", "x", "--user", "ana\u202e")
    assert result.code == 2 and "U+202E" in result.err  # a right-to-left override
    assert not (run_dir / "overrides.jsonl").exists() or Ledger(run_dir).records() == []
    forged_proposal(run_dir)
    staged = {"kind": "staged", "module": QKV, "dtype": "bf16", "who": "ana", "triggers": []}
    append_by_hand(run_dir, {**staged, "reason": "a\nb", "step": 1, "data_version": None})
    _refused_on_read(cli, run_dir, "line 2", "its reason holds a control character (U+000A")


def test_a_ledger_replaced_by_a_link_is_neither_read_nor_written_through(cli, run_dir, tmp_path):
    """A link to a file of whoever runs the command (or to another run's ledger): never
    followed, so nothing outside the run is cut or written."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (run_dir / "overrides.jsonl").symlink_to(victim)
    result = cli("overrides", "stage", run_dir, FC1, "--reason", "x")
    assert result.code == 2 and "overrides.jsonl: is a symbolic link" in result.err
    _refused_on_read(cli, run_dir, "overrides.jsonl: is a symbolic link")
    assert victim.read_text() == "keep me"


def test_a_ledger_replaced_by_a_fifo_is_refused_at_once(cli, run_dir):
    """A FIFO: `list` and `verify` waited in open() for a writer, forever."""
    ledger = run_dir / "overrides.jsonl"
    os.mkfifo(ledger)
    failed = without_waiting(
        lambda: _refused_on_read(cli, run_dir, "overrides.jsonl: not a regular file"), ledger
    )
    assert failed is None, failed  # an assertion of _refused_on_read's, raised in the thread
    refused = without_waiting(lambda: Ledger(run_dir).records(), ledger)
    assert type(refused).__name__ == "LedgerError", refused
    assert "overrides.jsonl: not a regular file" in str(refused)


def test_verify_refuses_a_deleted_ledger_that_a_checkpoint_anchored(cli, run_dir):
    """Issue 49, defect 7: `verify` said "no ledger yet" (exit 0) where a resume refused."""
    cli("overrides", "stage", run_dir, FC1, "--reason", "x")
    cli("overrides", "approve", run_dir, staged_id(run_dir), "--user", "ben")
    checkpoint_record(run_dir, Ledger(run_dir).anchor())
    (run_dir / "overrides.jsonl").unlink()
    _refused_on_read(
        cli,
        run_dir,
        "checkpoint step_00000120 saw 2 ledger record(s)",
        "the ledger is gone",
        "Restore it from a copy",
    )
    # Staging does not start a new ledger in its place.
    result = cli("overrides", "stage", run_dir, QKV, "--reason", "x")
    assert result.code == 2 and "the ledger is gone" in result.err
    assert not (run_dir / "overrides.jsonl").exists()


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
