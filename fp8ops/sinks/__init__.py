"""Metric sinks: a run's records also written to TensorBoard, Weights & Biases and MLflow, as
the manifest's ``logging`` section names them (docs/telemetry.md).

Reading order: ``items`` (what a sink is given, made from the run's records), ``layers`` (the
per-layer summary: the worst modules by the key metrics), ``base`` (a sink's calls), one module
per sink (``tensorboard``, ``wandb``, ``mlflow``), ``state`` (``sinks.json``: the ids a resume
continues), ``dispatcher`` (the thread and its bounded queue: off the training step's path, a
failing sink reported once and never in training's way), ``configured`` (the sinks of a
manifest, their libraries checked when a run starts).

Only rank 0 writes; the trainer's side is ``fp8ops.train.reporting``. Each sink's library is an
optional dependency (``pip install 'fp8ops[sinks]'``), imported in the sinks' thread.
"""

from fp8ops.sinks.base import RunContext, Sink
from fp8ops.sinks.configured import check_libraries, make_sinks, sink_names
from fp8ops.sinks.dispatcher import Dispatcher

__all__ = ["Dispatcher", "RunContext", "Sink", "check_libraries", "make_sinks", "sink_names"]
