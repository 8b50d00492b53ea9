"""The auto-degrade policy (``alerts.auto_degrade``): a Degrade alert switches its module to BF16
at the next step boundary, recorded in the ledger and as a manifest revision; the same run
without the policy stops; a stop and resume equals the straight run bit for bit."""

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL
from support.torchrun import torchrun

import fp8ops.megatron  # noqa: F401  (before Megatron-Core: TE's meta-package otherwise)
from fp8ops.alerts import read_alerts
from fp8ops.alerts.policy import gemms_to_switch, policy_switches
from fp8ops.alerts.records import Alert, Proposal
from fp8ops.checkpoint import CheckpointDir, read_meta
from fp8ops.errors import ManifestError
from fp8ops.files import read_jsonl
from fp8ops.manifest import derive, load_manifest, manifest_hash, write_manifest
from fp8ops.manifest.schema import AutoDegrade
from fp8ops.overrides import Ledger, LedgerError, OverrideError
from fp8ops.overrides.chain import canonical_json, record_hash
from fp8ops.overrides.ledger import policy_approver
from fp8ops.overrides.signing import NAMESPACE
from fp8ops.run.records import read_layers_json
from fp8ops.run.switches import read_switches
from fp8ops.start import New
from fp8ops.start.plan import ResumeRequest, plan_resume, plan_start
from fp8ops.train import open_trainer
from fp8ops.train.distributed import init_distributed, shutdown_distributed
from fp8ops.train.ending import StopRun

SMALL = {
    **SMALL_MODEL,
    **SCHEDULE,
    "model.init_checkpoint": None,
    "data.num_examples": 600,
    "schedule.train_steps": 10,
    "schedule.eval_interval": 1000,
    "schedule.checkpoint_interval": 1000,
    "telemetry.every_steps": 1,
    "telemetry.error_sample_every": 2,
    "telemetry.flush_steps": 4,
    # Its forwards would run the injection below between steps.
    "capability.enabled": False,
}
TARGET = "decoder.layers.1.mlp.linear_fc1"
WORKER = Path(__file__).parent / "workers" / "auto_degrade.py"
POLICY = {"rules": ["saturation", "fp8_error"], "max_modules": 1}
DEGRADE_STEP = 4  # saturation above the degrade level (not the stop level) for 3 steps by then
STOP_STEP = 8  # past the stop level for 3 steps, without the policy


@pytest.fixture(scope="module")
def manifest():
    return derive(load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"), SMALL, "auto-degrade test")


def _with_policy(manifest, **policy):
    return derive(manifest, {"alerts.auto_degrade": {**POLICY, **policy}}, "auto-degrade on")


def _growth(step: int) -> float:
    """The injected weight factor at (1-based) ``step``: 1.3x a step from step 2 to 5 (a
    weight saturation between Degrade's 1e-3 and Stop's 1e-2), then 4x a step (far past Stop)."""
    factor = 1.0
    for k in range(2, step + 1):
        factor *= 1.3 if k <= 5 else 4.0
    return factor


def _inject(trainer) -> None:
    """Saturate TARGET's FP8 weight cast: before each step's first micro-batch (when the weight
    is cast) the weight is scaled by ``_growth``, while the module runs FP8. The optimizer writes
    the weight back from its main copy after each step, so the factor does not accumulate."""
    module = dict(trainer.model.named_modules())[TARGET]
    calls = {"n": 2 * trainer.start_step}  # two micro-batches a step

    def grow(mod, args):
        calls["n"] += 1
        step = (calls["n"] + 1) // 2
        # While the weight is cast for fprop: a switch of fprop to bf16 ends it, as of the module.
        if calls["n"] % 2 == 1 and mod.fp8_enabled and "fprop" in mod.fp8_gemms:
            with torch.no_grad():
                mod.weight.mul_(_growth(step))

    module.register_forward_pre_hook(grow)


def _train(plan, stop_at=None):
    ranks = init_distributed(plan.manifest.topology, source="test")
    trainer = open_trainer(plan, ranks, progress=False)
    _inject(trainer)
    try:
        trainer.train(stop_at=stop_at)
    finally:
        shutdown_distributed()
    return trainer


def _new(manifest, run_dir, stop_at=None):
    return _train(New(manifest, [manifest], run_dir, "test"), stop_at)


def _resume(run_dir):
    return _train(plan_start(ResumeRequest(run_dir)))


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}


