"""What a checklist item reports: a verdict per piece of evidence, and the item's verdict.

An item is made of findings, each one line a person can act on (``python 3.11.7``, ``data.
fingerprint is not pinned; pin it with ...``). The item fails when any finding fails, passes when
at least one passes and none fails, and is n/a when nothing applied (FP8 state on a BF16 run).
A skipped item (``--skip``) is neither: it is reported as skipped and never counts as passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["pass", "fail", "n/a", "skipped"]


@dataclass(frozen=True)
class Item:
    """One line of the checklist."""

    number: int
    key: str  # what --skip and the JSON call it
    title: str


ITEMS = (
    Item(1, "versions", "Versions fixed"),
    Item(2, "version-control", "Manifest and layer lists under version control"),
    Item(3, "fingerprints", "Fingerprints recorded"),
    Item(4, "fp8-state", "FP8 state survives save -> load unchanged"),
    Item(5, "bf16-control", "BF16 control reproduces"),
    Item(6, "telemetry", "Per-layer metrics present"),
    Item(7, "gates", "Hard gates and alert thresholds defined"),
    Item(8, "fallback", "BF16 fallback rehearsed"),
    Item(9, "topology", "Topology-change restore validated"),
)


@dataclass(frozen=True)
class Finding:
    outcome: Literal["pass", "fail", "n/a"]
    text: str


@dataclass
class Evidence:
    """What an item found, built up a line at a time; ``facts`` are the values behind the lines
    for programs (the fingerprint to pin, the losses compared)."""

    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def ok(self, text: str) -> None:
        self.findings.append(Finding("pass", text))

    def fail(self, text: str) -> None:
        self.findings.append(Finding("fail", text))

    def na(self, text: str) -> None:
        self.findings.append(Finding("n/a", text))

    def check(self, passed: bool, ok: str, fail: str) -> bool:
        (self.ok if passed else self.fail)(ok if passed else fail)
        return passed


@dataclass
class ItemResult:
    item: Item
    evidence: Evidence
    seconds: float
    skipped: bool = False

    @property
    def outcome(self) -> Outcome:
        if self.skipped:
            return "skipped"
        outcomes = {f.outcome for f in self.evidence.findings}
        if "fail" in outcomes:
            return "fail"
        return "pass" if "pass" in outcomes else "n/a"

    def to_json(self) -> dict[str, Any]:
        return {
            "item": self.item.number,
            "key": self.item.key,
            "title": self.item.title,
            "result": self.outcome,
            "seconds": round(self.seconds, 2),
            "evidence": [{"result": f.outcome, "text": f.text} for f in self.evidence.findings],
            "facts": self.evidence.facts,
        }


def find_item(name: str) -> Item:
    """The item ``--skip`` names, by number or key; ValueError lists them otherwise."""
    for item in ITEMS:
        if name in (str(item.number), item.key):
            return item
    choices = ", ".join(f"{i.number} ({i.key})" for i in ITEMS)
    raise ValueError(f"{name!r} is not a checklist item; choose from {choices}")
