"""Signed ledger records: operators sign with their SSH key (``ssh-keygen -Y sign``), the
manifest's allowed-signers file says whose key is whose, and the review rule compares verified
signers. Throwaway ed25519 keys are made per test module; ssh-keygen's own ``-Y verify`` is the
oracle that the signatures are the ones git-style tooling accepts."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import time

import pytest
from support.example_manifests import TINY
from support.ledger_run import (
    FC1,
    QKV,
    admit_tiny_gpt,
    append_by_hand,
    checkpoint_record,
    lock_to,
    make_run_dir,
)

if importlib.util.find_spec("megatron") is None:  # the layer table comes from the real model
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)
if shutil.which("ssh-keygen") is None:
    pytest.skip("needs ssh-keygen (apt install openssh-client)", allow_module_level=True)

from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.manifest import derive
from fp8ops.overrides import Ledger, LedgerError, OverrideError
from fp8ops.overrides.chain import GENESIS, canonical_json, record_hash
from fp8ops.overrides.signing import NAMESPACE, signed_body

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def admitted(megatron_tp1):
    return admit_tiny_gpt()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Private keys of ana and ben (allowed signers), eve (not listed) and carl (listed for git
    only), and the allowed-signers file."""
    home = tmp_path_factory.mktemp("keys")
    paths = {}
    for name in ("ana", "ben", "eve", "carl"):
        paths[name] = home / name
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(paths[name])],
            check=True,
        )
    public = {name: (home / f"{name}.pub").read_text().strip() for name in paths}
    allowed = home / "allowed_signers"
    allowed.write_text(
        "# operators of this run\n"
        f'ana namespaces="{NAMESPACE}" {public["ana"]}\n'
        f'ben namespaces="{NAMESPACE}" {public["ben"]}\n'
        f'carl namespaces="git" {public["carl"]}\n'
    )
    return paths, allowed


def _review(allowed, required=True):
    return {
        "allowed_signers": str(allowed),
        "allowed_signers_sha256": hashlib.sha256(allowed.read_bytes()).hexdigest(),
        "require_signatures": required,
    }


@pytest.fixture
def signed_run(tmp_path, admitted, keys):
    return make_run_dir(tmp_path / "run", admitted, review=_review(keys[1]))


def _lines(run):
    return (run / "overrides.jsonl").read_text().splitlines()


def test_signed_records_verify_here_and_with_ssh_keygen(signed_run, keys, tmp_path):
    paths, allowed = keys
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    Ledger(signed_run, key=paths["ben"]).approve(staged.id[:12], who="ben")
    ledger = Ledger(signed_run)
    assert ledger.verify() == 2 and ledger.unverified() == []
    assert ledger.get(staged.id[:12]).status == "approved"
    # The oracle: OpenSSH's own verification of each record's signed body.
    for record, who in zip(ledger.records(), ("ana", "ben"), strict=True):
        sig = tmp_path / f"{who}.sig"
        sig.write_text(record["signature"])
        done = subprocess.run(
            ["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", who, "-n", NAMESPACE]
            + ["-s", str(sig)],
            input=signed_body(record),
            capture_output=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr


def test_a_signed_override_of_some_gemms_verifies(signed_run, keys):
    """The signature covers the record's gemms like the rest of its body."""
    paths, _ = keys
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "s", who="ana", gemms=["wgrad"])
    Ledger(signed_run, key=paths["ben"]).approve(staged.id[:12], who="ben")
    ledger = Ledger(signed_run)
    assert ledger.verify() == 2 and ledger.unverified() == []
    assert ledger.get(staged.id).gemms == ("wgrad",)
    first = json.loads(_lines(signed_run)[0])
    assert first["gemms"] == ["wgrad"] and b'"gemms":["wgrad"]' in signed_body(first)


