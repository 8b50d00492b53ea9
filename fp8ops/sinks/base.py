"""What every sink is: the run it writes for (:class:`RunContext`) and the calls the dispatcher
makes, all from the sinks' own thread (:class:`Sink`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fp8ops.sinks.items import Scalars, Text


@dataclass(frozen=True)
class RunContext:
    """The run a sink writes for. ``start_step``: the step this segment starts after (0 for a
    new run, the checkpoint's step for a resume); ``config``: the manifest's content."""

    run_dir: Path
    name: str
    manifest_hash: str
    run_id: str | None
    start_step: int
    manifest_yaml: str = ""
    config: dict[str, Any] = field(default_factory=dict)


class Sink(Protocol):
    """One metric sink. ``skip_through``: steps up to this one were already sent to it by an
    earlier segment of the run (a resume from an earlier checkpoint re-trains them): the
    dispatcher does not send them again."""

    name: str
    skip_through: int

    def open(self, saved: dict[str, Any]) -> None:
        """Start or continue the sink's run; ``saved``: its ``sinks.json`` entry (empty for
        a new run)."""

    def write(self, items: list[Scalars | Text]) -> None:
        """Send items, in step order."""

    def flush(self) -> None:
        """Make what was sent durable (a checkpoint was saved)."""

    def close(self, outcome: str | None) -> None:
        """End this segment's writing; ``outcome``: completed, paused, interrupted, stopped,
        failed (None: not known)."""

    def state(self) -> dict[str, Any]:
        """Its ``sinks.json`` entry: what a resume needs to continue it."""


def inside_run(run_dir: Path, configured: str | None, default: str) -> Path:
    """A sink's directory: ``configured`` (relative: inside the run directory) or ``default``."""
    path = Path(configured if configured is not None else default)
    return path if path.is_absolute() else run_dir / path
