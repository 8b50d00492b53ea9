"""The ``logging`` section: the metric sinks a run also writes to (TensorBoard, W&B, MLflow),
besides its own records. Which library each needs, and whether it is installed, is checked when
a run starts (``fp8ops.sinks``), not here: a manifest validates on a machine without them."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import field_validator
from pydantic_core import PydanticCustomError

from fp8ops.manifest.base import SECRET, NonEmptyStr, Section, added_field


class TensorBoardSink(Section):
    """TensorBoard event files."""

    dir: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "Where the event files go; a relative path is inside the run directory. null: "
            "RUN_DIR/tensorboard. A resume appends to the same directory."
        ),
    )


class WandbSink(Section):
    """A Weights & Biases run. The API key comes from the environment (WANDB_API_KEY, or
    ``wandb login``'s netrc), never from the manifest."""

    project: NonEmptyStr | None = added_field(
        None, added_in="0.1.0", description="The W&B project. null: the manifest's name."
    )
    entity: NonEmptyStr | None = added_field(
        None, added_in="0.1.0", description="The W&B team or user. null: the key's default."
    )
    mode: Literal["online", "offline"] = added_field(
        "online",
        added_in="0.1.0",
        description=(
            "online: sent as the run trains; offline: written under dir only, for `wandb sync` "
            "later (a cluster without internet access)."
        ),
    )
    dir: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "The directory W&B writes its `wandb/` folder in; a relative path is inside the run "
            "directory. null: the run directory."
        ),
    )


class MlflowSink(Section):
    """An MLflow run. Credentials of a tracking server come from the environment
    (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME and _PASSWORD), never from the manifest."""

    tracking_uri: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description=(
            "MLflow's tracking URI: a server (https://mlflow.example:5000), a database "
            "(sqlite:///path/mlflow.db, with SQLAlchemy installed) or a file store "
            "(file:///path/mlruns). null: a file store in RUN_DIR/mlruns."
        ),
    )
    experiment: NonEmptyStr | None = added_field(
        None,
        added_in="0.1.0",
        description="The experiment the run is logged under. null: the manifest's name.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value != "databricks" and not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", value):
            raise ValueError(
                "must be a URI with its scheme (https://..., sqlite:///..., file:///...) or "
                "'databricks'"
            )
        if "@" in urlsplit(value).netloc:
            raise PydanticCustomError(
                SECRET,
                "holds credentials (user:password@): a manifest is copied into the run "
                "directory and its revisions; set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment instead",
            )
        return value


class Logging(Section):
    """Metric sinks: per step the scalars of ``metrics.jsonl``, the evaluations, capability
    results, the worst modules of the per-layer metrics, alerts and events, written by rank 0
    off the training step's path (docs/telemetry.md). Every sink is off by default."""

    tensorboard: TensorBoardSink | None = added_field(
        None, added_in="0.1.0", description="TensorBoard event files. null: none."
    )
    wandb: WandbSink | None = added_field(
        None, added_in="0.1.0", description="A Weights & Biases run. null: none."
    )
    mlflow: MlflowSink | None = added_field(
        None, added_in="0.1.0", description="An MLflow run. null: none."
    )
    every_steps: int = added_field(
        1,
        added_in="0.1.0",
        ge=1,
        description=(
            "Send a step's scalars every N steps (evaluations, alerts and events always): a "
            "remote server's rate limit may want fewer points than a long run has steps."
        ),
    )
    worst_modules: int = added_field(
        5,
        added_in="0.1.0",
        ge=0,
        le=64,
        description=(
            "Per key per-layer metric (saturation, underflow, scale_change, fp8_rel_error, "
            "blocks_at_floor), the largest value over the modules and the values of this many "
            "worst modules of the step. 0: no per-layer summary. Every module's every metric "
            "stays in telemetry.zarr."
        ),
    )

    @property
    def configured(self) -> bool:
        """Whether any sink is configured."""
        return any(s is not None for s in (self.tensorboard, self.wandb, self.mlflow))
