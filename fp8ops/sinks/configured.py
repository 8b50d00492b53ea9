"""The sinks a manifest's ``logging`` section names: their libraries checked when a run starts
(:func:`check_libraries`), and made for a run (:func:`make_sinks`)."""

from __future__ import annotations

import importlib.util

from fp8ops.errors import ManifestError
from fp8ops.manifest.schema import Logging
from fp8ops.sinks.base import RunContext, Sink

# The module each sink imports, and the package that brings it.
LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


def sink_names(logging: Logging) -> list[str]:
    """The names of the sinks ``logging`` turns on, in a fixed order."""
    return [name for name in LIBRARIES if getattr(logging, name) is not None]


def check_libraries(logging: Logging) -> None:
    """Refuse a sink whose library is not installed, with the command that installs it (at
    plan time: a run must not train for hours and then find its W&B run missing)."""
    missing = [name for name in sink_names(logging) if not _installed(LIBRARIES[name][0])]
    if missing:
        packages = " ".join(LIBRARIES[name][1] for name in missing)
        raise ManifestError(
            f"logging.{missing[0]} needs the {packages} package"
            f"{'s' if len(missing) > 1 else ''}, which this environment lacks: "
            f"pip install 'fp8ops[sinks]' (or pip install {packages}), or remove "
            + ", ".join(f"logging.{name}" for name in missing)
        )


def make_sinks(logging: Logging, context: RunContext) -> list[Sink]:
    """The sink objects (nothing is opened: the sinks' thread opens them)."""
    sinks: list[Sink] = []
    if logging.tensorboard is not None:
        from fp8ops.sinks.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(logging.tensorboard, context))
    if logging.wandb is not None:
        from fp8ops.sinks.wandb import WandbSink

        sinks.append(WandbSink(logging.wandb, context))
    if logging.mlflow is not None:
        from fp8ops.sinks.mlflow import MlflowSink

        sinks.append(MlflowSink(logging.mlflow, context))
    return sinks


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
