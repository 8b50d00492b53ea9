"""``fp8ops_checkpoint.json``: what a checkpoint holds and what it was made under.

Everything a resume compares before it builds a model is in here (manifest, environment,
topology, admission), so a drifted resume is refused from this one small JSON file. The rest
records where training stood (step, data position, optimizer step count, telemetry commit) and
how to verify what the tensors restore (weights fingerprint, FP8 state digests, file hashes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fp8ops.checkpoint.directory import META_FILE, CheckpointError
from fp8ops.files import loads_json

FORMAT = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopologyRecord(_Record):
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    world_size: int
    amax_reduction: str
    reduce_amax: bool


class Fp8StateRecord(_Record):
    """How the FP8 state is laid out, and a sha256 per module and state group.

    ``groups``: the state exists once per group of ranks that share it. ``shared`` (amaxes
    reduced over every rank): one group. ``per_dp_replica`` (reduced over TP only): one per
    data-parallel replica. ``per_rank`` (``reduce_amax: false``): one per rank.
    """

    layout: Literal["shared", "per_dp_replica", "per_rank", "none"]
    groups: int
    history_len: int
    modules: list[str]
    digests: dict[str, list[str]]  # module -> one sha256 per group


class LedgerAnchor(_Record):
    """The override ledger as the checkpoint saw it: a rewritten chain no longer has ``head`` as
    its record number ``records`` (every read of fp8ops.overrides.Ledger checks it)."""

    records: int = Field(ge=1)
    head: str = Field(pattern=r"^[0-9a-f]{64}$")


class CheckpointMeta(_Record):
    format: Literal[1] = FORMAT
    step: int = Field(ge=0, description="Optimizer steps completed; training resumes at step+1.")
    saved_at: str
    reason: str = Field(description="periodic | final | stop-at | requested | alert-stop")
    manifest: str
    revisions: list[str] = Field(description="Manifest hashes from the root to this one.")
    environment: dict[str, str | None]
    topology: TopologyRecord
    admission: str | None = Field(description="layers.json table hash (None: no FP8 modules).")
    weights_fingerprint: str
    # How it names the parameters (checkpoint/weights.py); checkpoints written before say nothing.
    weights_fingerprint_scheme: Literal["checkpoint-keys", "parameter-names"] = "parameter-names"
    fp8: Fp8StateRecord
    sampler: dict[str, int]
    optimizer_steps: int
    optimizer_main: bool = Field(description="Separate float32 main weights were saved.")
    telemetry_committed: int | None = Field(description="Last step readers see in the store.")
    per_rank_state: bool = Field(description="Per-rank alert windows and RNG were saved.")
    files: dict[str, dict[str, int | str]]
    # Checkpoints written before anchors existed, and runs without a ledger, hold none.
    ledger: LedgerAnchor | None = None


def write_meta(directory: Path, meta: CheckpointMeta) -> None:
    (Path(directory) / META_FILE).write_text(meta.model_dump_json(indent=2) + "\n")


def read_meta(directory: Path) -> CheckpointMeta:
    """The metadata of the checkpoint in ``directory``; errors name the file and the field."""
    path = Path(directory) / META_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; {directory} is not a complete fp8ops checkpoint"
        ) from None
    try:
        return CheckpointMeta.model_validate(loads_json(text))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise CheckpointError(
            f"{path}: {where}: {first['msg']}; the checkpoint is damaged or from another fp8ops"
        ) from None
    except ValueError as exc:  # not JSON, nested too deeply (ValidationError is one: first)
        raise CheckpointError(
            f"{path}: not valid JSON ({exc}); the checkpoint is damaged"
        ) from None
