"""The auto-degrade policy (``alerts.auto_degrade``): which Degrade proposals switch their module
to BF16 during training, without a person, and (``granularity: gemm``) which of its GEMMs.

Pure and deterministic: every rank picks the same proposals from the same gathered alerts and
the same manifest; rank 0 then checks them against the ledger (fp8ops.train.degrade).

The cheapest sufficient switch (``granularity: gemm``): an alert names a tensor by its metric's
slot, and only the GEMMs that read that tensor in FP8 are taken to BF16 (``gemm_roles.READERS``):
input: fprop and wgrad; weight: fprop and dgrad; grad_output (saturating or underflowing
gradients): dgrad and wgrad. The forward output's error (``fp8_error``, ``fp8_error_growing``)
is fprop's alone. An alert that names no tensor (``grad_spike``: the weight gradient's norm,
made by every GEMM upstream) takes the whole module, as ``granularity: module`` always does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fp8ops.alerts.records import Alert, Proposal
from fp8ops.gemm_roles import GEMMS, READERS, in_order

# The rules whose metric is the forward output's, which fprop alone computes.
_FPROP_RULES = frozenset({"fp8_error", "fp8_error_growing"})


def policy_switches(policy, proposals: Sequence[Proposal], *, step: int) -> list[Proposal]:
    """The proposals of ``step`` that ``policy`` (the manifest's ``alerts.auto_degrade``, or
    None) lets act: an alert of one of its rules, at a step up to ``until_step``; in the
    proposals' order (most severe first). Its ``max_modules`` counts what the run's ledger holds,
    which only rank 0 reads (fp8ops.train.degrade)."""
    if policy is None:
        return []
    return [p for p in proposals if policy.acts_on(p.rule, step)]


def gemms_to_switch(policy, alerts: Iterable[Alert]) -> tuple[str, ...] | None:
    """The GEMMs a switch of ``policy`` takes to BF16 for a module whose proposing ``alerts`` (of
    one step) are these: None (all three) under ``granularity: module``, or when an alert of the
    policy's rules names no tensor; else the GEMMs that read the alerted tensors (module
    docstring). Alerts of rules the policy does not act on are left out: it acts on the others."""
    if policy is None or policy.granularity == "module":
        return None
    gemms: set[str] = set()
    for alert in alerts:
        if alert.rule not in policy.rules:
            continue
        slot = (alert.metric or "").partition(".")[0]
        if slot in READERS:
            gemms.update(READERS[slot])
        elif alert.rule in _FPROP_RULES:
            gemms.add("fprop")
        else:
            return None
    found = in_order(gemms)
    return None if not found or found == GEMMS else found
