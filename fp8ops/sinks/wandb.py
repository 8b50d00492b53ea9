"""A Weights & Biases run, online or offline (``wandb``).

The run's id is kept in ``sinks.json``; a resume continues it (``resume="allow"``, the same
id), in the same project. W&B keeps the first values it was sent for a step and takes steps in
increasing order only, so a resume sends only the steps after the last one this run sent it
(``sinks.json``'s ``last_step``, written at each checkpoint; online, also what the server says
the run holds). Text (alerts, events) is logged as a string value under its tag at its step.
The API key comes from the environment (``WANDB_API_KEY``) or ``wandb login``, never the
manifest; without one, an online run's sink fails at once (no prompt) and training goes on."""

from __future__ import annotations

import uuid
from typing import Any

from fp8ops.manifest.schema import WandbSink as Config
from fp8ops.sinks.base import RunContext, inside_run
from fp8ops.sinks.items import Scalars, Text


class WandbSink:
    name = "wandb"

    def __init__(self, config: Config, context: RunContext):
        self.config, self.context = config, context
        self.project = config.project or context.name
        self.dir = inside_run(context.run_dir, config.dir, ".")
        self.where = f"{config.entity or ''}/{self.project}"
        self.skip_through = 0
        self.last_step = 0
        self.run = None
        self.run_id: str | None = None

    def open(self, saved: dict[str, Any]) -> None:
        import wandb

        same = saved.get("run_id") and saved.get("where") == self.where
        self.run_id = saved["run_id"] if same else uuid.uuid4().hex[:16]
        self.last_step = int(saved.get("last_step", 0)) if same else 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.config.entity,
            id=self.run_id,
            resume="allow",
            reinit="create_new",  # not the process's own run, should it have one
            dir=str(self.dir),
            mode=self.config.mode,
            name=self.context.name,
            settings=wandb.Settings(
                console="off",  # fp8ops' output stays fp8ops'; its records are sent as data
                silent=True,
                login_timeout=1,  # no key: fail now, never wait at a prompt
            ),
        )
        self.run.config.update(
            {
                "manifest": self.context.config,
                "fp8ops": {
                    "manifest_hash": self.context.manifest_hash,
                    "run_dir": str(self.context.run_dir),
                    "run_id": self.context.run_id,
                },
            },
            allow_val_change=True,  # a resume under a new revision
        )
        # Online, the server knows the run's steps (the first step a resumed run may log).
        server_next = int(getattr(self.run, "starting_step", 0) or 0)
        self.skip_through = max(self.last_step, server_next - 1)

    def write(self, items: list[Scalars | Text]) -> None:
        row: dict[str, Any] = {}
        step = None
        for item in items:
            if item.step < self.last_step:
                continue  # W&B takes steps in increasing order only
            if step is not None and item.step != step:
                self.run.log(row, step=step)
                row = {}
            step = item.step
            if isinstance(item, Scalars):
                row.update(item.values)
            else:
                row[item.tag] = f"{row[item.tag]}\n{item.text}" if item.tag in row else item.text
            self.last_step = item.step
        if row:
            self.run.log(row, step=step)

    def flush(self) -> None:
        pass  # W&B's service writes (and sends) on its own

    def close(self, outcome: str | None) -> None:
        self.run.finish(exit_code=1 if outcome in ("failed", "stopped") else 0)

    def state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "where": self.where,
            "mode": self.config.mode,
            "dir": str(self.dir),
            "last_step": self.last_step,
        }
