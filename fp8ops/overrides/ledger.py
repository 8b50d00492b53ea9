"""The approved-override ledger: ``RUN_DIR/overrides.jsonl``.

Operators take single modules out of FP8 into BF16 through a reviewed, append-only ledger::

    ledger = Ledger(run_dir)
    o = ledger.stage("decoder.layers.3.mlp.linear_fc1", "input saturation 3%", who="ana")
    ledger.approve(o.id[:12], who="ben")        # another operator (review.allow_self_approval)
    ledger.pending_for_resume()                 # what the next resume applies (or lifts)
    ledger.record_applied([o.id], step=300, revision=sha256_of_the_new_manifest)

The file is a hash chain of JSON lines (``chain.py``: an edited, deleted or reordered line is
found and named). Here is what the records mean: the kinds (``proposed``/``staged`` open an
override, whose id is that record's hash; ``approved``, ``rejected``, ``revoked`` decide it;
``applied`` records a resume), the state machine they drive (:func:`_apply`), the rules a record
must meet whoever wrote it (:func:`_problem`: the two-person rule, proposals by the alert engine
only, a policy's approvals), and the checks that need the run: the module against
``layers.json``, the approver against ``review.allow_self_approval``. One reader
(:meth:`Ledger._read`) enforces all of it, signed ledger or not, for every read (``verify``,
``list``, the console, a resume) and every append, held to the run's checkpoints
(``anchors.py``): a record written by hand can do nothing the commands refuse, and a damaged
ledger is never appended to. The kinds and the states are tabled in ``docs/overrides.md``.

Reading needs neither torch nor Megatron: the module table comes from ``layers.json``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import getpass
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Literal

from fp8ops.alerts.files import read_alerts
from fp8ops.alerts.records import Alert, decode_float, encode_float
from fp8ops.errors import Fp8opsError
from fp8ops.files import open_log, open_regular
from fp8ops.gemm_roles import GEMMS, describe, gemms_problem, in_order
from fp8ops.manifest.schema import Bf16Override, ModuleRecipe, Review
from fp8ops.overrides.anchors import AnchorError, RunAnchors, run_anchors
from fp8ops.overrides.chain import GENESIS, LedgerError, canonical_json, parse_chain, record_hash
from fp8ops.overrides.signing import (
    KEY_ENV,
    SIGNED_KINDS,
    AllowedSigners,
    sign,
    signed_body,
    signing_key,
)
from fp8ops.run import RunLayout, RunRecordError, find_status, read_run_record
from fp8ops.run.layout import OVERRIDES
from fp8ops.run.records import read_layers_json

LEDGER = OVERRIDES  # the ledger's file name (fp8ops.run.layout spells it)
ALERT_ENGINE = "fp8ops-alerts"  # who proposes: any person may approve its proposals
MIN_PREFIX = 6  # hex digits of an id a user must give, like git's short hashes


class OverrideError(Fp8opsError):
    """An action on the ledger is refused: unknown module or id, wrong state, self-approval."""


Status = Literal["proposed", "staged", "approved", "applied", "rejected", "revoked"]
OPEN: frozenset[str] = frozenset({"proposed", "staged", "approved", "applied"})


def policy_approver(revision: str) -> str:
    """Who approves in the ledger when the auto-degrade policy of manifest ``revision`` acts."""
    return f"auto-degrade policy of revision {revision[:12]}"


def default_user() -> str:
    """Who acts when nobody is named: ``$FP8OPS_USER``, else the login name."""
    return os.environ.get("FP8OPS_USER") or getpass.getuser()


def _same_person(a: str, b: str) -> bool:
    """Names as the review rule compares them: "Ana" and "ana " are one operator."""
    return a.strip().casefold() == b.strip().casefold()


# --------------------------------------------------------------------------------------
# What the records describe
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trigger:
    """A telemetry value that made someone want the override: the metric, what it was, the
    threshold it crossed, and the alert (level, rule, step) that reported it."""

    metric: str
    value: float | None
    threshold: float | None
    level: str
    rule: str
    step: int

    @classmethod
    def from_alert(cls, alert: Alert) -> Trigger:
        return cls(
            metric=alert.metric or alert.rule,
            value=alert.value,
            threshold=alert.threshold,
            level=alert.level,
            rule=alert.rule,
            step=alert.step,
        )

    def to_json(self) -> dict[str, Any]:
        # JSON has no NaN or infinity, which are exactly what a Stop alert reports.
        return {
            **dataclasses.asdict(self),
            "value": encode_float(self.value),
            "threshold": encode_float(self.threshold),
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Trigger:
        return cls(
            metric=str(record["metric"]),
            value=decode_float(record["value"]),
            threshold=decode_float(record["threshold"]),
            level=str(record["level"]),
            rule=str(record["rule"]),
            step=int(record["step"]),
        )


@dataclass(frozen=True)
class Override:
    """One override as the ledger's records leave it, from its ``proposed``/``staged`` record
    (``id`` is that record's hash) through its decision, application and revocation."""

    id: str
    module: str
    dtype: str  # "bf16", or "fp8" under another recipe (``scaling``)
    status: Status
    origin: Literal["proposed", "staged"]  # proposed by the alert engine, or staged by a person
    reason: str
    who: str  # who proposed or staged it
    time: str
    triggers: tuple[Trigger, ...]
    step: int | None  # the training step it was staged at
    data_version: str | None  # run.json's data fingerprint then
    decided_by: str | None = None  # who approved or rejected it
    decision_note: str | None = None  # the approval's note or the rejection's reason
    approval: str | None = None  # hash of the approving record (the manifest's override.approval)
    applied_step: int | None = None  # the resume step that switched the module to BF16
    applied_revision: str | None = None  # sha256 of the manifest revision that did
    revoked_by: str | None = None
    revoke_reason: str | None = None
    lifted_step: int | None = None  # after revocation: the resume that returned it to FP8
    lifted_revision: str | None = None
    scaling: str | None = None  # "current": the module stays FP8 under current scaling
    policy: str | None = None  # approved by the auto-degrade policy of this manifest revision
    # The GEMMs it takes to BF16 (fp8ops.gemm_roles), in order; None: all three (every record
    # written before per-GEMM overrides)
    gemms: tuple[str, ...] | None = None

    @property
    def target(self) -> str:
        """Where the override puts the module, in words: "bf16", "bf16 (dgrad, wgrad)" or
        "current scaling"."""
        if self.scaling is not None:
            return f"{self.scaling} scaling"
        return "bf16" if self.gemms is None else f"bf16 ({', '.join(self.gemms)})"

    @property
    def is_open(self) -> bool:
        """Proposed, staged, approved or applied: the module's one live override."""
        return self.status in OPEN

    @property
    def to_lift(self) -> bool:
        """Revoked after it was applied, and no resume has returned the module to FP8 yet."""
        return (
            self.status == "revoked" and self.applied_step is not None and self.lifted_step is None
        )

    def as_manifest_override(self) -> Bf16Override | ModuleRecipe:
        """The manifest entry a resume writes for this (approved) override: a
        ``precision.overrides`` entry, or for current scaling a ``precision.module_recipes``
        one naming just this module."""
        if self.scaling is not None:
            return ModuleRecipe(
                modules=(self.module,),
                scaling=self.scaling,
                reason=self.reason,
                approval=self.approval,
            )
        return Bf16Override(
            module=self.module,
            dtype="bf16",
            reason=self.reason,
            approval=self.approval,
            policy=self.policy,
            gemms=self.gemms,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "triggers": [t.to_json() for t in self.triggers],
            "gemms": None if self.gemms is None else list(self.gemms),
        }


# --------------------------------------------------------------------------------------
# The state machine: records folded into overrides
# --------------------------------------------------------------------------------------

# Which statuses each decision may follow; everything else is refused with _NEXT's advice.
_FROM: dict[str, frozenset[str]] = {
    "approved": frozenset({"proposed", "staged"}),
    "rejected": frozenset({"proposed", "staged"}),
    "revoked": OPEN,
}
_NEXT = {
    "approved": "it is applied at the next resume; revoke it to withdraw it",
    "applied": "the module runs in BF16; revoke it to return the module to FP8 at the next resume",
    "rejected": "a rejected override is final; stage a new one",
    "revoked": "a revoked override is final; stage a new one",
}


def _describe(o: Override) -> str:
    return f"override {o.id[:12]} ({o.module}, {o.status})"


def _check_transition(o: Override, kind: str) -> None:
    if o.status not in _FROM[kind]:
        verb = {"approved": "approve", "rejected": "reject", "revoked": "revoke"}[kind]
        raise OverrideError(f"cannot {verb} {_describe(o)}: {_NEXT[o.status]}")


def _open_conflict(overrides: Mapping[str, Override], module: str) -> Override | None:
    return next((o for o in overrides.values() if o.module == module and o.is_open), None)


def _apply(overrides: dict[str, Override], record: Mapping[str, Any]) -> None:
    """Fold one record into ``overrides`` (id -> Override), refusing what the rules forbid."""
    kind, who = record["kind"], record["who"]
    if kind in ("proposed", "staged"):
        existing = _open_conflict(overrides, record["module"])
        if existing is not None:
            raise OverrideError(_conflict_message(existing))
        overrides[record["hash"]] = Override(
            id=record["hash"],
            module=record["module"],
            dtype=record["dtype"],
            scaling=record.get("scaling"),  # records written before current staging lack it
            status=kind,
            origin=kind,
            reason=record["reason"],
            who=who,
            time=record["time"],
            triggers=tuple(Trigger.from_json(t) for t in record["triggers"]),
            step=record["step"],
            data_version=record["data_version"],
            gemms=None if record.get("gemms") is None else tuple(record["gemms"]),
        )
    elif kind in ("approved", "rejected", "revoked"):
        o = _known(overrides, record["override"])
        _check_transition(o, kind)
        if kind == "approved":
            change = {
                "decided_by": who,
                "decision_note": record["note"],
                "approval": record["hash"],
                "policy": record.get("policy"),  # only a policy's approvals carry one
            }
        elif kind == "rejected":
            change = {"decided_by": who, "decision_note": record["reason"]}
        else:
            change = {"revoked_by": who, "revoke_reason": record["reason"]}
        overrides[o.id] = dataclasses.replace(o, status=kind, **change)
    elif kind == "applied":
        for override_id in record["overrides"]:
            o = _known(overrides, override_id)
            step, revision = record["step"], record["revision"]
            if o.status == "approved":
                overrides[o.id] = dataclasses.replace(
                    o, status="applied", applied_step=step, applied_revision=revision
                )
            elif o.to_lift:
                overrides[o.id] = dataclasses.replace(o, lifted_step=step, lifted_revision=revision)
            else:
                raise OverrideError(
                    f"a resume cannot apply {_describe(o)}: only approved overrides are applied "
                    "and only revoked applied ones lifted (Ledger.pending_for_resume)"
                )
    else:
        raise OverrideError(f"unknown record kind {kind!r}")


def _known(overrides: Mapping[str, Override], override_id: str) -> Override:
    if override_id not in overrides:
        raise OverrideError(f"no override has the id {override_id}")
    return overrides[override_id]


def _conflict_message(existing: Override) -> str:
    by = f", approved by {existing.decided_by}" if existing.decided_by else ""
    return (
        f"{existing.module} already has an open override: {existing.id[:12]} ({existing.status}, "
        f"{existing.origin} by {existing.who}{by}); a module has at most one. Revoke that one "
        f"first (fp8ops overrides revoke RUN_DIR {existing.id[:12]} --reason ...)"
    )


# --------------------------------------------------------------------------------------
# The rules a record must meet, signed or not
# --------------------------------------------------------------------------------------

# What a refusal says the rule is, on read (the ledger then cannot be trusted) and on write.
_RULE = "No fp8ops command writes such a record, signed or not"
_SIGNED = "The run's manifest requires signed records (review.require_signatures)"


def _problem(
    record: Mapping[str, Any],
    overrides: Mapping[str, Override],
    anchors: RunAnchors,
    signers: AllowedSigners | None,
) -> tuple[str, str] | None:
    """(why, the rule) when ``record``, following the records that left ``overrides``, breaks a
    rule the commands enforce when they write it; None when it does not. Checked on every read
    and every append, whether the ledger is signed or not: a proposal is the alert engine's; a
    ``policy`` key only on an approval its policy could have written (:func:`_policy_problem`);
    nobody stages under the alert engine's name; an operator does not approve what they staged
    unless a revision of the run allowed it (``anchors``: the run's revisions held to its
    checkpoint). ``signers`` (where signatures are required): an operator's record must be
    signed by a key they bind to its ``who``. The state machine is :func:`_apply`'s."""
    try:
        kind, who = record["kind"], record["who"]
        if not isinstance(who, str) or not who.strip():
            return "it names nobody as its writer", _RULE
        for field in ("who", "reason", "note", "module"):
            text = record.get(field)
            found = _control_character(text) if isinstance(text, str) else None
            if found is not None:
                return f"its {field} holds {found}", _RULE
        if "gemms" in record:
            problem = _gemms_problem(record)
            if problem is not None:
                return problem, _RULE
        if "policy" in record:
            if kind != "approved":
                return f"a {kind} record carries a policy: only a policy's approval does", _RULE
            problem = _policy_problem(record, overrides, anchors)
            return None if problem is None else (problem, _RULE)
        if kind == "proposed" and who != ALERT_ENGINE:
            return f"a proposal written as {who!r}: only the alert engine proposes", _RULE
        if kind == "staged" and _same_person(who, ALERT_ENGINE):
            return "staged under the alert engine's name: an operator stages as themselves", _RULE
        if signers is not None and _by_a_person(record):
            problem = _signature_problem(record, signers)
            if problem is not None:
                return problem, _SIGNED
        origin = overrides.get(record["override"]) if kind == "approved" else None
        if (
            origin is not None
            and _same_person(origin.who, who)
            and not anchors.allows_self_approval(record["seq"])
        ):
            return (
                f"{who} {origin.origin} {_describe(origin)} and cannot approve it too: another "
                "operator must (a one-person team sets review.allow_self_approval: true in the "
                "run's manifest)",
                _RULE,
            )
    except Fp8opsError:
        raise  # the run's files (a revision, events.jsonl) could not be read: not the record's
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        return f"not a valid record ({type(exc).__name__}: {exc})", _RULE
    return None


def _gemms_problem(record: Mapping[str, Any]) -> str | None:
    """Why a record's ``gemms`` is not one the commands write (None: it is): only a BF16
    proposal or staging carries one, a list of some of fprop, dgrad and wgrad, in that order."""
    gemms, kind = record["gemms"], record["kind"]
    if kind not in ("proposed", "staged") or record.get("scaling") is not None:
        return f"a {kind} record carries gemms: only a BF16 proposal or staging does"
    if not isinstance(gemms, list) or not all(isinstance(g, str) for g in gemms):
        return f"its gemms is not a list of GEMM names ({gemms!r})"
    problem = gemms_problem(gemms)
    if problem is None and tuple(gemms) != in_order(gemms):
        problem = f"its gemms are not in the order {', '.join(GEMMS)}"
    return None if problem is None else f"its gemms: {problem}"


def _signature_problem(record: Mapping[str, Any], signers: AllowedSigners) -> str | None:
    """Why an operator's record is not proven written by its ``who`` (None: it is, or no person
    writes records of its kind)."""
    if not _by_a_person(record):
        return None
    try:
        return signers.problem(dict(record))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        return f"not a valid record ({type(exc).__name__}: {exc})"


def _refusal(
    record: Mapping[str, Any], problem: str, rule: str, signers: AllowedSigners | None
) -> str:
    """An append's refusal of ``record``: what is wrong, and how to write it instead."""
    said = f"refused: the {record['kind']} record by {record['who']}: {problem}"
    if rule == _SIGNED and signers is not None:
        return (
            f"{said} (review.require_signatures); sign with --key KEY (or ${KEY_ENV}): a key "
            f"{signers.path} lists for {record['who']}"
        )
    if "policy" in record:
        return f"{said}; only the run's own auto-degrade policy writes a policy's approval"
    return said


def _by_a_person(record: Mapping[str, Any]) -> bool:
    """An operator's record, which is signed; the alert engine's proposals, a resume's
    ``applied`` and the auto-degrade policy's approvals are not."""
    return record["kind"] in SIGNED_KINDS and "policy" not in record


def _policy_problem(
    record: Mapping[str, Any], overrides: Mapping[str, Override], anchors: RunAnchors
) -> str | None:
    """Why the auto-degrade policy could not have written this approval (None: it could): the
    policy must be a revision of the run held to its checkpoint (``anchors``), the approval its
    own, of an alert engine's BF16 proposal triggered by one of its rules by its until_step,
    within its max_modules (policy approvals in the whole ledger, revoked ones too)."""
    policy = str(record["policy"])
    manifest = anchors.revision(policy)
    rules = None if manifest is None else manifest.alerts.auto_degrade
    if rules is None:
        return (
            f"approved as an auto-degrade policy, but {policy[:12]} is no revision of this "
            "run's manifest chain with alerts.auto_degrade"
        )
    if record["who"] != policy_approver(policy):
        return f"a policy's approval written as {record['who']!r}"
    origin = overrides.get(record["override"])
    if origin is None or origin.origin != "proposed" or origin.who != ALERT_ENGINE:
        return "a policy approves only the alert engine's proposals"
    if origin.scaling is not None:
        return "a policy approves only BF16 proposals"
    if not any(rules.acts_on(t.rule, origin.step or 0) for t in origin.triggers):
        return (
            f"its proposal (step {origin.step}) was triggered by none of the policy's rules "
            f"({', '.join(rules.rules)}) by its until_step"
        )
    nth = 1 + sum(o.policy is not None for o in overrides.values())
    if nth > rules.max_modules:
        return f"the policy's approval number {nth}, past its max_modules {rules.max_modules}"
    return None


# --------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------


class Ledger:
    """``run_dir/overrides.jsonl``: read, verified, and appended to under a file lock.

    Appends hold an exclusive ``flock`` on the ledger file itself from reading it to the
    ``fsync`` of the new line(s), so writers in several processes (the trainer's alert engine,
    operators' CLIs) never lose or interleave records; readers hold a shared one, so they never
    see half a line. Locking the ledger rather than a separate lock file keeps a read-only run
    directory readable and leaves no stray file behind.
    """

    def __init__(
        self,
        run_dir: str | Path,
        key: str | Path | None = None,
        anchors: RunAnchors | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.key = signing_key(key)  # signs this operator's records (signing.py); None: unsigned
        # The rules reads are held to (anchors.py); None: found afresh for each read and append.
        self.given_anchors = anchors
        self.layout = RunLayout(self.run_dir)
        self.path = self.layout.overrides
        if not self.run_dir.is_dir():
            what = "is not a directory" if self.run_dir.exists() else "no such run directory"
            raise OverrideError(f"{self.run_dir}: {what}")
        if not self.layout.is_run():
            raise OverrideError(
                f"{self.run_dir}: not an fp8ops run directory (no status.json or manifest.yaml); "
                "give the directory a run writes"
            )

    # -- reading ------------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """Every record, read under every rule (:meth:`_read`); :class:`LedgerError` names the
        first bad line."""
        return self._read()[0]

    def verify(self) -> int:
        """Read the ledger under every rule (:meth:`_read`); the number of records."""
        return len(self.records())

    def unverified(self) -> list[str]:
        """Every operator's record whose signature does not prove who wrote it, one line each
        (empty when the manifest names no allowed signers; with ``review.require_signatures``
        reading the ledger already refuses the first)."""
        anchors = self._anchors()
        records = self._read(anchors)[0]
        signers = self._signers(anchors.review)
        if signers is None:
            return []
        return [
            f"{self.path}, line {n}: {_what(record)}: {problem}"
            for n, record in enumerate(records, 1)
            if (problem := _signature_problem(record, signers)) is not None
        ]

    def anchor(self) -> dict[str, Any] | None:
        """What a checkpoint records of the ledger: its number of records and the last one's
        hash (None: no ledger yet). A chain rewritten from the first line with fresh hashes no
        longer has that hash at that position."""
        records = self.records()
        return {"records": len(records), "head": records[-1]["hash"]} if records else None

    def overrides(self) -> dict[str, Override]:
        """Every override, id -> :class:`Override`, in the order they were proposed or staged."""
        return self._read()[1]

    def get(self, ref: str) -> Override:
        """The override whose id is ``ref`` or starts with it (at least 6 hex digits)."""
        overrides = self.overrides()
        return overrides[self._resolve(overrides, ref)]

    def pending_for_resume(self) -> list[Override]:
        """What the next resume must do: apply the approved overrides (status ``approved``) and
        lift the applied ones revoked since (``to_lift``: the module returns to FP8)."""
        return [o for o in self.overrides().values() if o.status == "approved" or o.to_lift]

    def active_fallbacks(self) -> list[Override]:
        """The overrides the run applies now: applied and not revoked."""
        return [o for o in self.overrides().values() if o.status == "applied"]

    # -- writing ------------------------------------------------------------------------------

    def stage(
        self,
        module: str,
        reason: str,
        who: str | None = None,
        triggers: Iterable[Trigger | Alert] | None = None,
        step: int | None = None,
        to: Literal["bf16", "current"] = "bf16",
        gemms: Sequence[str] | None = None,
    ) -> Override:
        """An operator asks for ``module`` in BF16 (or, ``to="current"``, in FP8 under current
        scaling); another operator must approve it. ``gemms``: only these of its GEMMs to BF16
        (fprop, dgrad, wgrad; None: all three).

        ``triggers`` default to the latest alert per metric for the module in ``alerts.jsonl``;
        ``step`` to ``status.json``'s step.
        """
        return self.stage_many(
            [module], reason, who, triggers=triggers, step=step, to=to, gemms=gemms
        )[0]

    def stage_many(
        self,
        modules: Sequence[str],
        reason: str,
        who: str | None = None,
        triggers: Iterable[Trigger | Alert] | None = None,
        step: int | None = None,
        to: Literal["bf16", "current"] = "bf16",
        gemms: Sequence[str] | None = None,
    ) -> list[Override]:
        """:meth:`stage` for several modules at once: all are staged or none is."""
        if to not in ("bf16", "current"):
            raise OverrideError(f"an override takes a module to 'bf16' or 'current', not {to!r}")
        gemms = _checked_gemms(gemms, to)
        reason, who = _text(reason, "a reason"), _text(who or default_user(), "a user name")
        if _same_person(who, ALERT_ENGINE):
            raise OverrideError(
                f"{who!r} is the alert engine's name (its proposals may be approved by anyone): "
                "stage under your own name"
            )
        twice = sorted(module for module, n in Counter(modules).items() if n > 1)
        if twice:
            raise OverrideError(f"{twice[0]} is named more than once: stage each module once")
        given = None if triggers is None else _triggers(triggers)
        step = self._status_step() if step is None else step

        def build(overrides: dict[str, Override]) -> list[dict[str, Any]]:
            for module in modules:
                self._check_module(overrides, module, to, gemms)
            return [
                self._proposal(
                    "staged",
                    module,
                    reason,
                    who,
                    step,
                    given if given is not None else self._alert_triggers(module),
                    to,
                    gemms,
                )
                for module in modules
            ]

        written, overrides = self._append(build)
        return [overrides[record["hash"]] for record in written]

    def propose(
        self,
        module: str,
        reason: str,
        triggers: Iterable[Trigger | Alert],
        step: int,
        who: str = ALERT_ENGINE,
        gemms: Sequence[str] | None = None,
    ) -> Override | None:
        """The alert engine proposes ``module`` in BF16 (``gemms``: only these of its GEMMs, as
        an auto-degrade policy of ``granularity: gemm`` chooses them); any person may approve it.

        None when the module already has an open override: training never fails on a repeated
        alert.
        """
        reason, found = _text(reason, "a reason"), _triggers(triggers)
        gemms = _checked_gemms(gemms, "bf16")

        def build(overrides: dict[str, Override]) -> list[dict[str, Any]]:
            if _open_conflict(overrides, module) is not None:
                return []
            self._check_module(overrides, module, gemms=gemms)
            return [self._proposal("proposed", module, reason, who, step, found, gemms=gemms)]

        written, overrides = self._append(build)
        return overrides[written[0]["hash"]] if written else None

    def approve(
        self,
        ref: str,
        who: str | None = None,
        note: str | None = None,
        policy: str | None = None,
    ) -> Override:
        """Approve an override; the approver must not be who staged it, unless the run's
        manifest sets ``review.allow_self_approval: true``. ``policy``: the sha256 of the
        manifest revision whose auto-degrade policy approves it (the trainer's, not a person's)."""
        who = _text(who or default_user(), "a user name")
        if policy is not None and not re.fullmatch(r"[0-9a-f]{64}", policy):
            raise OverrideError(f"approve: policy {policy!r} is not a manifest sha256")

        def build(overrides: dict[str, Override]) -> list[dict[str, Any]]:
            o = overrides[self._resolve(overrides, ref)]
            _check_transition(o, "approved")
            # Who may approve is a rule every record is held to (_problem), here as on read.
            record = {"kind": "approved", "override": o.id, "who": who, "note": note or None}
            return [record if policy is None else {**record, "policy": policy}]

        return _decided(*self._append(build))

    def reject(self, ref: str, reason: str, who: str | None = None) -> Override:
        """Reject an override (final). Anyone may: rejecting changes nothing in the run."""
        return self._decide("rejected", ref, reason, who)

    def revoke(self, ref: str, reason: str, who: str | None = None) -> Override:
        """Withdraw a proposed, staged, approved or applied override. An applied one is lifted
        at the next resume: the module returns to FP8."""
        return self._decide("revoked", ref, reason, who)

    def record_applied(
        self, ids: Sequence[str], step: int, revision: str, who: str | None = None
    ) -> list[Override]:
        """Record that the resume at ``step``, under the manifest revision whose sha256 is
        ``revision``, applied these approved overrides and lifted these revoked ones (ids from
        :meth:`pending_for_resume`)."""
        who = _text(who or default_user(), "a user name")
        if not ids:
            raise OverrideError("record_applied: no override ids given")
        if not re.fullmatch(r"[0-9a-f]{64}", revision):
            raise OverrideError(f"record_applied: revision {revision!r} is not a sha256")

        def build(overrides: dict[str, Override]) -> list[dict[str, Any]]:
            full = [self._resolve(overrides, ref) for ref in ids]
            return [
                {
                    "kind": "applied",
                    "overrides": full,
                    "step": int(step),
                    "revision": revision,
                    "who": who,
                }
            ]

        (record,), overrides = self._append(build)
        return [overrides[i] for i in record["overrides"]]

    # -- internals ----------------------------------------------------------------------------

    def _decide(self, kind: str, ref: str, reason: str, who: str | None) -> Override:
        reason, who = _text(reason, "a reason"), _text(who or default_user(), "a user name")

        def build(overrides: dict[str, Override]) -> list[dict[str, Any]]:
            o = overrides[self._resolve(overrides, ref)]
            _check_transition(o, kind)
            return [{"kind": kind, "override": o.id, "who": who, "reason": reason}]

        return _decided(*self._append(build))

    @contextmanager
    def _locked(self) -> Iterator[IO[bytes]]:
        with open_log(self.path) as f:  # created if absent, never through a link
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield f

    def _append(
        self, build: Callable[[dict[str, Override]], list[dict[str, Any]]]
    ) -> tuple[list[dict[str, Any]], dict[str, Override]]:
        """Under the lock: read the ledger as :meth:`_read` does, let ``build`` make records
        from the current state, hold each to the same rules, and write them in one ``write``
        followed by ``fsync``. A refused record (OverrideError) writes nothing. The records
        written and the state after them."""
        anchors = self._anchors()
        if not self.path.exists():
            self._check_anchors([], anchors)  # a ledger a checkpoint saw is gone: not recreated
        signers = self._required_signers(anchors)
        with self._locked() as f:
            f.seek(0)
            records, overrides = self._checked(f.read(), anchors, signers)
            prev = records[-1]["hash"] if records else GENESIS
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            sealed, lines = [], []
            for body in build(overrides):
                record = {**body, "seq": len(records) + len(sealed), "prev": prev, "time": now}
                if _by_a_person(record) and self.key is not None:
                    record["signature"] = sign(signed_body(record), self.key)
                record["hash"] = record_hash(record)
                found = _problem(record, overrides, anchors, signers)
                if found is not None:
                    raise OverrideError(_refusal(record, *found, signers))
                prev = record["hash"]
                _apply(overrides, record)
                sealed.append(record)
                lines.append(canonical_json(record) + "\n")
            if lines:
                # One write of whole lines: a crash tears at most the last one (verify says so).
                f.write("".join(lines).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        return sealed, overrides

    def _anchors(self) -> RunAnchors:
        """The rules this read or append holds the ledger to (``anchors.py``)."""
        if self.given_anchors is not None:
            return self.given_anchors
        try:
            return run_anchors(self.run_dir)
        except AnchorError as exc:
            raise OverrideError(str(exc)) from None

    def _signers(self, review: Review) -> AllowedSigners | None:
        if review.allowed_signers is None:
            return None
        return AllowedSigners.load(review.allowed_signers, review.allowed_signers_sha256)

    def _required_signers(self, anchors: RunAnchors) -> AllowedSigners | None:
        """The allowed signers where the run requires signatures (None: it does not)."""
        return self._signers(anchors.review) if anchors.review.require_signatures else None

    def _read(self, anchors: RunAnchors | None = None):
        """The one reader, behind every read and every append: the hash chain (``chain.py``),
        every checkpoint's anchor, the rules every record must meet, signed or not
        (:func:`_problem`: what the commands enforce when they write, so a record written by
        hand can do nothing they refuse), the signatures where the run requires them, and the
        state machine (:func:`_apply`). Returns (records, overrides)."""
        anchors = self._anchors() if anchors is None else anchors
        signers = self._required_signers(anchors)
        try:  # a link (maybe to another run's ledger) or a FIFO is refused, never followed
            ledger = open_regular(self.path)
        except FileNotFoundError:
            return self._checked(None, anchors, signers)
        except Fp8opsError as exc:
            raise LedgerError(str(exc)) from None
        with ledger as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # an append in flight is never read half-written
            return self._checked(f.read(), anchors, signers)

    def _checked(self, data: bytes | None, anchors: RunAnchors, signers: AllowedSigners | None):
        """:meth:`_read` of the file's bytes (None: no file)."""
        records = [] if data is None else parse_chain(self.path, data)
        self._check_anchors(records, anchors)
        overrides: dict[str, Override] = {}
        for n, record in enumerate(records, 1):
            found = _problem(record, overrides, anchors, signers)
            if found is not None:
                problem, rule = found
                raise LedgerError(
                    f"{self.path}, line {n}: {_what(record)}: {problem}. {rule}: the ledger "
                    "cannot be trusted or appended to; restore it from a copy"
                )
            try:
                _apply(overrides, record)
            except OverrideError as exc:
                raise LedgerError(f"{self.path}, line {n}: {exc}") from None
            except (KeyError, TypeError, ValueError) as exc:
                detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
                raise LedgerError(f"{self.path}, line {n}: not a valid record ({detail})") from None
        return records, overrides

    def _check_anchors(self, records: list[dict[str, Any]], anchors: RunAnchors) -> None:
        """The ledger still holds the records every checkpoint saw (its ``ledger`` anchor)."""
        for checkpoint, anchor in anchors.ledger:
            n, head = anchor.records, anchor.head
            if len(records) >= n and records[n - 1]["hash"] == head:
                continue
            if not self.path.exists():
                found = "the ledger is gone"
            elif len(records) < n:
                found = f"it has {len(records)} record(s)"
            else:
                found = f"its record {n} has hash {records[n - 1]['hash'][:12]}"
            raise LedgerError(
                f"{self.path}: checkpoint {checkpoint.name} saw {n} ledger record(s) ending in "
                f"{head[:12]}, but {found}: the ledger was deleted, rewritten or cut short after "
                "that checkpoint. Restore it from a copy; nothing reads it until then."
            )

    def _resolve(self, overrides: Mapping[str, Override], ref: str) -> str:
        ref = ref.strip().lower()
        if not re.fullmatch(rf"[0-9a-f]{{{MIN_PREFIX},64}}", ref):
            raise OverrideError(
                f"{ref!r} is not an override id: give its sha256 or a unique prefix of at least "
                f"{MIN_PREFIX} hex digits (fp8ops overrides list {self.run_dir})"
            )
        found = [i for i in overrides if i.startswith(ref)]
        if not found:
            raise OverrideError(
                f"no override in {self.path} has an id starting with {ref} "
                f"(fp8ops overrides list {self.run_dir} --all)"
            )
        if len(found) > 1:
            raise OverrideError(
                f"{ref} is ambiguous: {len(found)} override ids start with it "
                f"({', '.join(i[:12] for i in found)}); give more digits"
            )
        return found[0]

    def _check_module(
        self,
        overrides: Mapping[str, Override],
        module: str,
        to: str = "bf16",
        gemms: tuple[str, ...] | None = None,
    ) -> None:
        """``module`` must be a module of this run that runs FP8 and has no open override; for
        ``to="current"``, one that does not run current scaling already, on a backend that runs
        per-module recipes; for some ``gemms``, one whose named GEMMs run FP8 now, on fp8ops'
        own layers."""
        existing = _open_conflict(overrides, module)
        if existing is not None:
            raise OverrideError(_conflict_message(existing))
        layers = read_layers_json(self.run_dir)
        rows = {row.fqn: row for row in layers.rows}
        row = rows.get(module)
        if row is None:
            close = difflib.get_close_matches(module, list(rows), n=3)
            hint = (
                f"did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else (f"fp8ops inspect {self.run_dir} --layers lists them")
            )
            raise OverrideError(f"'{module}' is not a module of this run (layers.json); {hint}")
        # A revoked applied override still holds its module in BF16 until the next resume lifts
        # it; staging it again keeps it there.
        relapse = any(o.module == module and o.to_lift for o in overrides.values())
        if not row.fp8 and not (row.reason.code == "override" and relapse):
            raise OverrideError(
                f"{module} already runs in {row.precision}, not FP8 ({row.reason.code}: "
                f"{row.reason.text}); there is nothing to override"
            )
        if to == "current":
            self._check_current(module, row.scaling or layers.recipe.scaling)
        if gemms is not None:
            self._check_gemms(module, row, gemms, relapse)

    def _check_gemms(self, module: str, row, gemms: tuple[str, ...], relapse: bool) -> None:
        backend = self._anchors().locked.precision.backend
        if backend == "te":
            raise OverrideError(
                f"{module}: this run's precision.backend is 'te', which takes a module's GEMMs "
                "all in or all out of FP8 in fp8ops; stage the whole module (no --gemms)"
            )
        high = [g for g in gemms if g not in row.fp8_gemms]
        if high and not relapse:
            raise OverrideError(
                f"{module} runs {describe(high)} in {_high_dtype(row)} already "
                f"({row.gemm_summary()}); name only GEMMs that run FP8 (gemms)"
            )

    def _check_current(self, module: str, scaling: str) -> None:
        if scaling == "current":
            raise OverrideError(
                f"{module} already runs current scaling (layers.json); stage it to 'bf16' instead"
            )
        backend = self._anchors().locked.precision.backend
        if backend == "te":
            raise OverrideError(
                f"{module}: this run's precision.backend is 'te', which runs no per-module "
                "recipes in fp8ops yet; stage it to 'bf16' instead"
            )

    def _proposal(
        self,
        kind: str,
        module: str,
        reason: str,
        who: str,
        step: int | None,
        triggers: list[Trigger],
        to: str = "bf16",
        gemms: tuple[str, ...] | None = None,
    ) -> dict[str, Any]:
        target = {"dtype": "bf16"} if to == "bf16" else {"dtype": "fp8", "scaling": to}
        if gemms is not None:  # absent: all three, as every record before per-GEMM overrides
            target["gemms"] = list(gemms)
        return {
            "kind": kind,
            "module": module,
            **target,
            "reason": reason,
            "who": who,
            "triggers": [t.to_json() for t in triggers],
            "step": step,
            "data_version": self._data_version(),
        }

    def _alert_triggers(self, module: str) -> list[Trigger]:
        """The latest alert per metric for ``module`` in alerts.jsonl, by metric name."""
        latest = {a.metric or a.rule: a for a in read_alerts(self.run_dir) if a.module == module}
        return [Trigger.from_alert(latest[metric]) for metric in sorted(latest)]

    def _status_step(self) -> int | None:
        status = self._run_file(find_status)
        return status.step if status is not None else None

    def _data_version(self) -> str | None:
        """``run.json``'s data fingerprint, recorded with a proposal (None before the run
        wrote its record)."""
        if not self.layout.run_record.is_file():
            return None
        data = self._run_file(read_run_record).data
        return data.fingerprint if data is not None else None

    def _run_file(self, reader):
        try:
            return reader(self.run_dir)
        except RunRecordError as exc:
            raise OverrideError(str(exc)) from None


def _what(record: Mapping[str, Any]) -> str:
    about = record.get("override") or record.get("hash", "")
    kind, who = record.get("kind", "unknown"), record.get("who", "nobody")
    return f"the {kind} record by {who} (override {str(about)[:12]})"


def _decided(records: list[dict[str, Any]], overrides: Mapping[str, Override]) -> Override:
    """The override a decision record was about, as the record left it."""
    return overrides[records[0]["override"]]


def _text(value: str, what: str) -> str:
    value = value.strip()
    if not value:
        raise OverrideError(f"give {what} (it is recorded in the ledger)")
    found = _control_character(value)
    if found is not None:
        raise OverrideError(f"{what} holds {found}; write it as plain text")
    return value


# Bidirectional overrides and isolates reorder what a reader sees ("Trojan Source").
_BIDI = frozenset(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]))