def _without_approvals(manifest):
    data = manifest.model_dump(mode="json")
    for entry in data["precision"]["overrides"]:
        entry["approval"] = None
    return data


@pytest.fixture(scope="module")
def straight(manifest, tmp_path_factory):
    """The policy's run, straight through: (run directory, trainer)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    return run, _new(_with_policy(manifest), run)


def test_without_the_policy_the_injected_saturation_stops_the_run(manifest, tmp_path):
    with pytest.raises(StopRun) as stop:
        _new(manifest, tmp_path / "run")
    first = stop.value.alerts[0]
    assert (first["step"], first["module"], first["rule"]) == (STOP_STEP, TARGET, "saturation")
    degrade = [a for a in read_alerts(tmp_path / "run") if a.level == "degrade"]
    assert (degrade[0].step, degrade[0].module) == (DEGRADE_STEP, TARGET)
    # Only proposed: nobody approved it, the module ran FP8 to the stop.
    (proposal,) = [o for o in Ledger(tmp_path / "run").overrides().values() if o.module == TARGET]
    assert proposal.status == "proposed"


def test_the_policy_switches_the_module_after_its_degrade_alert_and_the_run_finishes(
    manifest, straight
):
    run, trainer = straight
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", SMALL["schedule.train_steps"])
    policy_revision = manifest_hash(_with_policy(manifest))
    # The switch: from the step after the alert on, the module runs BF16 and its FP8 rules rest.
    assert not dict(trainer.model.named_modules())[TARGET].fp8_enabled
    alerts = read_alerts(run)
    assert [(a.step, a.level) for a in alerts if a.module == TARGET and a.level != "observe"] == [
        (DEGRADE_STEP, "degrade")
    ]
    assert not [a for a in alerts if a.level == "stop"]
    # The ledger: the alert engine's proposal, approved by the policy, applied at that step.
    (override,) = Ledger(run).overrides().values()
    assert (override.module, override.status, override.who) == (TARGET, "applied", "fp8ops-alerts")
    assert override.decided_by == policy_approver(policy_revision)
    assert override.policy == policy_revision
    assert override.applied_step == DEGRADE_STEP
    # A manifest revision, the run's now, holds the override with its approval and policy.
    final = load_manifest(run / "manifest.yaml")
    assert override.applied_revision == manifest_hash(final) == status["manifest"]
    assert final.revision.parent == policy_revision
    assert manifest_hash(trainer.manifest) == manifest_hash(final)
    (entry,) = final.precision.overrides
    assert (entry.module, entry.approval, entry.policy) == (
        TARGET,
        override.approval,
        policy_revision,
    )
    assert (run / "manifests" / f"{manifest_hash(final)}.yaml").is_file()
    # layers.json says why the module is in BF16 now.
    row = next(r for r in read_layers_json(run).rows if r.fqn == TARGET)
    assert (row.precision, row.reason.code) == ("bf16", "override")
    assert "auto-degrade policy" in row.reason.text
    # The final checkpoint anchors the ledger as it was: three records, ending in "applied".
    anchor = read_meta(CheckpointDir(run).latest()).ledger
    assert (anchor.records, anchor.head) == (3, Ledger(run).records()[-1]["hash"])
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "auto_degraded"]
    assert (event["step"], event["modules"], event["rules"]) == (
        DEGRADE_STEP,
        [TARGET],
        ["saturation"],
    )


@pytest.mark.parametrize("stop_at", [DEGRADE_STEP + 2, DEGRADE_STEP - 1])
def test_a_stop_and_resume_equals_the_straight_run(manifest, straight, tmp_path, stop_at):
    # After the switch (the checkpoint holds the revision) and before it (the resumed run meets
    # the alert again and the policy switches the module at the same step).
    run = tmp_path / "run"
    _new(_with_policy(manifest), run, stop_at=stop_at)
    resumed = _resume(run)
    straight_run, straight_trainer = straight
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert _losses(run) == _losses(straight_run)
    expected = _weights(straight_trainer)
    got = _weights(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # The same revision, but for the approval: a ledger record's hash, which covers its time.
    assert _without_approvals(resumed.manifest) == _without_approvals(straight_trainer.manifest)
    # One override, approved and applied once: a replayed switch records nothing twice.
    kinds = [r["kind"] for r in Ledger(run).records()]
    assert kinds == ["proposed", "approved", "applied"]


@pytest.fixture(scope="module")
def straight_gemm(manifest, tmp_path_factory):
    """The policy's run at granularity gemm, straight through: (run directory, trainer)."""
    run = tmp_path_factory.mktemp("straight-gemm") / "run"
    return run, _new(_with_policy(manifest, granularity="gemm"), run)


