"""What a training process prints while it trains: :class:`StepLogger`.

On a terminal, a rich progress bar; in a file (a job log, grepped line by line), one plain line
every ``log_interval`` steps and at the last. Only rank 0 prints; ``enabled=False``
(``--no-progress``) prints nothing, leaving the run's summary at the end.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fp8ops.run import MetricsRow


class StepLogger:
    """``log(row)`` after every step, ``close()`` once at the end (also after a failure)."""

    def __init__(self, train_steps: int, log_interval: int, *, enabled: bool):
        self.train_steps, self.log_interval, self.enabled = train_steps, log_interval, enabled
        console = Console(stderr=True, highlight=False)
        self.live = enabled and console.is_terminal
        self.bar = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.live,
        )
        self.task = self.bar.add_task("train", total=train_steps, loss="-", tps="-")
        self.bar.start()

    def log(self, row: MetricsRow) -> None:
        loss, tps = f"{row.loss:.4f}", f"{row.tokens_per_s:,.0f}"
        self.bar.update(self.task, completed=row.step, loss=loss, tps=tps)
        due = row.step % self.log_interval == 0 or row.step == self.train_steps
        if self.enabled and not self.live and due:
            norm = "skipped" if row.skipped else f"{row.grad_norm:.3f}"
            # A plain print: rich would wrap the line at its 80-column default for a file.
            print(
                f"step {row.step}/{self.train_steps}  loss {loss}  grad_norm {norm}  "
                f"lr {row.lr:.2e}  {tps} tok/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.stop()
