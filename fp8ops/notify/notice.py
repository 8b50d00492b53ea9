"""What a notification says: a step's alerts, each with what the run did about it, and where
to look (:class:`Notice`).

Every alert of a step goes out in one notice (a step that trips six modules is one message, not
six), after ``alerts.jsonl`` has them. What the run did, per alert (:func:`action_of`):

* ``stopped``: a Stop alert; the run saves a checkpoint of the step, marks itself stopped and
  exits 3, and resumes once the alert is answered (docs/telemetry.md);
* ``auto-degraded``: the manifest's ``alerts.auto_degrade`` policy switched the module to BF16
  before the next step; training goes on;
* ``proposed``: a BF16 override of the module was proposed in the ledger, for review;
* ``logged``: nothing else (an observe alert, or a degrade alert of no FP8 module).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from fp8ops.alerts.records import SEVERITY

ACTIONS = ("stopped", "auto-degraded", "proposed", "logged")  # what the run did, strongest first


def action_of(
    alert: dict[str, Any], *, proposed: Collection[str], switched: Collection[str]
) -> str:
    """What the run did about ``alert`` (a ``to_json()`` record): ``proposed`` and ``switched``
    are the modules the step's proposals and the auto-degrade policy's switch name."""
    if alert["level"] == "stop":
        return "stopped"
    module = alert.get("module")
    if alert["level"] == "degrade" and module is not None:
        if module in switched:
            return "auto-degraded"
        if module in proposed:
            return "proposed"
    return "logged"


@dataclass(frozen=True)
class RunInfo:
    """Which run: its directory (absolute), ``run.json``'s run id, the manifest's name, the
    host rank 0 runs on."""

    dir: str
    id: str | None
    name: str
    host: str


@dataclass(frozen=True)
class Notice:
    """A step's alerts (``to_json()`` records with ``rank`` and ``action``) in ``run``."""

    run: RunInfo
    step: int
    alerts: tuple[dict[str, Any], ...]

    def at_least(self, level: str) -> Notice | None:
        """The notice with only the alerts at ``level`` or above; None if none is."""
        kept = tuple(a for a in self.alerts if SEVERITY[a["level"]] >= SEVERITY[level])
        return replace(self, alerts=kept) if kept else None

    @property
    def level(self) -> str:
        """The highest level among the alerts."""
        return max((a["level"] for a in self.alerts), key=SEVERITY.__getitem__)

    @property
    def did(self) -> str:
        """What the run did, all alerts together: the strongest action."""
        return min((a["action"] for a in self.alerts), key=ACTIONS.index)

    def did_sentence(self) -> str:
        modules = sorted({a["module"] for a in self.alerts if a["action"] == self.did})
        named = ", ".join(m for m in modules if m) or "the run"
        return {
            "stopped": (
                f"The run stopped at step {self.step}: it saves a checkpoint of the step, marks "
                "itself stopped and exits 3. It resumes once the alert is answered (an approved "
                'override, a manifest change, or fp8ops resume --after-stop "why").'
            ),
            "auto-degraded": (
                f"The auto_degrade policy switched {named} to BF16 from step {self.step + 1}; "
                "training goes on."
            ),
            "proposed": (
                f"A BF16 override of {named} was proposed in the ledger for review; training "
                "goes on."
            ),
            "logged": "Logged; training goes on.",
        }[self.did]

    def look(self) -> list[str]:
        """The commands that show more."""
        commands = [f"fp8ops alerts {self.run.dir}"]
        if self.did in ("auto-degraded", "proposed"):
            commands.append(f"fp8ops overrides list {self.run.dir}")
        return commands