@pytest.mark.slow  # a training run of its own (~20 s)
def test_a_gemm_policy_switches_only_the_gemms_that_read_the_saturating_weight(straight_gemm):
    """The weight saturates: fprop and dgrad read it, and go to bf16; wgrad stays FP8, and with
    it the module, whose input and gradient casts the rules go on judging."""
    run, trainer = straight_gemm
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", SMALL["schedule.train_steps"])
    module = dict(trainer.model.named_modules())[TARGET]
    assert module.fp8_enabled and module.fp8_gemms == {"wgrad"}
    assert trainer.alert_engine.fp8[trainer.alert_engine.modules.index(TARGET)]
    (override,) = Ledger(run).overrides().values()
    assert (override.gemms, override.status, override.applied_step) == (
        ("fprop", "dgrad"),
        "applied",
        DEGRADE_STEP,
    )
    (entry,) = load_manifest(run / "manifest.yaml").precision.overrides
    assert entry.gemms == ("fprop", "dgrad") and entry.policy is not None
    row = next(r for r in read_layers_json(run).rows if r.fqn == TARGET)
    assert (row.precision, row.fp8_gemms) == ("fp8", ("wgrad",))
    assert "BF16 override of fprop and dgrad" in row.gemms.fprop.reason.text
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "auto_degraded"]
    assert event["gemms"] == {TARGET: ["fprop", "dgrad"]}
    assert not [a for a in read_alerts(run) if a.level == "stop"]


@pytest.mark.slow  # the straight run and two more (~40 s)
@pytest.mark.parametrize("stop_at", [DEGRADE_STEP + 2, DEGRADE_STEP - 1])
def test_a_gemm_switch_stop_and_resume_equals_the_straight_run(
    manifest, straight_gemm, tmp_path, stop_at
):
    run = tmp_path / "run"
    _new(_with_policy(manifest, granularity="gemm"), run, stop_at=stop_at)
    resumed = _resume(run)
    straight_run, straight_trainer = straight_gemm
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert _losses(run) == _losses(straight_run)
    expected, got = _weights(straight_trainer), _weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert dict(resumed.model.named_modules())[TARGET].fp8_gemms == {"wgrad"}
    assert [r["kind"] for r in Ledger(run).records()] == ["proposed", "approved", "applied"]


def test_a_person_revokes_the_policys_switch_and_the_next_resume_returns_it_to_fp8(
    manifest, tmp_path
):
    run = tmp_path / "run"
    _new(_with_policy(manifest), run, stop_at=DEGRADE_STEP + 1)
    ledger = Ledger(run)
    (override,) = ledger.overrides().values()
    ledger.revoke(override.id[:12], "the weight was fixed upstream", who="ana")
    plan = plan_start(ResumeRequest(run))
    assert [o.module for o in plan.lifted_overrides] == [TARGET]
    assert plan.manifest.precision.overrides == ()


