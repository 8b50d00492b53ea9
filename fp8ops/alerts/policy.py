"""The auto-degrade policy (``alerts.auto_degrade``): which Degrade proposals switch their module
to BF16 during training, without a person.

Pure and deterministic: every rank decides from the same gathered alerts and the same manifest,
so every rank switches the same modules at the same step boundary with no extra collective.
"""

from __future__ import annotations

from collections.abc import Sequence

from fp8ops.alerts.records import Proposal


def policy_switches(policy, proposals: Sequence[Proposal], *, step: int) -> list[Proposal]:
    """The proposals of ``step`` that ``policy`` (the manifest's ``alerts.auto_degrade``, or
    None) lets act: an alert of one of its rules, at a step up to ``until_step``; in the
    proposals' order (most severe first). Its ``max_modules`` counts what the run's ledger holds,
    which only rank 0 reads (fp8ops.train.degrade)."""
    if policy is None or (policy.until_step is not None and step > policy.until_step):
        return []
    return [p for p in proposals if p.rule in policy.rules]
