"""TensorBoard event files, through torch's ``SummaryWriter`` (the ``tensorboard`` package).

A resume writes a new event file in the same directory with ``purge_step`` at the step after
its checkpoint: TensorBoard's readers then drop what earlier files hold from that step on, so a
step trained again after a resume from an earlier checkpoint shows once, with the values of the
attempt that went on."""

from __future__ import annotations

from typing import Any

from fp8ops.manifest.schema import TensorBoardSink as Config
from fp8ops.run.layout import TENSORBOARD
from fp8ops.sinks.base import RunContext, inside_run
from fp8ops.sinks.items import Scalars, Text


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, config: Config, context: RunContext):
        self.context = context
        self.dir = inside_run(context.run_dir, config.dir, TENSORBOARD)
        self.skip_through = 0  # purge_step replaces what an earlier attempt wrote instead
        self.last_step = context.start_step
        self.writer = None

    def open(self, saved: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        resumed = self.context.start_step > 0
        self.writer = SummaryWriter(
            str(self.dir),
            purge_step=self.context.start_step + 1 if resumed else None,
            max_queue=1000,  # its own thread writes; this bounds what it holds
            flush_secs=30,
        )
        if not resumed:
            self.writer.add_text("manifest", _as_code(self.context.manifest_yaml), 0)

    def write(self, items: list[Scalars | Text]) -> None:
        for item in items:
            if isinstance(item, Scalars):
                for tag, value in item.values.items():
                    self.writer.add_scalar(tag, value, item.step)
            else:
                self.writer.add_text(item.tag, _as_code(item.text), item.step)
            self.last_step = max(self.last_step, item.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, outcome: str | None) -> None:
        self.writer.close()

    def state(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "last_step": self.last_step}


def _as_code(text: str) -> str:
    # TensorBoard renders text as Markdown: indented, it is shown as written.
    return "\n".join("    " + line for line in text.splitlines())