def test_a_policy_past_its_until_step_only_proposes(manifest, tmp_path):
    with pytest.raises(StopRun):
        _new(_with_policy(manifest, until_step=DEGRADE_STEP - 1), tmp_path / "run")
    overrides = Ledger(tmp_path / "run").overrides().values()
    assert TARGET in {o.module for o in overrides}
    assert {o.status for o in overrides} == {"proposed"}


# -- the policy's choice, without training -----------------------------------------------------


def _proposal(module, rule, step=5):
    return Proposal(step, module, f"{rule} of {module}", rule=rule)


def test_the_policy_acts_on_its_rules_only_up_to_its_until_step():
    policy = AutoDegrade(rules=["saturation", "underflow"], max_modules=2, until_step=100)
    proposals = [
        _proposal("a", "saturation"),
        _proposal("b", "grad_spike"),
        _proposal("c", "underflow"),
        _proposal("d", "saturation"),
    ]
    chosen = policy_switches(policy, proposals, step=5)
    assert [p.module for p in chosen] == ["a", "c", "d"]  # in order; max_modules: the ledger's
    assert policy_switches(policy, proposals, step=101) == []
    assert policy_switches(None, proposals, step=5) == []


def _alert(rule, metric, module="m", level="degrade", step=5):
    return Alert(
        step=step,
        level=level,
        rule=rule,
        module=module,
        metric=metric,
        value=0.5,
        threshold=0.1,
        message=rule,
    )


@pytest.mark.parametrize(
    "alerts, gemms",
    [
        ([("saturation", "grad_output.saturation")], ("dgrad", "wgrad")),
        ([("underflow", "grad_output.underflow")], ("dgrad", "wgrad")),
        ([("saturation", "input.saturation")], ("fprop", "wgrad")),
        ([("blocks_at_floor", "weight.blocks_at_floor")], ("fprop", "dgrad")),
        ([("scale_jitter", "weight.scale_change")], ("fprop", "dgrad")),
        ([("fp8_error", "fp8_rel_error")], ("fprop",)),
        # Two tensors: every GEMM that reads either; all three is the whole module (None).
        ([("saturation", "input.saturation"), ("underflow", "grad_output.underflow")], None),
        ([("saturation", "weight.saturation"), ("fp8_error", "fp8_rel_error")], ("fprop", "dgrad")),
        # No tensor named: the whole module.
        ([("grad_spike", "grad_norm")], None),
        # A rule the policy does not act on is left out.
        ([("saturation", "weight.saturation"), ("amax_jump", "input.amax")], ("fprop", "dgrad")),
    ],
)
def test_a_gemm_granularity_policy_switches_the_gemms_that_read_the_alerted_tensor(alerts, gemms):
    rules = [
        "saturation",
        "underflow",
        "blocks_at_floor",
        "scale_jitter",
        "fp8_error",
        "grad_spike",
    ]
    policy = AutoDegrade(rules=rules, max_modules=1, granularity="gemm")
    assert gemms_to_switch(policy, [_alert(r, m) for r, m in alerts]) == gemms
    module_policy = AutoDegrade(rules=rules, max_modules=1)  # the default: the whole module
    assert module_policy.granularity == "module"
    assert gemms_to_switch(module_policy, [_alert(r, m) for r, m in alerts]) is None


def test_proposals_carry_the_gemms_only_where_a_gemm_policy_acts(manifest):
    from fp8ops.alerts.rules import AlertEngine

    def proposals(policy):
        config = derive(manifest, {"alerts.auto_degrade": policy}, "p").alerts
        engine = AlertEngine(config, ["m", "n"], [True, True])
        alerts = [
            _alert("saturation", "grad_output.saturation", "m"),
            _alert("underflow", "weight.underflow", "n"),
        ]
        return {p.module: p.gemms for p in engine.proposals(alerts)}

    gemm_policy = {**POLICY, "granularity": "gemm"}
    assert proposals(gemm_policy) == {"m": ("dgrad", "wgrad"), "n": None}  # underflow: not its
    assert proposals({**gemm_policy, "until_step": 4}) == {"m": None, "n": None}
    assert proposals(POLICY) == {"m": None, "n": None}


