"""What a Degrade alert does: it proposes a BF16 override of its module into the run's ledger,
for an operator to review (:func:`propose_overrides`); under the manifest's
``alerts.auto_degrade`` policy it also acts, switching modules to BF16 between two steps,
without a restart (:func:`auto_degrade`). Under the policy's ``granularity: gemm`` a proposal,
and so the switch, takes only the GEMMs that read the alerted tensor (``alerts/policy.py``).

After a step's alerts are gathered (every rank holds them all), :func:`policy_switches` picks
the same proposals on every rank. Then, before the next step:

1. rank 0 records each in the override ledger: the alert engine's proposal, approved by the
   policy (the approver names the policy's manifest revision) while the ledger holds fewer than
   ``max_modules`` policy approvals, and broadcasts the approvals;
2. every rank derives the same manifest revision, the modules added to ``precision.overrides``
   with their approval and the policy's revision, and decides admission again from it, so the
   modules' ``fp8_enabled`` flags go off together (their FP8 state stays, frozen, and the amax
   reduction goes on over the others, as for any BF16 override); the trainer runs on under the
   revision and its admission (:class:`Switched`);
3. the alert rules forget the modules' FP8 history, as a resume does for a held module;
4. rank 0 makes the revision the run's (``manifests/``, ``manifest.yaml``, ``status.json``),
   rewrites ``layers.json`` and records the ledger's ``applied`` and an event.

A checkpoint after the switch carries the revision, so a resume runs the modules in BF16 from
its first step, and the run continues as the straight one. Revoking such an override returns the
module to FP8 at the next resume, as for any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fp8ops.admission import AdmissionTable, apply_admission
from fp8ops.alerts.policy import policy_switches
from fp8ops.alerts.records import Alert, Proposal
from fp8ops.alerts.rules import AlertEngine
from fp8ops.collective import on_rank0
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import derive, manifest_hash
from fp8ops.manifest.schema import Manifest
from fp8ops.overrides.ledger import Ledger, Override, Trigger, policy_approver
from fp8ops.precision import DelayedScalingRecipe, StatelessRecipe
from fp8ops.run import RunDir
from fp8ops.run.records import layers_history, write_layers_json
from fp8ops.train.phases import decide_at


def propose_overrides(
    run: RunDir, ledger: Ledger, proposals: list[Proposal], alerts: list[dict]
) -> None:
    """Rank 0: each proposal into the ledger as a BF16 override, its triggers the gathered
    ``alerts`` of its module and step that name a metric. A ledger that refuses (an operator's
    damaged ledger) is recorded as an event: it must not end training."""
    for proposal in proposals:
        triggers = [
            Alert.from_json(a)
            for a in alerts
            if a.get("module") == proposal.module
            and a["step"] == proposal.step
            and a.get("metric") is not None
        ]
        try:
            ledger.propose(
                proposal.module, proposal.reason, triggers, proposal.step, gemms=proposal.gemms
            )
        except Fp8opsError as exc:
            run.event(
                "proposal_not_recorded", module=proposal.module, step=proposal.step, error=str(exc)
            )


@dataclass(frozen=True)
class Switched:
    """What a switch changed: the run's manifest (the revision) and its admission table, which
    the trainer runs on from the next step, and the modules now in BF16 (all or some of their
    GEMMs)."""

    manifest: Manifest
    admission: AdmissionTable
    modules: list[str]


def auto_degrade(
    step: int,
    proposals: list[Proposal],
    *,
    manifest: Manifest,
    model: nn.Module,
    recipe: DelayedScalingRecipe | StatelessRecipe,
    alert_engine: AlertEngine,
    run: RunDir,
    ledger: Ledger | None,
) -> Switched | None:
    """Switch the modules the policy of ``manifest`` lets act among ``proposals`` (collective);
    None when it switches none. ``recipe``: the run's, recorded in ``layers.json``; ``ledger``:
    rank 0's (None elsewhere)."""
    policy = manifest.alerts.auto_degrade
    switching = policy_switches(
        policy, [p for p in proposals if p.module not in _held(manifest)], step=step
    )
    if not switching:
        return None
    revision = manifest_hash(manifest)
    # Rank 0 decides with the ledger (its limit, an operator's open staging) and every rank
    # follows its answer: {module: the ledger's approved override}.
    # (A failure there, even of the event that reports one, fails every rank, not rank 0 alone.)
    approved = on_rank0(
        run.writer,
        lambda: _approve_all(ledger, run, switching, revision, policy.max_modules),
    )
    switching = [p for p in switching if p.module in approved]
    if not switching:
        return None
    # The entries a resume would write for them (the policy's revision where it approved).
    added = [approved[p.module].as_manifest_override() for p in switching]
    modules = [p.module for p in switching]
    targets = [f"{p.module} to {approved[p.module].target}" for p in switching]
    child = derive(
        manifest,
        {
            "precision.overrides": [
                o.model_dump(mode="json") for o in (*manifest.precision.overrides, *added)
            ]
        },
        f"{policy_approver(revision)}: {', '.join(targets)} after step {step}",
        source="the auto-degrade policy",
    )
    # Under the phases of the precision schedule that covered this step: where one starts or
    # ends at the next, the trainer's switch follows this one (phases.at_boundary), comparing
    # against this table.
    admission = decide_at(model, child, step)
    apply_admission(admission, model)
    # A module left with FP8 GEMMs stays FP8 for the rules, which judge what it still casts.
    alert_engine.hold([m for m in modules if not admission.row(m).fp8])
    alert_engine.forget([m for m in modules if admission.row(m).fp8])
    if run.writer:
        run.advance_manifest(child)
        write_layers_json(
            run.path,
            admission,
            recipe,
            tensor_parallel=child.topology.tensor_parallel,
            manifest_hash=manifest_hash(child),
            history=layers_history(run.path) if child.precision.schedule else (),
        )
        fresh = [o.id for o in approved.values() if o.status == "approved"]  # not replays
        if fresh:
            try:
                ledger.record_applied(
                    fresh, step=step, revision=manifest_hash(child), who=policy_approver(revision)
                )
            except Exception as exc:  # noqa: BLE001 - the switch stands; training goes on
                run.event("auto_degrade_not_recorded", modules=modules, step=step, error=str(exc))
        gemms = {m: list(o.gemms) for m, o in approved.items() if o.gemms is not None}
        run.event(
            "auto_degraded",
            step=step,
            modules=modules,
            **({"gemms": gemms} if gemms else {}),  # the modules switched for some GEMMs
            rules=[p.rule for p in switching],
            policy=revision,
            revision=manifest_hash(child),
        )
    return Switched(child, admission, modules)


