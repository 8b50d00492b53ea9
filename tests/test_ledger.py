"""The override ledger (``overrides.jsonl``) on a real run directory: the state machine, the
review rule, module checks against layers.json, the hash chain under tampering, two processes
appending at once, id prefixes and the Transformer Engine debug-API export.

The run directory's layers.json is decided from the tiny GPT itself (built once per module, in a
few milliseconds after the imports), with one module excluded by glob and one kept in BF16 by a
hand-written manifest override, so every kind of "not FP8" is there to be refused.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import yaml
from support.example_manifests import ROOT
from support.ledger_run import (
    DATA,
    EXCLUDED,
    FC1,
    HAND,
    QKV,
    admit_tiny_gpt,
    append_by_hand,
    forged_proposal,
    make_run_dir,
)

if importlib.util.find_spec("megatron") is None:  # the layer table comes from the real model
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.alerts import Alert
from fp8ops.manifest import derive, load_manifest, manifest_hash
from fp8ops.overrides import Ledger, LedgerError, OverrideError, Trigger, te_debug_yaml
from fp8ops.overrides import ledger as ledger_module
from fp8ops.overrides.chain import GENESIS, canonical_json, record_hash
from fp8ops.overrides.te_debug import layer_regex, te_layer_name

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

REVISION = "e" * 64


@pytest.fixture(scope="module")
def admitted(megatron_tp1):
    """The manifest, recipe and admission table of the tiny GPT, decided once per module."""
    return admit_tiny_gpt()


@pytest.fixture
def run_dir(tmp_path, admitted):
    return make_run_dir(tmp_path / "run", admitted)


def lines(run_dir):
    return (run_dir / "overrides.jsonl").read_text().splitlines()


# -- the state machine ---------------------------------------------------------------------------


def test_stage_then_approve(run_dir):
    ledger = Ledger(run_dir)
    staged = ledger.stage(FC1, "input saturation 3% at step 110", who="ana")
    assert (staged.status, staged.origin, staged.who, staged.module) == (
        "staged",
        "staged",
        "ana",
        FC1,
    )
    assert (staged.step, staged.data_version, staged.dtype) == (120, DATA, "bf16")
    # The latest alert per metric for the module, with what it saw and its threshold.
    (underflow, saturation) = staged.triggers
    assert saturation == Trigger("input.saturation", 0.03, 0.02, "degrade", "saturation", 110)
    assert underflow.metric == "grad_output.underflow" and math.isnan(underflow.value)

    approved = ledger.approve(staged.id[:8], who="ben", note="seen it too")
    assert (approved.id, approved.status, approved.decided_by) == (staged.id, "approved", "ben")
    assert approved.decision_note == "seen it too"
    # (Compared by id: the NaN trigger value makes the overrides unequal to themselves.)
    assert [o.id for o in ledger.pending_for_resume()] == [staged.id]
    assert ledger.active_fallbacks() == []

    records = [json.loads(line) for line in lines(run_dir)]
    assert [r["kind"] for r in records] == ["staged", "approved"]
    assert [r["seq"] for r in records] == [0, 1]
    assert records[0]["prev"] == GENESIS and records[1]["prev"] == records[0]["hash"]
    assert records[0]["hash"] == staged.id and records[1]["override"] == staged.id
    for line, record in zip(lines(run_dir), records):
        assert line == canonical_json(record)  # keys sorted, compact
        assert record["hash"] == record_hash(record)
        assert record["time"].endswith("+00:00")
    # What a resume writes into the next manifest revision: the approving record's hash.
    entry = approved.as_manifest_override()
    assert (entry.module, entry.reason, entry.approval) == (FC1, staged.reason, records[1]["hash"])


def test_an_override_of_some_gemms_is_recorded_and_applied_as_such(run_dir):
    ledger = Ledger(run_dir)
    staged = ledger.stage(FC1, "gradients saturate", who="ana", gemms=["wgrad", "dgrad"])
    assert staged.gemms == ("dgrad", "wgrad") and staged.target == "bf16 (dgrad, wgrad)"
    (record,) = [json.loads(line) for line in lines(run_dir)]
    assert record["gemms"] == ["dgrad", "wgrad"]  # in one order, whatever order was given
    approved = ledger.approve(staged.id, who="ben")
    entry = approved.as_manifest_override()
    assert (entry.module, entry.gemms, entry.approval) == (
        FC1,
        ("dgrad", "wgrad"),
        approved.approval,
    )
    assert Ledger(run_dir).get(staged.id).gemms == ("dgrad", "wgrad")  # read back from the file
    # All three named: the whole module, recorded as every override was before per-GEMM ones.
    whole = ledger.stage(QKV, "x", who="ana", gemms=["fprop", "dgrad", "wgrad"])
    assert whole.gemms is None and "gemms" not in json.loads(lines(run_dir)[-1])
    assert whole.as_manifest_override().gemms is None


@pytest.mark.parametrize(
    "gemms, to, words",
    [
        (["wgard"], "bf16", "gemms: 'wgard' is not a GEMM"),
        ([], "bf16", "gemms: empty"),
        (["wgrad", "wgrad"], "bf16", "gemms: 'wgrad' is listed twice"),
        (["wgrad"], "current", "gemms: takes some GEMMs to bf16"),
    ],
)
def test_bad_gemms_are_refused_and_nothing_is_written(run_dir, gemms, to, words):
    with pytest.raises(OverrideError, match=words):
        Ledger(run_dir).stage(FC1, "x", who="ana", gemms=gemms, to=to)
    with pytest.raises(OverrideError, match="output_layer already runs in bf16, not FP8"):
        Ledger(run_dir).stage("output_layer", "x", who="ana", gemms=["wgrad"])
    assert Ledger(run_dir).records() == []  # nothing written


def test_a_record_without_gemms_is_all_three_and_a_bad_one_written_by_hand_is_refused(run_dir):
    forged_proposal(run_dir)  # as every record before per-GEMM overrides: no gemms key
    (o,) = Ledger(run_dir).overrides().values()
    assert o.gemms is None and o.target == "bf16"
    assert o.as_manifest_override().gemms is None
    body = {
        "kind": "staged",
        "module": QKV,
        "dtype": "bf16",
        "reason": "r",
        "who": "ana",
        "triggers": [],
        "step": 1,
        "data_version": DATA,
    }
    for gemms, words in (
        (["wgrad", "dgrad"], "its gemms are not in the order fprop, dgrad, wgrad"),
        (["fprop", "fprop"], "its gemms: 'fprop' is listed twice"),
        ("wgrad", "its gemms is not a list of GEMM names"),
    ):
        saved = (run_dir / "overrides.jsonl").read_text()
        append_by_hand(run_dir, {**body, "gemms": gemms})
        with pytest.raises(LedgerError, match=f"line 2: .*{re.escape(words)}"):
            Ledger(run_dir).verify()
        (run_dir / "overrides.jsonl").write_text(saved)


def test_self_approval_is_refused_unless_the_manifest_allows_it(run_dir, tmp_path, admitted):
    ledger = Ledger(run_dir)
    o = ledger.stage(FC1, "saturation", who="ana")
    with pytest.raises(OverrideError, match="ana staged override .* cannot approve it too"):
        ledger.approve(o.id, who="ana")
    with pytest.raises(OverrideError, match="cannot approve it too"):
        ledger.approve(o.id, who=" Ana")  # one operator, however typed
    # The alert engine's name is not a way around the rule: its proposals need no second person.
    with pytest.raises(OverrideError, match="'fp8ops-alerts' is the alert engine's name"):
        ledger.stage(QKV, "saturation", who="fp8ops-alerts")
    assert len(lines(run_dir)) == 1  # nothing written

    solo = Ledger(make_run_dir(tmp_path / "solo", admitted, allow_self_approval=True))
    o = solo.stage(FC1, "saturation", who="ana")
    assert solo.approve(o.id, who="ana").status == "approved"


def test_self_approval_does_not_follow_an_edited_manifest_file(run_dir):
    """Review rules come from the revision the run is locked to, not from whatever
    manifest.yaml says now."""
    file = run_dir / "manifest.yaml"
    locked = file.read_text()
    ledger = Ledger(run_dir)
    o = ledger.stage(FC1, "saturation", who="ana")
    file.write_text(locked.replace("allow_self_approval: false", "allow_self_approval: true"))
    with pytest.raises(
        OverrideError,
        match=r"manifest.yaml hashes to .* the run is locked to .* "
        r"edited after the run wrote it.*restore the file: cp ",
    ):
        ledger.approve(o.id, who="ana")
    assert len(lines(run_dir)) == 1  # nothing written
    file.write_text(locked)
    with pytest.raises(OverrideError, match="cannot approve it too"):
        ledger.approve(o.id, who="ana")


def test_an_alert_engine_proposal_is_approved_by_a_person(run_dir):
    ledger = Ledger(run_dir)
    alert = Alert(130, "degrade", "underflow", QKV, "grad_output.underflow", math.inf, 0.1, "")
    proposed = ledger.propose(QKV, "grad_output.underflow > 0.1", [alert], step=130)
    assert (proposed.status, proposed.who, proposed.step) == ("proposed", "fp8ops-alerts", 130)
    assert proposed.triggers[0].value == math.inf  # written as "inf", read back as a float
    # The engine alerting again on the same module: nothing written, training goes on.
    assert ledger.propose(QKV, "again", [alert], step=131) is None
    assert len(lines(run_dir)) == 1

    assert ledger.approve(proposed.id, who="ana").decided_by == "ana"
    with pytest.raises(OverrideError, match="unknown|not a module"):
        ledger.propose("decoder.layers.9.mlp.linear_fc1", "x", [], step=1)


def test_a_rejection_is_final(run_dir):
    ledger = Ledger(run_dir)
    o = ledger.stage(FC1, "saturation", who="ana")
    rejected = ledger.reject(o.id, "transient; it settled by step 130", who="ben")
    assert (rejected.status, rejected.decided_by) == ("rejected", "ben")
    assert rejected.decision_note == "transient; it settled by step 130"
    for action in (lambda: ledger.approve(o.id, who="cy"), lambda: ledger.revoke(o.id, "x")):
        with pytest.raises(OverrideError, match="rejected override is final; stage a new one"):
            action()
    # No longer open: the module may be staged again, under a new id.
    assert ledger.stage(FC1, "saturation again", who="ana").id != o.id


def test_revoking_an_approved_and_an_applied_override(run_dir):
    ledger = Ledger(run_dir)
    a = ledger.stage(FC1, "saturation", who="ana")
    b = ledger.stage(QKV, "underflow", who="ana")
    ledger.approve(a.id, who="ben")
    ledger.approve(b.id, who="ben")

    # Revoked before any resume applied it: nothing to undo.
    revoked = ledger.revoke(a.id, "the fix is a margin change instead", who="ana")
    assert (revoked.status, revoked.to_lift) == ("revoked", False)
    assert [o.id for o in ledger.pending_for_resume()] == [b.id]

    (applied,) = ledger.record_applied([b.id[:10]], step=150, revision=REVISION, who="resume")
    assert (applied.status, applied.applied_step, applied.applied_revision) == (
        "applied",
        150,
        REVISION,
    )
    assert ledger.active_fallbacks() == [applied] and ledger.pending_for_resume() == []

    # Revoking an applied one: the next resume lifts the fallback (the module returns to FP8).
    lifted = ledger.revoke(b.id, "underflow fixed upstream", who="ben")
    assert lifted.to_lift and ledger.active_fallbacks() == []
    assert ledger.pending_for_resume() == [lifted]
    (done,) = ledger.record_applied([b.id], step=200, revision="f" * 64)
    assert (done.lifted_step, done.to_lift, ledger.pending_for_resume()) == (200, False, [])
    with pytest.raises(OverrideError, match="cannot apply"):
        ledger.record_applied([a.id], step=201, revision="f" * 64)


def _resume_ledger(run_dir, manifest, accepted=None):
    """What a resume from a checkpoint saved under ``manifest`` makes of the ledger: the plan's
    manifest, with the overrides it applies and lifts (``plan_resume``'s last step).
    ``accepted``: a revision of ``manifest`` the resume accepts as drift."""
    from fp8ops.start.drift import Drift
    from fp8ops.start.plan import Resume, _apply_ledger

    saved = manifest_hash(manifest)
    plan = Resume(
        run_dir,
        run_dir / "checkpoints" / "step_00000120",
        # The checkpoint's record: what is read here.
        SimpleNamespace(step=120, ledger=None, manifest=saved, revisions=[saved]),
        manifest,
        manifest if accepted is None else accepted,
        [] if accepted is None else [accepted],
        Drift(),
        None,
    )
    _apply_ledger(plan)
    return plan


def test_an_override_approved_again_before_the_revoke_was_lifted_is_applied(run_dir):
    """Applied, revoked, then another one approved for the module before a resume lifted the
    first: the module stays in BF16 under the new approval, and both reach the records."""
    ledger = Ledger(run_dir)
    first = ledger.approve(ledger.stage(FC1, "saturation", who="ana").id, who="ben")
    plan = _resume_ledger(run_dir, load_manifest(run_dir / "manifest.yaml"))
    ledger.record_applied([first.id], step=121, revision=manifest_hash(plan.manifest))
    ledger.revoke(first.id, "try FP8 again", who="ana")
    second = ledger.approve(ledger.stage(FC1, "still saturating", who="ana").id, who="ben")

    again = _resume_ledger(run_dir, plan.manifest)
    (override,) = [o for o in again.manifest.precision.overrides if o.module == FC1]
    assert (override.approval, override.reason) == (second.approval, "still saturating")
    assert [o.id for o in again.applied_overrides] == [second.id]
    assert [o.id for o in again.lifted_overrides] == [first.id]
    assert f"{FC1} stays bf16 under {second.id[:12]}" in again.manifest.revision.reason
    ledger.record_applied([second.id, first.id], step=131, revision="f" * 64)
    assert ledger.pending_for_resume() == []
    assert _resume_ledger(run_dir, again.manifest).new_revisions == []  # settled


def test_a_deleted_ledger_refuses_a_resume_whose_manifest_names_its_approvals(run_dir):
    ledger = Ledger(run_dir)
    ledger.approve(ledger.stage(FC1, "saturation", who="ana").id, who="ben")
    applied = _resume_ledger(run_dir, load_manifest(run_dir / "manifest.yaml")).manifest
    ledger.path.unlink()
    with pytest.raises(
        LedgerError,
        match=f"runs {FC1} in BF16 under approval .* the ledger is gone. Restore the file",
    ):
        _resume_ledger(run_dir, applied)
    assert _resume_ledger(run_dir, load_manifest(run_dir / "manifest.yaml")).new_revisions == []


def _self_approval(run_dir):
    staged = Ledger(run_dir).stage(FC1, "saturation", who="ana")
    append_by_hand(run_dir, {"kind": "approved", "override": staged.id, "who": "ana", "note": None})


def _policy_approval(run_dir):
    from fp8ops.overrides.ledger import policy_approver

    proposal = forged_proposal(run_dir)
    policy = manifest_hash(load_manifest(run_dir / "manifest.yaml"))  # it has no auto_degrade
    approval = {"who": policy_approver(policy), "note": None, "policy": policy}
    append_by_hand(run_dir, {"kind": "approved", "override": proposal["hash"], **approval})


def _persons_proposal(run_dir):
    proposal = forged_proposal(run_dir, who="ana")
    append_by_hand(
        run_dir, {"kind": "approved", "override": proposal["hash"], "who": "ben", "note": None}
    )


@pytest.mark.parametrize(
    "forge, words",
    [
        (_self_approval, "line 2: .*cannot approve it too"),
        (_policy_approval, "line 2: .*no revision of this run's manifest chain"),
        (_persons_proposal, "line 1: .*only the alert engine proposes"),
    ],
)
def test_a_resume_refuses_records_written_by_hand_that_the_commands_refuse(run_dir, forge, words):
    """An unsigned ledger's rules hold for the resume as for `overrides verify` (one reader):
    what no command would write is refused, not applied."""
    forge(run_dir)
    with pytest.raises(LedgerError, match=words):
        _resume_ledger(run_dir, load_manifest(run_dir / "manifest.yaml"))


def test_a_resume_reads_the_ledger_under_the_drift_it_accepts(run_dir):
    """A revision that loosens the review rules holds when a resume accepts it (the operator's
    --accept-drift), not when it is merely written into the run directory."""
    _self_approval(run_dir)
    saved = load_manifest(run_dir / "manifest.yaml")
    solo = derive(saved, {"review.allow_self_approval": True}, "resume accepted drift: solo")
    with pytest.raises(LedgerError, match="cannot approve it too"):
        _resume_ledger(run_dir, saved)
    plan = _resume_ledger(run_dir, saved, accepted=solo)
    assert [o.module for o in plan.applied_overrides] == [FC1]
    assert plan.manifest.revision.parent == manifest_hash(solo)  # the overrides' revision


def test_the_console_row_shows_a_pending_lift_over_a_later_rejected_override(run_dir):
    from fp8ops.console.ledger_state import module_states

    ledger = Ledger(run_dir)
    first = ledger.approve(ledger.stage(FC1, "saturation", who="ana").id, who="ben")
    ledger.record_applied([first.id], step=121, revision=REVISION)
    ledger.revoke(first.id, "try FP8 again", who="ana")
    ledger.reject(ledger.stage(FC1, "again?", who="ana").id, "no: wait for the lift", who="ben")
    (row,) = [state for state in module_states(run_dir) if state.module == FC1]
    assert row.override.id == first.id
    assert row.ledger_status == "applied, revoked: lifted at the next resume"


# -- which modules ----------------------------------------------------------------------------------


def test_an_unknown_module_is_refused_with_a_suggestion(run_dir):
    with pytest.raises(OverrideError) as info:
        Ledger(run_dir).stage("decoder.layer.0.mlp.linear_fc1", "x", who="ana")
    assert "'decoder.layer.0.mlp.linear_fc1' is not a module of this run" in str(info.value)
    assert f"did you mean '{FC1}'" in str(info.value)  # the closest first


@pytest.mark.parametrize(
    "module, why",
    [
        ("output_layer", "lm_head: the LM head is never FP8"),
        ("embedding.word_embeddings", "embedding: the word embedding is never FP8"),
        (EXCLUDED, "excluded: excluded by precision.exclude_modules[0]"),
        (HAND, "override: BF16 override (written in the manifest): kept in BF16 by hand"),
    ],
)
def test_a_module_not_running_fp8_is_refused_with_its_reason(run_dir, module, why):
    with pytest.raises(OverrideError) as info:
        Ledger(run_dir).stage(module, "x", who="ana")
    assert f"{module} already runs in bf16, not FP8 ({why}" in str(info.value)
    assert not (run_dir / "overrides.jsonl").read_text()


def test_a_module_has_at_most_one_open_override(run_dir):
    ledger = Ledger(run_dir)
    first = ledger.stage(FC1, "saturation", who="ana")
    with pytest.raises(OverrideError, match=f"already has an open override: {first.id[:12]}"):
        ledger.stage(FC1, "again", who="ben")
    # Several modules at once: all or none.
    with pytest.raises(OverrideError, match="already has an open override"):
        ledger.stage_many([QKV, FC1], "both", who="ben")
    with pytest.raises(OverrideError, match=f"{QKV} is named more than once"):
        ledger.stage_many([QKV, QKV], "twice", who="ben")  # not an override never written
    assert len(lines(run_dir)) == 1


# -- the hash chain ----------------------------------------------------------------------------------


def _edit(text):
    rows = text.splitlines(keepends=True)
    rows[2] = rows[2].replace('"who":"ben"', '"who":"eve"')  # the approver's name
    return "".join(rows)


def _delete(text):
    rows = text.splitlines(keepends=True)
    return "".join(rows[:2] + rows[3:])


def _reorder(text):
    rows = text.splitlines(keepends=True)
    return "".join(rows[:1] + [rows[2], rows[1]] + rows[3:])


def _tear(text):
    return text[: len(text) - 25]


@pytest.mark.parametrize(
    "tamper, message",
    [
        (_edit, "line 3: the record's hash does not match its content: line 3 was edited"),
        (_delete, "line 3: the hash chain is broken (seq 3 where 2 belongs): a record before"),
        (_reorder, "line 2: the hash chain is broken (seq 2 where 1 belongs)"),
        (_tear, "line 4: incomplete last line (no newline at its end): a write was interrupted"),
    ],
)
def test_tampering_is_detected_at_its_line_and_blocks_appends(run_dir, tamper, message):
    ledger = Ledger(run_dir)
    a = ledger.stage(FC1, "saturation", who="ana")
    ledger.stage(QKV, "underflow", who="ana")
    ledger.approve(a.id, who="ben")
    ledger.stage(HAND.replace("3", "2"), "noise", who="cy")
    path = run_dir / "overrides.jsonl"
    path.write_text(tamper(path.read_text()))
    damaged = path.read_bytes()

    with pytest.raises(LedgerError) as info:
        ledger.verify()
    assert str(info.value).startswith(f"{path}, line ")
    assert message in str(info.value)
    for action in (
        lambda: ledger.stage("decoder.layers.2.mlp.linear_fc2", "more", who="cy"),
        lambda: ledger.revoke(a.id, "undo", who="ana"),
        ledger.overrides,
    ):
        with pytest.raises(LedgerError, match=re.escape(message[:30])):
            action()
    assert path.read_bytes() == damaged  # never appended to


def test_a_rehashed_edit_breaks_the_next_link(run_dir):
    """An editor who also recomputes the edited line's hash breaks the next line's ``prev``."""
    ledger = Ledger(run_dir)
    a = ledger.stage(FC1, "saturation", who="ana")
    ledger.approve(a.id, who="ben")
    path = run_dir / "overrides.jsonl"
    first, second = (json.loads(line) for line in lines(run_dir))
    first["reason"] = "something else"
    first["hash"] = record_hash(first)
    path.write_text(canonical_json(first) + "\n" + canonical_json(second) + "\n")
    with pytest.raises(
        LedgerError, match="line 2: the hash chain is broken .* line 1 was rewritten"
    ):
        ledger.verify()


WORKER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from fp8ops.overrides import Ledger
    run_dir, who, go, *modules = sys.argv[1:]
    ledger = Ledger(run_dir)
    Path(f"{go}.{who}").touch()  # imported and ready
    while not Path(go).exists():  # start together
        time.sleep(0.001)
    for i in range(20):  # 40 records: stage, then revoke, so the module is free again
        o = ledger.stage(modules[i % len(modules)], f"{who} {i}", who=who, triggers=[])
        ledger.revoke(o.id, f"{who} {i} done", who=who)
""")