@pytest.mark.parametrize(
    "policy, field, words",
    [
        ({"rules": [], "max_modules": 1}, "rules", "at least one"),
        ({"rules": ["saturation", "saturation"], "max_modules": 1}, "rules", "twice"),
        ({"rules": ["amax_jump"], "max_modules": 1}, "rules", "saturation"),
        ({"rules": ["saturation"], "max_modules": 0}, "max_modules", ">= 1"),
        ({"rules": ["saturation"], "max_modules": 1, "until_step": 0}, "until_step", ">= 1"),
        ({"rules": ["saturation"]}, "max_modules", "required"),
        (
            {"rules": ["saturation"], "max_modules": 1, "granularity": "tensor"},
            "granularity",
            "gemm",
        ),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(manifest, policy, field, words):
    with pytest.raises(ManifestError) as refused:
        derive(manifest, {"alerts.auto_degrade": policy}, "bad policy")
    message = str(refused.value)
    assert f"alerts.auto_degrade.{field}" in message and words in message


def test_on_tes_path_the_switch_turns_the_projection_off_and_freezes_its_state(manifest):
    # TE's projections take the switch through the same flag (te_backend.bf16_capable's
    # fp8_enabled, set by apply_admission from the policy's revision): against TE's stand-in.
    from support.te_stand_in import TeLikeLinear, decoder

    from fp8ops.admission import apply_admission, decide_admission

    te = derive(
        manifest,
        {"precision.include_modules": ["*.linear_qkv", "*.linear_proj"]},
        "the stand-in's projections",
    )
    model = decoder(features=64)
    held = "decoder.layers.0.linear_qkv"
    modules = dict(model.named_modules())
    x = torch.randn(4, 64)
    TeLikeLinear.autocast = True
    try:
        model.decoder.layers[0].linear_qkv(x)
        model.decoder.layers[1].linear_qkv(x)
        switched = derive(
            te,
            {"precision.overrides": [{"module": held, "reason": "saturation", "policy": "a" * 64}]},
            "the policy's revision",
        )
        apply_admission(decide_admission(model, switched.precision, tensor_parallel=1), model)
        frozen = modules[held].fp8_meta["scaling_fwd"].amax_history.clone()
        model.decoder.layers[0].linear_qkv(3 * x)
        model.decoder.layers[1].linear_qkv(3 * x)
    finally:
        TeLikeLinear.autocast = False
    assert not modules[held].fp8 and modules["decoder.layers.1.linear_qkv"].fp8
    assert torch.equal(modules[held].fp8_meta["scaling_fwd"].amax_history, frozen)
    other = modules["decoder.layers.1.linear_qkv"].fp8_meta["scaling_fwd"].amax_history
    assert other[0, 0] == (3 * x).abs().amax()


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_under_required_signatures_the_policy_acts_and_a_resume_refuses_a_forged_record(
    manifest, tmp_path
):
    key = tmp_path / "ana"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f'ana namespaces="{NAMESPACE}" {(tmp_path / "ana.pub").read_text()}')
    review = {
        "review.allowed_signers": str(allowed),
        "review.allowed_signers_sha256": hashlib.sha256(allowed.read_bytes()).hexdigest(),
    }
    # Flagged only: the policy's approval is no person's and passes; an unsigned one is flagged.
    run = tmp_path / "flagged"
    _new(derive(_with_policy(manifest), review, "signers"), run, stop_at=DEGRADE_STEP + 1)
    assert Ledger(run).unverified() == []
    (override,) = Ledger(run).overrides().values()
    Ledger(run).revoke(override.id[:12], "typed, not signed", who="ben")
    plan = plan_start(ResumeRequest(run))
    (flag,) = plan.unverified_records
    assert "the revoked record by ben" in flag and "not signed" in flag
    # Required: the policy still acts alone; a record forged into the file stops the resume.
    run = tmp_path / "required"
    required = derive(
        _with_policy(manifest), {**review, "review.require_signatures": True}, "signers"
    )
    _new(required, run, stop_at=DEGRADE_STEP + 1)
    (override,) = Ledger(run).overrides().values()
    assert override.status == "applied"
    with pytest.raises(OverrideError, match="not signed"):
        Ledger(run, key=None).revoke(override.id[:12], "typed, not signed", who="ben")
    records = Ledger(run).records()
    forged = {"kind": "revoked", "override": override.id, "who": "ana", "reason": "forged"}
    forged = {**forged, "seq": len(records), "prev": records[-1]["hash"], "time": "now"}
    forged["hash"] = record_hash(forged)
    with open(run / "overrides.jsonl", "a") as f:
        f.write(canonical_json(forged) + "\n")
    with pytest.raises(LedgerError, match=r"line 4: the revoked record by ana .*not signed"):
        plan_start(ResumeRequest(run))


@pytest.mark.slow  # two processes under torchrun
def test_at_tp2_every_rank_switches_at_the_same_step_when_one_shard_saturates(manifest, tmp_path):
    tp2 = derive(_with_policy(manifest), {"topology.tensor_parallel": 2}, "TP=2")
    path = write_manifest(tp2, tmp_path / "tp2.yaml")
    torchrun(WORKER, path, tmp_path / "run", tmp_path, 1)  # rank 1's TARGET inflated
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = range(1, SMALL["schedule.train_steps"] + 1)
    assert [r["ended"] for r in ranks] == ["finished", "finished"]
    # Only rank 1's shard saturates; both ranks run it in BF16 from the step after the alert.
    for r in ranks:
        assert [r["fp8_by_step"][str(s)] for s in steps] == [s <= DEGRADE_STEP for s in steps]
    degrade = [a for a in read_alerts(tmp_path / "run") if a.level == "degrade"]
    assert (degrade[0].step, degrade[0].module) == (DEGRADE_STEP, TARGET)
    (override,) = Ledger(tmp_path / "run").overrides().values()
    assert (override.status, override.applied_step) == ("applied", DEGRADE_STEP)


@pytest.mark.slow
def test_at_pp2_the_last_stages_alert_switches_its_module_on_every_rank(manifest, tmp_path):
    pp2 = derive(_with_policy(manifest), {"topology.pipeline_parallel": 2}, "PP=2")
    path = write_manifest(pp2, tmp_path / "pp2.yaml")
    torchrun(WORKER, path, tmp_path / "run", tmp_path, 1)  # rank 1's TARGET inflated
    first, last = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = range(1, SMALL["schedule.train_steps"] + 1)
    assert [first["ended"], last["ended"]] == ["finished", "finished"]
    assert first["fp8_by_step"] == {}  # layer 1 is on the last stage
    assert [last["fp8_by_step"][str(s)] for s in steps] == [s <= DEGRADE_STEP for s in steps]
    # Rank 0 (the first stage) recorded the last stage's alert and its override.
    degrade = [a for a in read_alerts(tmp_path / "run") if a.level == "degrade"]
    assert (degrade[0].step, degrade[0].module) == (DEGRADE_STEP, TARGET)
    (override,) = Ledger(tmp_path / "run").overrides().values()
    assert (override.status, override.applied_step) == ("applied", DEGRADE_STEP)
    rows = {row.fqn: row for row in read_layers_json(tmp_path / "run").rows}
    assert rows[TARGET].precision == "bf16" and rows[TARGET].reason.code == "override"


def test_a_resume_from_before_the_switch_leaves_it_to_the_policy_only_if_it_would_act(
    manifest, tmp_path
):
    run = tmp_path / "run"
    every_two = derive(
        _with_policy(manifest),
        {"schedule.checkpoint_interval": 2, "schedule.keep_checkpoints": 5},
        "checkpoints at steps 2, 4, ...",
    )
    _new(every_two, run, stop_at=DEGRADE_STEP + 2)
    before = "step_00000002"
    assert plan_resume(run, checkpoint=before).applied_overrides == []  # replayed at step 4
    # Without the policy (or with one that would not act) nothing would switch it again: the
    # resume applies the ledger's override from its first step, as for an operator's.
    for change in ({"alerts.auto_degrade": None}, {"alerts.auto_degrade.until_step": 2}):
        plan = plan_resume(run, checkpoint=before, assignments=change, accept_drift="test")
        assert [o.module for o in plan.applied_overrides] == [TARGET]


@pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None, reason="needs the console")
def test_the_console_shows_the_policys_switch(straight):
    from fp8ops.console import ConsoleApp

    run, _ = straight
    app = ConsoleApp(run.parent, user="ana", follow=False)
    assert app.run is not None and app.run.run_dir == run
    table = app.ledger_table.value
    assert TARGET in table and "applied" in table and "auto-degrade policy of revision" in table
    assert "unverified" not in table