def _held(manifest) -> set[str]:
    return {o.module for o in manifest.precision.overrides}


def _approve_all(
    ledger: Ledger, run: RunDir, switching: list[Proposal], revision: str, max_modules: int
) -> dict[str, Override]:
    """Rank 0: ``{module: override}``, the approved ledger override of each module the policy
    switches now.

    The policy approves the alert engine's open proposal of the module, while fewer than
    ``max_modules`` overrides in the run's ledger were approved by a policy. An override already
    approved by an operator, or applied by the policy before a resume from an earlier checkpoint
    (the replay of the same switch), is taken as it is and takes no room. A module an operator
    staged is left to the operator's review. Nothing switches unrecorded: a module the ledger
    cannot take (damaged, or refusing the record) keeps running FP8, an event says why, and the
    Stop rules still guard it. Nothing here raises (the other ranks wait for this answer; what
    escapes, such as a full disk taking the event, fails them all: :func:`auto_degrade`)."""
    approved = {}
    try:
        used = sum(o.policy is not None for o in ledger.overrides().values())
    except Exception as exc:  # noqa: BLE001 - see above
        run.event("auto_degrade_not_recorded", step=switching[0].step, error=str(exc))
        return {}
    for proposal in switching:
        try:
            override = next(
                (
                    o
                    for o in ledger.overrides().values()
                    if o.module == proposal.module and o.is_open
                ),
                None,
            )
            if override is None:  # the alert's proposal was not recorded when it was raised
                override = ledger.propose(
                    proposal.module,
                    proposal.reason,
                    [_trigger(proposal)],
                    proposal.step,
                    gemms=proposal.gemms,
                )
            replay = override.policy is not None and override.status == "applied"
            if override.status == "approved" or replay:
                approved[proposal.module] = override  # an operator's approval, or a replay
                continue
            if override.origin == "staged":
                run.event(
                    "auto_degrade_skipped",
                    module=proposal.module,
                    step=proposal.step,
                    why=f"override {override.id[:12]} was staged by {override.who}: theirs to "
                    "review",
                )
                continue
            if used >= max_modules:
                continue  # past the policy's limit: Degrade only proposes, as without a policy
            note = f"{proposal.rule} at step {proposal.step}, within the policy's limits"
            approved[proposal.module] = ledger.approve(
                override.id, who=policy_approver(revision), note=note, policy=revision
            )
            used += 1
        except Exception as exc:  # noqa: BLE001 - see above
            run.event(
                "auto_degrade_not_recorded",
                module=proposal.module,
                step=proposal.step,
                error=str(exc),
            )
    return approved


def _trigger(proposal: Proposal) -> Trigger:
    """The proposal's alert as a ledger trigger (its first metric), naming the rule."""
    metric, value = next(iter(proposal.metrics.items()), (proposal.rule, None))
    return Trigger(
        metric=metric,
        value=value,
        threshold=None,
        level="degrade",
        rule=proposal.rule,
        step=proposal.step,
    )
