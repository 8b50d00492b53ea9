"""What a run directory's records hold, as typed models, and their readers.

Every reader names the file and what is wrong when a record is missing or malformed: a record a
decision rests on (the tokenizer a resume checks, the state a rerun trusts) is never read as
"nothing recorded". Records written by another fp8ops version may carry fields this one does not
know; they are kept (``extra="allow"``), while the fields read here are type-checked.

The logs (``metrics.jsonl``, ``eval.jsonl``, ``events.jsonl``) are read through
:func:`fp8ops.files.read_jsonl`, so a torn last line (a crash mid-write) is skipped and damage
anywhere else names the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from fp8ops.errors import Fp8opsError
from fp8ops.files import read_jsonl
from fp8ops.run.layout import RunLayout


class RunRecordError(Fp8opsError):
    """A run directory's record is missing, unreadable or malformed."""


class _Record(BaseModel):
    # Strict types (a step is an int, not "5"); unknown fields kept for other fp8ops versions.
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


# -- status.json --------------------------------------------------------------------------------

State = Literal["running", "paused", "interrupted", "completed", "failed", "stopped"]


class Status(_Record):
    """``status.json``: where the run stands. Rewritten (atomically) as the run goes."""

    state: State
    updated: str | None = None
    step: int | None = None
    manifest: str | None = None  # the revision the run is locked to now
    resumed_from: str | None = None  # the checkpoint this attempt resumed from
    checkpoint: str | None = None  # paused, interrupted, stopped: the checkpoint saved
    reason: str | None = None  # paused, interrupted: why
    error: str | None = None  # failed: the exception
    alert: dict[str, Any] | None = None  # stopped: the Stop alert's record


# -- run.json -----------------------------------------------------------------------------------


class RunTopology(_Record):
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    data_parallel: int | None = None
    world_size: int | None = None
    amax_reduction: str | None = None
    amax_reduction_ranks: list[int] | None = None


class RunModel(_Record):
    config_fingerprint: str | None = None
    init_checkpoint: str | None = None  # the base it started from (model.init_checkpoint)
    init_fingerprint: str | None = None
    init_fingerprint_scheme: str | None = None
    init_verified: bool | None = None
    initial_weights_fingerprint: str | None = None  # the weights step 1 started from
    initial_weights_fingerprint_scheme: str | None = None
    parameters: int | None = None


class RunTokenizer(_Record):
    kind: str
    fingerprint: str | None = None


class RunData(_Record):
    """The data summary (counts, buckets, ``train``/``eval`` sizes are kept as written)."""

    fingerprint: str | None = None
    kind: str | None = None
    objective: str | None = None
    source: dict[str, Any] | None = None  # where the data came from: file sha256, corpus, ...


class RunRecord(_Record):
    """``run.json``: what the run started from, written once when it starts."""

    # The revision it started under: every run.json fp8ops writes has it; the readers that rely
    # on it (compare's own-run check) refuse a record without it.
    manifest: str | None = None
    revision: int | None = None
    command: list[str] = []
    environment: dict[str, str | None] | None = None
    cpu_bf16_gemm: str | None = None
    topology: RunTopology = RunTopology()
    seeds: dict[str, int] | None = None
    model: RunModel = RunModel()
    tokenizer: RunTokenizer | None = None
    data: RunData | None = None
    admission: dict[str, int] | None = None
    fp8_casts: str | None = None  # which kernels cast: the same bits either way


# -- the logs -----------------------------------------------------------------------------------


class MetricsRow(_Record):
    """One line of ``metrics.jsonl``: one optimizer step."""

    step: int
    loss: float
    tokens: int
    grad_norm: float | None = None  # None: not finite (JSON has no NaN)
    update_norm: float | None = None
    lr: float | None = None
    skipped: bool | None = None
    loss_tokens: int | None = None
    seconds: float | None = None
    tokens_per_s: float | None = None
    peak_memory_mib: float | None = None