@pytest.mark.slow
def test_two_processes_appending_at_once_lose_nothing(run_dir, admitted, tmp_path):
    fp8 = admitted[2].fp8_fqns
    go = tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(run_dir), who, str(go), *modules],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who, modules in (("p0", fp8[0::2]), ("p1", fp8[1::2]))
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"go.{who}").exists() for who in ("p0", "p1")):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers)
        time.sleep(0.01)
    go.touch()
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err

    ledger = Ledger(run_dir)
    assert ledger.verify() == 80
    records = ledger.records()
    assert [r["seq"] for r in records] == list(range(80))
    for who in ("p0", "p1"):
        mine = [r for r in records if r["who"] == who]
        assert [r["kind"] for r in mine] == ["staged", "revoked"] * 20
        assert [r.get("reason") for r in mine[::2]] == [f"{who} {i}" for i in range(20)]
    assert {o.status for o in ledger.overrides().values()} == {"revoked"}


# -- ids ----------------------------------------------------------------------------------------------


def test_ids_are_resolved_from_unique_prefixes(run_dir, admitted, monkeypatch):
    ledger = Ledger(run_dir)
    staged = [ledger.stage(module, "x", who="ana", triggers=[]) for module in admitted[2].fp8_fqns]
    target = staged[0]
    assert ledger.get(target.id[:6].upper()) == target
    for ref, message in [
        (target.id[:5], "is not an override id: give its sha256 or a unique prefix of at least 6"),
        ("zzzzzzzz", "is not an override id"),
        (
            "0123456789"
            if not any(o.id.startswith("0123456789") for o in staged)
            else "abcdef1234",
            "has an id starting with",
        ),
    ]:
        with pytest.raises(OverrideError, match=message):
            ledger.approve(ref, who="ben")
    # Ambiguity needs two ids sharing a prefix: among 14 ids, some share their first digit.
    monkeypatch.setattr(ledger_module, "MIN_PREFIX", 1)
    digit = next(d for d in "0123456789abcdef" if sum(o.id[0] == d for o in staged) > 1)
    with pytest.raises(OverrideError, match=f"{digit} is ambiguous: .* override ids start"):
        ledger.get(digit)