# -- a policy's switch and a phase of the schedule on one step ----------------------------------

PHASE = {
    "start": DEGRADE_STEP + 1,  # the step the policy's switch after DEGRADE_STEP starts too
    "modules": ["decoder.layers.*"],
    "gemms": ["fprop"],
    "reason": "fprop in BF16 to the end",
}
PROJECTIONS = 8  # two layers of qkv, proj, fc1, fc2


def _scheduled(manifest):
    return derive(_with_policy(manifest), {"precision.schedule": [PHASE]}, "and a phase")


@pytest.fixture(scope="module")
def same_step(manifest, tmp_path_factory):
    """The policy's run with a phase starting at the step its switch starts: (run, trainer)."""
    run = tmp_path_factory.mktemp("same_step") / "run"
    return run, _new(_scheduled(manifest), run)


def test_a_policy_switch_and_a_phase_on_one_step_both_apply_the_policys_first(same_step):
    run, trainer = same_step
    first = DEGRADE_STEP + 1
    # One table: TARGET all in BF16 by the policy's override, the others' fprop by the phase.
    layers = read_layers_json(run)
    rows = {r.fqn: r for r in layers.rows if r.fqn.startswith("decoder.layers.") and r.gemms}
    others = [fqn for fqn, r in rows.items() if r.kind != "norm" and fqn != TARGET]
    assert len(others) == PROJECTIONS - 1
    assert (rows[TARGET].precision, rows[TARGET].reason.code) == ("bf16", "override")
    for fqn in others:
        assert rows[fqn].fp8_gemms == ("dgrad", "wgrad")
        assert rows[fqn].gemms.fprop.reason.code == "schedule"
    modules = dict(trainer.model.named_modules())
    assert not modules[TARGET].fp8_enabled
    assert all(modules[fqn].fp8_gemms == {"dgrad", "wgrad"} for fqn in others)
    # The policy switched first (after the alert's step), then the phase from its table: the
    # phase's history entry leaves TARGET out, already in BF16, and names the table run now.
    (change,) = layers.history
    assert (change.step, change.cause) == (first, "precision.schedule[0] starts")
    assert sorted(change.modules) == sorted(others)
    assert change.table_hash == layers.table_hash
    events = [
        (e["event"], e["step"], e["modules"])
        for e in read_jsonl(run / "events.jsonl")
        if e["event"] in ("auto_degraded", "precision_phase")
    ]
    assert events == [
        ("auto_degraded", DEGRADE_STEP, [TARGET]),
        ("precision_phase", first, list(change.modules)),
    ]
    kinds = [r["kind"] for r in Ledger(run).records()]
    assert kinds == ["proposed", "approved", "applied"]  # the phase is the manifest's: no record
    # Both on the timeline, at the step they start, in the order made.
    switches = read_switches(run)
    assert [(s.step, s.source) for s in switches] == [(first, "auto-degrade"), (first, "schedule")]
    assert switches[0].modules == {TARGET: "bf16"}
    assert switches[0].cause.startswith(f"auto-degrade after step {DEGRADE_STEP}'s saturation")
    assert switches[1].modules == dict.fromkeys(change.modules, "dgrad, wgrad fp8; fprop bf16")


