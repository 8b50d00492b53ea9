"""An MLflow run, through ``MlflowClient`` (``mlflow-skinny``): a tracking server, a database or
a local file store.

The run's id is kept in ``sinks.json``; a resume continues it (status back to RUNNING). MLflow
keeps every value logged for a step, so a resume sends only the steps after the last one the
run holds (its ``train/loss`` history, asked of the store when the sink opens). Scalars go in
batches of at most 1,000 (MLflow's limit per request); a step's text (alerts, events) is an
artifact, ``<tag>/step-<step>.txt``. MLflow accepts metric names of letters, digits and
``_ - . / space``: other characters (an evaluation bucket's ``=``) become ``_``.

MLflow 3 keeps its file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE`` is set; for a ``file:`` URI (the default) fp8ops sets it, unless the
environment already says otherwise."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from fp8ops.manifest.schema import MlflowSink as Config
from fp8ops.run.layout import MLRUNS
from fp8ops.sinks.base import RunContext, inside_run
from fp8ops.sinks.items import Scalars, Text

BATCH = 1000  # MLflow's most metrics per log_batch
_STATUS = {"failed": "FAILED", "stopped": "FAILED", "paused": "KILLED", "interrupted": "KILLED"}


class MlflowSink:
    name = "mlflow"

    def __init__(self, config: Config, context: RunContext):
        self.config, self.context = config, context
        self.tracking_uri = (
            config.tracking_uri or inside_run(context.run_dir, None, MLRUNS).as_uri()
        )
        self.experiment = config.experiment or context.name
        self.skip_through = 0
        self.last_step = 0
        self.client = None
        self.run_id: str | None = None
        self._texts: dict[str, list[str]] = {}  # the latest step's text by tag
        self._text_step = -1

    def open(self, saved: dict[str, Any]) -> None:
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        same = saved.get("run_id") and saved.get("tracking_uri") == self.tracking_uri
        if same:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            history = self.client.get_metric_history(self.run_id, "train/loss")
            self.last_step = max([m.step for m in history] + [int(saved.get("last_step", 0))])
        else:
            experiment = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(self.experiment)
            )
            run = self.client.create_run(
                experiment_id,
                run_name=self.context.name,
                tags={
                    "fp8ops.run_dir": str(self.context.run_dir),
                    "fp8ops.run_id": str(self.context.run_id),
                },
            )
            self.run_id = run.info.run_id
        self.skip_through = self.last_step
        self.client.set_tag(self.run_id, "fp8ops.manifest", self.context.manifest_hash)
        self.client.log_text(self.run_id, self.context.manifest_yaml, "fp8ops/manifest.yaml")

    def write(self, items: list[Scalars | Text]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for item in items:
            if isinstance(item, Scalars):
                metrics += [
                    Metric(_key(name), value, now, item.step) for name, value in item.values.items()
                ]
            else:
                if item.step != self._text_step:
                    self._texts, self._text_step = {}, item.step
                lines = self._texts.setdefault(item.tag, [])
                lines.append(item.text)  # the step's artifact is rewritten with all of them
                path = f"{_key(item.tag)}/step-{item.step:08d}.txt"
                self.client.log_text(self.run_id, "\n".join(lines) + "\n", path)
            self.last_step = max(self.last_step, item.step)
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + BATCH])

    def flush(self) -> None:
        pass  # every call above has reached the store when it returns

    def close(self, outcome: str | None) -> None:
        self.client.set_terminated(self.run_id, status=_STATUS.get(outcome or "", "FINISHED"))

    def state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "last_step": self.last_step,
        }


def _key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name)