def test_a_missing_run_directory_and_an_empty_ledger(tmp_path, run_dir):
    with pytest.raises(OverrideError, match="no such run directory"):
        Ledger(tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    with pytest.raises(OverrideError, match="not an fp8ops run directory"):
        Ledger(tmp_path / "other")
    assert not list((tmp_path / "other").iterdir())  # nothing left behind
    ledger = Ledger(run_dir)
    assert (ledger.records(), ledger.verify(), ledger.overrides()) == ([], 0, {})
    assert not ledger.path.exists()  # reading creates nothing


# -- the Transformer Engine export ---------------------------------------------------------------


def test_te_debug_yaml_disables_fp8_in_exactly_the_overridden_layers(run_dir, admitted):
    ledger = Ledger(run_dir)
    with pytest.raises(OverrideError, match="nothing to export"):
        te_debug_yaml(ledger)
    applied, approved, _staged, revoked = (
        ledger.stage(m, "x", who="ana", triggers=[])
        for m in (FC1, QKV, "decoder.layers.2.mlp.linear_fc2", "decoder.layers.0.mlp.linear_fc2")
    )
    # approved, but to current scaling: the module stays FP8, so TE's switch leaves it alone
    current = ledger.stage("decoder.layers.1.mlp.linear_fc2", "x", who="ana", to="current")
    for o in (applied, approved, revoked, current):
        ledger.approve(o.id, who="ben")
    ledger.record_applied([applied.id], step=150, revision=REVISION)
    ledger.revoke(revoked.id, "not needed", who="ana")

    config = yaml.safe_load(te_debug_yaml(ledger))
    section = config["fp8ops_bf16_overrides"]
    assert section["enabled"] is True
    assert section["transformer_engine"] == {"DisableQuantizationLayer": {"enabled": True}}
    pattern = re.compile(section["layers"]["layer_name_regex_pattern"])
    every_name = [row.fqn for row in admitted[2].rows]
    assert [n for n in every_name if pattern.search(n)] == [FC1, QKV]
    # Anchored and escaped: no longer, shorter or dot-wildcard look-alikes.
    for near in (FC1 + "0", "x" + FC1, FC1.replace(".", "_"), "model." + FC1):
        assert not pattern.search(near)

    inferred = yaml.safe_load(te_debug_yaml(ledger, naming="inferred"))
    pattern = re.compile(inferred["fp8ops_bf16_overrides"]["layers"]["layer_name_regex_pattern"])
    assert pattern.search("model.decoder.layers.1.mlp.linear_fc1")  # layer_number is 1-based
    assert pattern.search("model.decoder.layers.2.self_attention.linear_qkv")
    assert not pattern.search(FC1) and not pattern.search("model." + FC1)


def test_te_debug_yaml_disables_quantization_of_the_overridden_gemms(run_dir, admitted):
    """TE's config gives a layer one section and a section one feature: whole modules in
    DisableQuantizationLayer, each set of GEMMs in a DisableQuantizationGEMM section of its
    own."""
    ledger = Ledger(run_dir)
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    for module, gemms in ((FC1, None), (QKV, ["wgrad", "dgrad"]), (fc2, ["dgrad", "wgrad"])):
        ledger.approve(ledger.stage(module, "x", who="ana", triggers=[], gemms=gemms).id, who="ben")
    ledger.approve(
        ledger.stage("decoder.layers.2.mlp.linear_fc2", "x", who="ana", gemms=["fprop"]).id,
        who="ben",
    )
    text = te_debug_yaml(ledger)
    config = yaml.safe_load(text)
    assert list(config) == [
        "fp8ops_bf16_overrides",
        "fp8ops_bf16_overrides_dgrad_wgrad",
        "fp8ops_bf16_overrides_fprop",
    ]
    every_name = [row.fqn for row in admitted[2].rows]

    def layers(section):
        pattern = re.compile(config[section]["layers"]["layer_name_regex_pattern"])
        return [n for n in every_name if pattern.search(n)]

    assert layers("fp8ops_bf16_overrides") == [FC1]
    assert config["fp8ops_bf16_overrides"]["transformer_engine"] == {
        "DisableQuantizationLayer": {"enabled": True}
    }
    assert layers("fp8ops_bf16_overrides_dgrad_wgrad") == [QKV, fc2]
    assert config["fp8ops_bf16_overrides_dgrad_wgrad"]["transformer_engine"] == {
        "DisableQuantizationGEMM": {"enabled": True, "gemms": ["dgrad", "wgrad"]}
    }
    assert config["fp8ops_bf16_overrides_fprop"]["transformer_engine"] == {
        "DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop"]}
    }
    assert "# dgrad, wgrad of these layers run in high precision:" in text


def test_te_layer_names():
    assert te_layer_name(FC1) == FC1
    assert te_layer_name("decoder.layers.11.mlp.linear_fc2", "inferred") == (
        "model.decoder.layers.12.mlp.linear_fc2"
    )
    assert te_layer_name("output_layer", "inferred") == "model.output_layer"
    assert layer_regex(["b.c", "a.b", "a.b"]) == r"^(?:a\.b|b\.c)$"