@pytest.mark.parametrize(
    "signer, words",
    [
        ("ana", "written as 'ben' but signed by the key of ana"),  # another operator's key
        (None, "not signed"),
        ("eve", "not an allowed signer"),
        ("carl", "not an allowed signer"),  # carl's key is listed for git, not for fp8ops
    ],
)
def test_an_approval_not_signed_by_its_author_is_refused_and_nothing_is_written(
    signed_run, keys, monkeypatch, signer, words
):
    paths, _ = keys
    monkeypatch.delenv("FP8OPS_SIGNING_KEY", raising=False)
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    key = None if signer is None else paths[signer]
    with pytest.raises(OverrideError, match="refused: the approved record by ben") as refused:
        Ledger(signed_run, key=key).approve(staged.id[:12], who="ben")
    assert words in str(refused.value) and "review.require_signatures" in str(refused.value)
    assert len(_lines(signed_run)) == 1
    assert Ledger(signed_run).get(staged.id[:12]).status == "staged"


def test_the_review_rule_compares_verified_signers(signed_run, keys):
    paths, _ = keys
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    with pytest.raises(OverrideError, match="cannot approve it too"):
        Ledger(signed_run, key=paths["ana"]).approve(staged.id[:12], who="ana")
    # Typing another name does not help: the key says who signed.
    with pytest.raises(OverrideError, match="signed by the key of ana"):
        Ledger(signed_run, key=paths["ana"]).approve(staged.id[:12], who="Ben")


def _rechain(records):
    """Records re-linked and re-hashed from the first, as a forger who rewrites the file does."""
    prev, out, renamed = GENESIS, [], {}
    for seq, record in enumerate(records):
        record = {**record, "seq": seq, "prev": prev}
        if record.get("override") in renamed:  # a decision follows its override's new id
            record["override"] = renamed[record["override"]]
        old, record["hash"] = record.get("hash"), record_hash(record)
        renamed[old] = prev = record["hash"]
        out.append(record)
    return out


def _write(run, records):
    (run / "overrides.jsonl").write_text("".join(canonical_json(r) + "\n" for r in records))


def test_a_signature_moved_onto_another_record_is_refused_naming_its_line(signed_run, keys):
    paths, _ = keys
    ana = Ledger(signed_run, key=paths["ana"])
    first = ana.stage(FC1, "saturation", who="ana")
    ana.stage(QKV, "saturation", who="ana")
    Ledger(signed_run, key=paths["ben"]).approve(first.id[:12], who="ben")
    records = Ledger(signed_run).records()
    # The forger wants QKV approved: ben's approval of FC1 is re-aimed at QKV, its signature
    # kept, and the chain re-hashed so that it holds together.
    forged = [*records[:2], {**records[2], "override": records[1]["hash"]}]
    _write(signed_run, _rechain(forged))
    with pytest.raises(LedgerError, match=r"line 3: the approved record by ben .*does not verify"):
        Ledger(signed_run).overrides()
    with pytest.raises(LedgerError, match="line 3"):  # nothing appends to it either
        Ledger(signed_run, key=paths["ana"]).revoke(first.id[:12], "x", who="ana")


