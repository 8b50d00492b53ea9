"""Where a run keeps what: the one place the run directory's file names are spelled.

::

    RUN_DIR/
      manifest.yaml        the manifest the run is locked to (the derived revision under --set)
      manifests/           every revision in its lineage, content-addressed (<sha256>.yaml)
      run.json             fingerprints: manifest, environment, topology, data, tokenizer, model
      status.json          running | paused | interrupted | completed | failed | stopped, the step
      run.lock             created exclusively when a run claims the directory; flock-held
      layers.json          per-layer admission: which module runs FP8 and why
      metrics.jsonl        one line per optimizer step
      eval.jsonl           one line per held-out loss evaluation
      capability.jsonl     one line per capability evaluation; capability/ holds the answers
      events.jsonl         what happened, in order (start, evaluations, checkpoints, end, errors)
      alerts.jsonl         the alert rules' findings
      overrides.jsonl      the per-layer override ledger (hash-chained)
      fallbacks.json       modules running BF16 by approved override: since when, which revision
      telemetry.zarr/      per-module FP8 telemetry (a Zarr v3 store)
      checkpoints/         training checkpoints and the `latest` pointer
      final/               the trained weights (a weights checkpoint)
      stop.request         asks the run to checkpoint and stop at the next step boundary
      attempts/N/          an attempt that ended before its first checkpoint, set aside by a
                           `train --resume` that started the run over
      sinks.json           the metric sinks' run ids and last steps, so a resume continues them
      tensorboard/         TensorBoard event files (manifest `logging.tensorboard`, by default)
      mlruns/              an MLflow file store (manifest `logging.mlflow`, by default)
      wandb/               W&B's own files (manifest `logging.wandb`, by default)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.yaml"
MANIFESTS = "manifests"
RUN_RECORD = "run.json"
STATUS = "status.json"
LOCK = "run.lock"
LAYERS = "layers.json"
METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"
CAPABILITY = "capability.jsonl"
CAPABILITY_ANSWERS = "capability"
EVENTS = "events.jsonl"
ALERTS = "alerts.jsonl"
OVERRIDES = "overrides.jsonl"
FALLBACKS = "fallbacks.json"
TELEMETRY = "telemetry.zarr"
CHECKPOINTS = "checkpoints"
FINAL = "final"
STOP_REQUEST = "stop.request"
ATTEMPTS = "attempts"
SINKS = "sinks.json"
TENSORBOARD = "tensorboard"
MLRUNS = "mlruns"
# In a weights checkpoint (final/, or any model.init_checkpoint): what the weights are.
WEIGHTS_META = "fp8ops_weights.json"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory's files (nothing is read or created)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def manifests(self) -> Path:
        return self.root / MANIFESTS

    @property
    def run_record(self) -> Path:
        return self.root / RUN_RECORD

    @property
    def status(self) -> Path:
        return self.root / STATUS

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def layers(self) -> Path:
        return self.root / LAYERS

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def evals(self) -> Path:
        return self.root / EVALS

    @property
    def capability(self) -> Path:
        return self.root / CAPABILITY

    @property
    def capability_answers(self) -> Path:
        return self.root / CAPABILITY_ANSWERS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def alerts(self) -> Path:
        return self.root / ALERTS

    @property
    def overrides(self) -> Path:
        return self.root / OVERRIDES

    @property
    def fallbacks(self) -> Path:
        return self.root / FALLBACKS

    @property
    def telemetry(self) -> Path:
        return self.root / TELEMETRY

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def final(self) -> Path:
        return self.root / FINAL

    @property
    def stop_request(self) -> Path:
        return self.root / STOP_REQUEST

    @property
    def attempts(self) -> Path:
        return self.root / ATTEMPTS

    @property
    def sinks(self) -> Path:
        return self.root / SINKS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def mlruns(self) -> Path:
        return self.root / MLRUNS

    def finished(self) -> bool:
        """Whether the run's final weights are written (before it says so in status.json)."""
        return (self.final / WEIGHTS_META).is_file()

    def is_run(self) -> bool:
        """Whether the directory holds an fp8ops run's files (a status or a locked manifest)."""
        return self.status.is_file() or self.manifest.is_file()
