"""The auto-degrade policy (``alerts.auto_degrade``): which Degrade proposals switch their module
to BF16 during training, without a person.

Pure and deterministic: every rank picks the same proposals from the same gathered alerts and
the same manifest; rank 0 then checks them against the ledger (fp8ops.train.degrade).
"""

from __future__ import annotations

from collections.abc import Sequence

from fp8ops.alerts.records import Proposal


def policy_switches(policy, proposals: Sequence[Proposal], *, step: int) -> list[Proposal]:
    """The proposals of ``step`` that ``policy`` (the manifest's ``alerts.auto_degrade``, or
    None) lets act: an alert of one of its rules, at a step up to ``until_step``; in the
    proposals' order (most severe first). Its ``max_modules`` counts what the run's ledger holds,
    which only rank 0 reads (fp8ops.train.degrade)."""
    if policy is None:
        return []
    return [p for p in proposals if policy.acts_on(p.rule, step)]