def test_without_required_signatures_an_unsigned_record_is_written_and_flagged(
    tmp_path, admitted, keys, cli
):
    paths, allowed = keys
    run = make_run_dir(tmp_path / "run", admitted, review=_review(allowed, required=False))
    staged = Ledger(run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    Ledger(run, key=None).approve(staged.id[:12], who="ben")  # unsigned: typed name only
    (flag,) = Ledger(run).unverified()
    assert "line 2: the approved record by ben" in flag and "not signed" in flag
    result = cli("overrides", "verify", str(run))
    assert result.code == 0
    assert "unverified:" in result.out and "1 record(s) do not prove" in result.out


def test_a_forged_policy_approval_is_refused(signed_run, keys):
    # The auto-degrade policy's approvals are not signed; they must name a policy of the run.
    paths, _ = keys
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    with pytest.raises(OverrideError, match="no revision of this run's manifest chain"):
        Ledger(signed_run).approve(
            staged.id[:12], who="auto-degrade policy of revision aaaaaaaaaaaa", policy="a" * 64
        )
    assert len(_lines(signed_run)) == 1


def test_a_chain_rewritten_with_fresh_hashes_is_caught_by_a_checkpoints_anchor(
    tmp_path, admitted, cli
):
    run = make_run_dir(tmp_path / "run", admitted)  # no signatures: the chain alone
    ledger = Ledger(run)
    staged = ledger.stage(FC1, "saturation", who="ana")
    ledger.approve(staged.id[:12], who="ben")
    checkpoint_record(run, ledger.anchor())
    assert ledger.verify() == 2
    assert cli("overrides", "verify", str(run)).code == 0
    # Rewritten from the first line: another reason, every hash fresh. The chain holds, and
    # only the checkpoint's anchor can tell.
    records = ledger.records()
    _write(run, _rechain([{**records[0], "reason": "ben asked for it"}, records[1]]))
    with pytest.raises(LedgerError, match="checkpoint step_00000120 saw 2 ledger record"):
        ledger.verify()
    result = cli("overrides", "verify", str(run))
    assert result.code == 2 and "rewritten" in result.err + result.out
    # Cut short after the checkpoint: caught too, and nothing appends to it.
    _write(run, records[:1])
    with pytest.raises(LedgerError, match="it has 1 record"):
        ledger.overrides()
    with pytest.raises(LedgerError, match="it has 1 record"):
        ledger.reject(records[0]["hash"], "x", who="ben")


def test_an_edited_allowed_signers_file_is_refused_naming_the_field(signed_run, keys):
    paths, allowed = keys
    original = allowed.read_text()
    try:
        allowed.write_text(original + f'mallory namespaces="{NAMESPACE}" ssh-ed25519 AAAA\n')
        with pytest.raises(Fp8opsError, match="review.allowed_signers_sha256") as refused:
            Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
        assert str(allowed) in str(refused.value) and "edited or swapped" in str(refused.value)
    finally:
        allowed.write_text(original)
    assert not (signed_run / "overrides.jsonl").exists()


@pytest.mark.parametrize(
    "review, words",
    [
        ({"allowed_signers": "signers"}, "review.allowed_signers_sha256"),
        ({"allowed_signers_sha256": "a" * 64}, "review.allowed_signers"),
        ({"require_signatures": True}, "needs allowed_signers"),
    ],
)
def test_a_review_section_that_cannot_verify_is_refused(admitted, review, words):
    manifest = admitted[0]
    with pytest.raises(ManifestError, match=words):
        derive(manifest, {f"review.{k}": v for k, v in review.items()}, "bad review")


@pytest.mark.skipif(shutil.which("ssh-agent") is None, reason="needs ssh-agent")
def test_a_key_held_by_ssh_agent_signs_through_its_public_half(
    signed_run, keys, tmp_path, monkeypatch
):
    paths, _ = keys
    socket = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # against a hang only: the agent starts in milliseconds
        while not socket.exists():  # the socket appears once the agent listens
            assert time.monotonic() < deadline and agent.poll() is None, "ssh-agent never listened"
            time.sleep(0.05)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket))
        subprocess.run(["ssh-add", "-q", str(paths["ana"])], check=True, capture_output=True)
        public = tmp_path / "only-public.pub"  # no private key beside it: the agent signs
        shutil.copy(paths["ana"].with_suffix(".pub"), public)
        staged = Ledger(signed_run, key=public).stage(FC1, "saturation", who="ana")
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    assert Ledger(signed_run).get(staged.id[:12]).status == "staged"  # verified on read
    assert Ledger(signed_run).unverified() == []


def _sealed(records, body, key=None):
    """``body`` as the next record after ``records``, signed with ``key`` when given."""
    from fp8ops.overrides.signing import sign

    prev = records[-1]["hash"] if records else GENESIS
    record = {**body, "seq": len(records), "prev": prev, "time": "2026-12-02T00:00:00+00:00"}
    if key is not None:
        record["signature"] = sign(signed_body(record), key)
    record["hash"] = record_hash(record)
    return [*records, record]