class EvalRow(_Record):
    """One line of ``eval.jsonl``: the held-out loss at a step, overall and per bucket."""

    step: int
    loss: float
    tokens: int | None = None
    buckets: dict[str, float] = {}


class Event(_Record):
    """One line of ``events.jsonl``: what happened (``event``), when, and its fields."""

    event: str
    time: str | None = None


# -- fallbacks.json -----------------------------------------------------------------------------


class Fallback(_Record):
    """A module running in a high-precision dtype by approved override, since ``from_step``."""

    dtype: str
    reason: str
    approval: str | None
    from_step: int
    revision: str


# -- readers ------------------------------------------------------------------------------------

R = TypeVar("R", bound=BaseModel)


def read_status(run_dir: str | Path) -> Status:
    """``status.json``; :class:`RunRecordError` when it is missing or malformed."""
    file = RunLayout(run_dir).status
    if not file.is_file():
        raise RunRecordError(
            f"{file}: no such file; {Path(run_dir)} is not an fp8ops run directory, or its run "
            "never started"
        )
    return _read_document(file, Status)


def find_status(run_dir: str | Path) -> Status | None:
    """``status.json``, or None where the directory has none (no run started there); a
    malformed one is still an error."""
    file = RunLayout(run_dir).status
    return _read_document(file, Status) if file.is_file() else None


def read_run_record(run_dir: str | Path) -> RunRecord:
    """``run.json``; :class:`RunRecordError` when it is missing or malformed."""
    file = RunLayout(run_dir).run_record
    if not file.is_file():
        raise RunRecordError(
            f"{file}: no such file; the run directory is incomplete (written when training starts)"
        )
    return _read_document(file, RunRecord)


def read_fallbacks(run_dir: str | Path) -> dict[str, Fallback]:
    """``fallbacks.json`` by module; no file means no module runs by override."""
    file = RunLayout(run_dir).fallbacks
    if not file.is_file():
        return {}
    document = _read_json(file)
    table = {}
    for module, entry in document.items():
        table[module] = _validated(Fallback, entry, file, where=f"{module}: ")
    return table


def read_metrics(run_dir: str | Path) -> list[MetricsRow]:
    """The run's per-step records in step order, the latest line winning for a step that was
    logged again after a resume from an earlier checkpoint. None yet: an empty list."""
    return _read_steps(RunLayout(run_dir).metrics, MetricsRow)


def read_evals(run_dir: str | Path) -> list[EvalRow]:
    """The held-out loss evaluations in step order (latest line per step, as metrics)."""
    return _read_steps(RunLayout(run_dir).evals, EvalRow)


def read_events(run_dir: str | Path) -> list[Event]:
    """Every event in the order it was written."""
    return _read_lines(RunLayout(run_dir).events, Event)


def _read_steps(file: Path, model: type[R]) -> list[R]:
    by_step = {row.step: row for row in _read_lines(file, model)}  # the latest line wins
    return [by_step[step] for step in sorted(by_step)]


def _read_lines(file: Path, model: type[R]) -> list[R]:
    if not file.exists():
        return []
    return [
        _validated(model, line, file, where=f"record {number}: ")
        for number, line in enumerate(read_jsonl(file), 1)
    ]


def _read_document(file: Path, model: type[R]) -> R:
    return _validated(model, _read_json(file), file)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunRecordError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunRecordError(
            f"{file}: cannot be read: not valid JSON ({exc}); the file is damaged"
        ) from None
    if not isinstance(document, dict):
        raise RunRecordError(
            f"{file}: holds a JSON {type(document).__name__}, not an object; the file is damaged"
        )
    return document


def _validated(model: type[R], value: Any, file: Path, *, where: str = "") -> R:
    if not isinstance(value, dict):
        raise RunRecordError(f"{file}: {where}not a JSON object; the file is damaged")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        problem = (
            f"no {field!r} field" if error["type"] == "missing" else f"{field}: {error['msg']}"
        )
        raise RunRecordError(
            f"{file}: {where}{problem}; the file is damaged or not fp8ops' own"
        ) from None
