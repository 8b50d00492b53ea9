"""The run manifest: what a run is, as one frozen and strictly validated object.

``Manifest`` lists the sections, each a pydantic model in a module of its own (a description on
every field, checks beside the fields they check), and holds the rules that span sections: the
parallel layout must fit the model and the batch. What every section shares (strict, frozen,
no unknown keys; the field types; ``added_field``) is in ``base.py``.

Every section, field type and helper that code imports from ``schema`` is importable from here
still (``__all__``), as before the sections had modules of their own.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fp8ops.manifest.alerts import Alerts, AutoDegrade, DegradeRule
from fp8ops.manifest.base import (
    ADDED_IN,
    Fraction,
    Globs,
    ModuleGlob,
    NonEmptyStr,
    Section,
    Sha256,
    added_field,
    raise_problems,
)
from fp8ops.manifest.data import DataConfig, TokenizerConfig
from fp8ops.manifest.evaluation import Capability, DualTrack, Gates
from fp8ops.manifest.levels import (
    BlocksAtFloorLevels,
    Fp8ErrorLevels,
    Levels,
    SaturationLevels,
    ScaleChangeLevels,
    UnderflowLevels,
)
from fp8ops.manifest.model import ModelConfig, RopeScaling
from fp8ops.manifest.module_precision import Bf16Override, ModuleFqn, ModuleRecipe, SmallGemmRule
from fp8ops.manifest.notifications import Notifications, Webhook
from fp8ops.manifest.optimizer import OptimizerConfig
from fp8ops.manifest.precision import PrecisionPolicy, recipe_line
from fp8ops.manifest.precision_schedule import PrecisionPhase, schedule_problems
from fp8ops.manifest.review import Review
from fp8ops.manifest.revision import Revision
from fp8ops.manifest.schedule import Schedule
from fp8ops.manifest.seeds import Seeds
from fp8ops.manifest.sinks import Logging, MlflowSink, TensorBoardSink, WandbSink
from fp8ops.manifest.telemetry import Telemetry
from fp8ops.manifest.topology import Topology

SCHEMA_VERSION = 1

# The base class's name before the split (tests/test_manifest.py defines a section with it).
_Section = Section


class Manifest(Section):
    """A run, completely: hashed (``canonical.py``), never edited, revised by derivation."""

    schema_version: Literal[1] = Field(
        description="Manifest format version; this fp8ops reads version 1."
    )
    name: str = Field(
        description=(
            "Run family name: lowercase letters, digits, '.', '_' and '-', starting with a "
            "letter or digit."
        )
    )
    revision: Revision = Field(
        default_factory=Revision, description="Root manifest or derived revision."
    )
    precision: PrecisionPolicy = Field(
        default_factory=PrecisionPolicy, description="The FP8 policy the run starts with."
    )
    model: ModelConfig = Field(description="The network.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    data: DataConfig = Field(description="Data.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    schedule: Schedule = Field(description="Steps and batch sizes.")
    seeds: Seeds = Field(default_factory=Seeds, description="Random seeds.")
    topology: Topology = Field(default_factory=Topology, description="Parallel layout.")
    alerts: Alerts = Field(default_factory=Alerts, description="Alert thresholds.")
    gates: Gates = Field(default_factory=Gates, description="Dual-track acceptance gates.")
    capability: Capability = Field(
        default_factory=Capability, description="Generation-based evaluation of the task."
    )
    dualtrack: DualTrack = Field(
        default_factory=DualTrack, description="The third track's BF16 modules."
    )
    telemetry: Telemetry = Field(default_factory=Telemetry, description="Telemetry cadence.")
    review: Review = Field(default_factory=Review, description="Override review rules.")
    logging: Logging = added_field(
        default_factory=Logging,
        added_in="0.1.0",
        description="Metric sinks: TensorBoard, W&B, MLflow. None by default.",
    )
    notifications: Notifications = added_field(
        default_factory=Notifications,
        added_in="0.1.0",
        description="Webhooks told of alerts. None by default.",
    )

    @field_validator("schema_version", mode="before")
    @classmethod
    def _integer_version(cls, value: Any) -> Any:
        # Literal[1] alone accepts true and 1.0 (they compare equal to 1).
        if type(value) is not int:
            raise PydanticCustomError("manifest_rule", "must be the integer 1")
        return value

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return _check_name(value)

    @model_validator(mode="after")
    def _layout_fits(self) -> Manifest:
        topology, schedule = self.topology, self.schedule
        problems = []

        def divisible(section: str, field: str, by: int, by_name: str) -> None:
            value = getattr(getattr(self, section), field)
            if value is not None and value % by:
                problems.append(((section, field), value, f"must be divisible by {by_name} ({by})"))

        tp = topology.tensor_parallel
        divisible("model", "num_attention_heads", tp, "topology.tensor_parallel")
        divisible("model", "num_query_groups", tp, "topology.tensor_parallel")
        divisible("model", "ffn_hidden_size", tp, "topology.tensor_parallel")
        divisible("model", "num_layers", topology.pipeline_parallel, "topology.pipeline_parallel")
        divisible(
            "schedule",
            "global_batch_size",
            schedule.micro_batch_size * topology.data_parallel,
            "schedule.micro_batch_size * topology.data_parallel",
        )
        if topology.sequence_parallel:
            problems.extend(self._sequence_parallel_problems())
        if topology.pipeline_parallel > 1:
            problems.extend(self._pipeline_problems())
        problems.extend(
            schedule_problems(
                self.precision.schedule,
                schedule.train_steps,
                enabled=self.precision.enabled,
                backend=self.precision.backend,
                scaling=self.precision.scaling,
            )
        )
        if self.tokenizer.kind == "byte" and self.model.vocab_size < 256:
            problems.append(
                (("model", "vocab_size"), self.model.vocab_size, "must be >= 256 for byte tokens")
            )
        raise_problems("Manifest", problems)
        return self

    def _pipeline_problems(self) -> list:
        """What pipeline parallelism cannot run with yet, each at the field to change."""
        problems, pp = [], self.topology.pipeline_parallel
        if self.data.pad_to != "seq_length":
            problems.append(
                (
                    ("data", "pad_to"),
                    self.data.pad_to,
                    f"must be 'seq_length' at topology.pipeline_parallel {pp} (the stages "
                    "exchange activations of one fixed shape)",
                )
            )
        if self.precision.enabled and self.precision.backend == "te":
            problems.append(
                (
                    ("precision", "backend"),
                    "te",
                    f"'te' at topology.pipeline_parallel {pp} is not supported yet (Megatron's "
                    "TE spec is built without stages here); use 'emulated' or 'scaled_mm'",
                )
            )
        return problems

    def _sequence_parallel_problems(self) -> list:
        """What sequence parallelism needs, each at the field to change."""
        problems, tp = [], self.topology.tensor_parallel
        where = ("topology", "sequence_parallel")
        if tp == 1:
            problems.append(
                (
                    where,
                    True,
                    "needs topology.tensor_parallel > 1 (it splits the sequence "
                    "over the tensor-parallel ranks); set it to false at tensor_parallel 1",
                )
            )
        elif self.model.seq_length % tp:
            problems.append(
                (
                    ("model", "seq_length"),
                    self.model.seq_length,
                    f"must be divisible by topology.tensor_parallel ({tp}) under "
                    "topology.sequence_parallel",
                )
            )
        if self.data.pad_to != "seq_length":
            problems.append(
                (
                    ("data", "pad_to"),
                    self.data.pad_to,
                    "must be 'seq_length' under topology.sequence_parallel (every batch's length "
                    "must divide by tensor_parallel)",
                )
            )
        if self.precision.enabled and not self.precision.reduce_amax:
            problems.append(
                (
                    ("precision", "reduce_amax"),
                    False,
                    "must be true under topology.sequence_parallel: Transformer Engine requires "
                    "the amax reduced over TP for it, and fp8ops runs TE's arithmetic",
                )
            )
        if self.precision.enabled and self.precision.backend == "te":
            problems.append(
                (
                    ("precision", "backend"),
                    "te",
                    "'te' with topology.sequence_parallel is not supported yet (not checked on a "
                    "GPU); use 'emulated' or 'scaled_mm'",
                )
            )
        return problems


def _check_name(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", value):
        raise ValueError(
            "must start with a lowercase letter or digit and use only a-z, 0-9, '.', '_' and '-'"
        )
    return value


__all__ = [
    "ADDED_IN",
    "SCHEMA_VERSION",
    "Alerts",
    "AutoDegrade",
    "Bf16Override",
    "BlocksAtFloorLevels",
    "Capability",
    "DataConfig",
    "DegradeRule",
    "DualTrack",
    "Fp8ErrorLevels",
    "Fraction",
    "Gates",
    "Globs",
    "Levels",
    "Logging",
    "Manifest",
    "MlflowSink",
    "ModelConfig",
    "ModuleFqn",
    "ModuleGlob",
    "ModuleRecipe",
    "NonEmptyStr",
    "Notifications",
    "OptimizerConfig",
    "PrecisionPhase",
    "PrecisionPolicy",
    "Review",
    "Revision",
    "RopeScaling",
    "SaturationLevels",
    "ScaleChangeLevels",
    "Schedule",
    "Section",
    "Seeds",
    "Sha256",
    "SmallGemmRule",
    "Telemetry",
    "TensorBoardSink",
    "TokenizerConfig",
    "Topology",
    "UnderflowLevels",
    "WandbSink",
    "Webhook",
    "added_field",
    "recipe_line",
]