def _forged_proposal(records, module=FC1, rule="saturation"):
    trigger = {"metric": "input.saturation", "value": 0.5, "threshold": 0.1, "level": "degrade"}
    body = {
        "kind": "proposed",
        "module": module,
        "dtype": "bf16",
        "reason": "forged",
        "who": "fp8ops-alerts",
        "triggers": [{**trigger, "rule": rule, "step": 100}],
        "step": 100,
        "data_version": None,
    }
    return _sealed(records, body)


def _policy_revision(run, **policy):
    """A revision of the run with an auto-degrade policy, made the run's locked one."""
    from fp8ops.manifest import load_manifest

    current = load_manifest(run / "manifest.yaml")
    policy = {"rules": ["saturation"], "max_modules": 1, **policy}
    return lock_to(run, derive(current, {"alerts.auto_degrade": policy}, "a policy"))


def _policy_approval(records, policy, override):
    from fp8ops.overrides.ledger import policy_approver

    body = {
        "kind": "approved",
        "override": override,
        "who": policy_approver(policy),
        "note": None,
        "policy": policy,
    }
    return _sealed(records, body)


def test_forged_records_that_claim_a_policy_are_refused_on_read(signed_run, keys):
    """Records no person signs (a proposal, a policy's approval) may say only what the alert
    engine and the run's own policy could have written."""
    paths, _ = keys
    policy = _policy_revision(signed_run)
    ledger = Ledger(signed_run)

    def refused(records, words):
        _write(signed_run, records)
        with pytest.raises(LedgerError, match=words):
            ledger.overrides()

    staged = _sealed(
        [],
        {
            "kind": "staged",
            "module": FC1,
            "dtype": "bf16",
            "reason": "r",
            "who": "ana",
            "triggers": [],
            "step": 1,
            "data_version": None,
        },
        paths["ana"],
    )
    # A person's record with a policy key, unsigned: not exempt.
    revoke = {"kind": "revoked", "override": staged[0]["hash"], "who": "ben", "reason": "x"}
    refused(_sealed(staged, {**revoke, "policy": policy}), "carries a policy")
    # The policy approves only the alert engine's proposals, not an operator's staging.
    refused(_policy_approval(staged, policy, staged[0]["hash"]), "only the alert engine's")
    # A policy that is no revision of the run's chain (a file dropped into manifests/).
    proposal = _forged_proposal([])
    refused(_policy_approval(proposal, "b" * 64, proposal[0]["hash"]), "no revision of this run")
    # A proposal of another rule than the policy's.
    other = _forged_proposal([], rule="underflow")
    refused(_policy_approval(other, policy, other[0]["hash"]), "none of the policy's rules")
    # Past max_modules (1): the second policy approval of the run, though under the revision
    # the first switch made (max_modules counts the run, not a revision).
    switched = _policy_revision(signed_run, until_step=1000)
    two = _forged_proposal([])
    two = _policy_approval(two, policy, two[0]["hash"])
    two = _forged_proposal(two, module=QKV)
    two = _policy_approval(two, switched, two[2]["hash"])
    refused(two, "past its max_modules 1")
    # A proposal is the alert engine's: one written as a person is flagged.
    refused(_sealed([], {**proposal[0], "who": "ana"}), "only the alert engine proposes")
    # A record without a kind: refused naming its line.
    refused(_sealed([], {"who": "ana"}), "line 1: the unknown record by ana")
    # The two-person rule holds on read too: ana approving her own staging, signed by her.
    mine = {"kind": "approved", "override": staged[0]["hash"], "who": "ana", "note": None}
    refused(_sealed(staged, mine, paths["ana"]), "cannot approve it too")
    # A malformed signature is a refusal naming the line, not a crash.
    refused(_sealed(staged, {**revoke, "signature": 5}), "line 2: .*not a valid record")
    # What the policy could have written passes.
    _write(signed_run, _policy_approval(proposal, policy, proposal[0]["hash"]))
    assert ledger.verify() == 2 and ledger.unverified() == []