def _control_character(text: str) -> str | None:
    """The first character of ``text`` a terminal or a page would act on rather than show (a
    control character: an escape sequence can clear a reviewer's screen and paint "approved"
    over it, a newline a row of its own; a bidirectional override), described; None if none."""
    for position, char in enumerate(text, 1):
        if unicodedata.category(char) == "Cc" or char in _BIDI:
            return f"a control character (U+{ord(char):04X} at position {position})"
    return None


def _checked_gemms(gemms: Sequence[str] | None, to: str) -> tuple[str, ...] | None:
    """``gemms`` as a proposal records them: in the order fprop, dgrad, wgrad; None for all
    three (named or not), so an override of the whole module reads as every override did
    before per-GEMM ones."""
    if gemms is None:
        return None
    gemms = list(gemms)
    problem = gemms_problem(gemms)
    if problem is not None:
        raise OverrideError(f"gemms: {problem}")
    if to != "bf16":
        raise OverrideError(
            f"gemms: takes some GEMMs to bf16; a module under {to} scaling runs all three in "
            "it (stage it without gemms)"
        )
    ordered = in_order(gemms)
    return None if ordered == GEMMS else ordered


def _high_dtype(row) -> str:
    """The dtype a layers.json row's high-precision GEMMs run in."""
    found = [g.precision for _, g in row.gemms.items() if g.precision != "fp8"] if row.gemms else []
    return found[0] if found else row.precision


def _triggers(items: Iterable[Trigger | Alert]) -> list[Trigger]:
    return [t if isinstance(t, Trigger) else Trigger.from_alert(t) for t in items]