@pytest.mark.slow  # two more trainings of the small model (~20 s)
def test_a_stop_at_the_step_of_both_switches_resumes_as_the_straight_run(
    manifest, same_step, tmp_path
):
    # Stopped after DEGRADE_STEP: both switches are made before its checkpoint, which carries
    # their table; the resume decides it again from the policy's revision and the schedule.
    straight_run, straight_trainer = same_step
    run = tmp_path / "run"
    _new(_scheduled(manifest), run, stop_at=DEGRADE_STEP)
    resumed = _resume(run)
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert _losses(run) == _losses(straight_run)
    expected, got = _weights(straight_trainer), _weights(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    layers, straight_layers = read_layers_json(run), read_layers_json(straight_run)
    assert layers.table_hash == straight_layers.table_hash
    assert layers.history == straight_layers.history
    assert read_switches(run) == read_switches(straight_run)


def test_inspect_layers_lists_both_switches_after_the_table(manifest, same_step, cli):
    run, _ = same_step
    result = cli("inspect", run, "--layers")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    at = lines.index("precision switches (2), each from the step it names:")
    assert "modules FP8" in lines[at - 1]  # after the table and its summary
    # Long lists of modules fold at the terminal's width: compared with spaces evened out.
    text = " ".join(" ".join(lines[at + 1 :]).split())
    (change,) = read_layers_json(run).history
    first, policy = DEGRADE_STEP + 1, manifest_hash(_scheduled(manifest))[:12]
    expected = (
        f"step {first}: auto-degrade after step {DEGRADE_STEP}'s saturation alert, by the "
        f"policy of revision {policy} bf16: {TARGET} "
        f"step {first}: precision.schedule[0] starts "
        f"dgrad, wgrad fp8; fprop bf16: {', '.join(change.modules)} "
    )
    assert text.startswith(expected)


@pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None, reason="needs the console")
def test_the_console_shows_both_switches_on_its_timeline_and_the_phase_in_the_ledger(same_step):
    from fp8ops.console import ConsoleApp

    run, _ = same_step
    app = ConsoleApp(run.parent, user="ana", follow=False)
    assert app.run is not None and app.run.run_dir == run
    # A marker per switch, at its step, in its source's row; hover text says why and what.
    schedule, policy = app.timeline_fig.data
    first = DEGRADE_STEP + 1
    assert (list(schedule.x), list(schedule.y)) == ([first], ["schedule"])
    assert (list(policy.x), list(policy.y)) == ([first], ["auto-degrade"])
    assert f"{TARGET}: bf16" in policy.hovertext[0]
    assert "precision.schedule[0] starts" in schedule.hovertext[0]
    assert schedule.hovertext[0].count("dgrad, wgrad fp8; fprop bf16") == PROJECTIONS - 1
    assert list(app.timeline_fig.layout.xaxis.range) == [0, SMALL["schedule.train_steps"] + 1]
    table = app.switches_table.value
    assert table.index("auto-degrade after step") < table.index("precision.schedule[0] starts")
    # The ledger's rows: TARGET by its override, the others' fprop by the phase, said so.
    ledger = app.ledger_table.value
    other = "decoder.layers.0.mlp.linear_fc1"
    row = ledger[ledger.index(other) :].split("</tr>")[0]
    assert "dgrad, wgrad fp8; fprop bf16 (schedule)" in row
    assert "precision.schedule[0], steps 5 to 10: bf16 (fprop in BF16 to the end)" in row
    app.close()