def test_a_missing_key_or_an_unusable_signers_file_is_refused_naming_it(
    signed_run, keys, tmp_path, admitted, cli
):
    missing = tmp_path / "no-such-key"
    result = cli("overrides", "stage", str(signed_run), FC1, "--reason", "r", "--key", missing)
    assert result.code == 2 and f"{missing}: no such signing key" in result.err + result.out
    assert not (signed_run / "overrides.jsonl").exists() or not _lines(signed_run)
    garbage = tmp_path / "garbage_signers"
    garbage.write_text('ana namespaces="fp8ops-ledger" ssh-ed25519\n')  # no key
    run = make_run_dir(tmp_path / "garbage", admitted, review=_review(garbage))
    with pytest.raises(Fp8opsError, match="not an allowed-signers file fp8ops can use"):
        Ledger(run, key=keys[0]["ana"]).stage(FC1, "r", who="ana")


def _unsigned_revision(run):
    """The run's locked revision without the review signing settings."""
    from fp8ops.manifest import load_manifest

    unsigned = {"allowed_signers": None, "allowed_signers_sha256": None}
    changes = {f"review.{k}": v for k, v in {**unsigned, "require_signatures": False}.items()}
    return derive(load_manifest(run / "manifest.yaml"), changes, "no signatures")


def test_a_revision_forged_into_the_run_directory_waives_no_signature(signed_run, keys, cli):
    """Issue 49, defect 6: a revision without the review signing settings, written into
    manifests/ and named by manifest.yaml and status.json, made `verify` and `list` accept an
    unsigned approval ("1 approved", exit 0) on a run whose checkpoint requires signatures."""
    from fp8ops.console.ledger_state import module_states

    paths, _ = keys
    staged = Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    checkpoint_record(signed_run, Ledger(signed_run).anchor())  # saved under signatures
    forged = lock_to(signed_run, _unsigned_revision(signed_run))
    approval = {"kind": "approved", "override": staged.id, "who": "ben", "note": None}
    append_by_hand(signed_run, approval)  # unsigned: anyone can type "ben"
    for command in ("verify", "list"):
        result = cli("overrides", command, str(signed_run))
        assert (result.code, result.out) == (2, ""), command
        assert f"locked to revision {forged[:12]}" in result.err
        assert "checkpoint step_00000120 was saved under" in result.err
        assert "loosens review.require_signatures, review.allowed_signers" in result.err
    with pytest.raises(OverrideError, match="loosens review.require_signatures"):
        module_states(signed_run)  # the console's read
    # A resume that accepted the same revision as drift records it in its `resumed` event: the
    # change then holds, and the approval is read as the revision's rules say (typed names).
    (signed_run / "events.jsonl").write_text(
        json.dumps({"event": "resumed", "new_revisions": [forged], "accepted": "one signer"}) + "\n"
    )
    result = cli("overrides", "verify", str(signed_run))
    assert result.code == 0 and "1 approved" in result.out


def test_reads_hold_the_run_to_its_checkpoints_revision(signed_run, keys, cli):
    """A revision written since the checkpoint that keeps the review rules (an auto-degrade
    switch, a resume's applied overrides) is the run's; one that does not descend from the
    checkpoint's revision is refused, and so is loosening self-approval."""
    from fp8ops.manifest import load_manifest

    paths, _ = keys
    Ledger(signed_run, key=paths["ana"]).stage(FC1, "saturation", who="ana")
    checkpoint_record(signed_run, Ledger(signed_run).anchor())
    locked = load_manifest(signed_run / "manifest.yaml")
    overrides = [{"module": QKV, "reason": "held in BF16"}]
    lock_to(signed_run, derive(locked, {"precision.overrides": overrides}, "a switch"))
    assert cli("overrides", "verify", str(signed_run)).code == 0

    lock_to(signed_run, derive(locked, {"review.allow_self_approval": True}, "solo"))
    result = cli("overrides", "verify", str(signed_run))
    assert result.code == 2 and "loosens review.allow_self_approval" in result.err

    lock_to(signed_run, load_manifest(TINY))  # another lineage's root, without signers
    result = cli("overrides", "verify", str(signed_run))
    assert result.code == 2 and "is a root: it does not descend from it" in result.err
