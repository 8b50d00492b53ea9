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

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fp8ops.errors import Fp8opsError
from fp8ops.files import atomic_write_text, loads_json, read_jsonl
from fp8ops.gemm_roles import GEMMS
from fp8ops.run.layout import RunLayout


class RunRecordError(Fp8opsError):
    """A run directory's record is missing, unreadable or malformed."""


class LayersFileError(RunRecordError):
    """A run's ``layers.json`` is missing, unreadable or corrupt."""


class _Record(BaseModel):
    # Strict types (a step is an int, not "5"); unknown fields kept for other fp8ops versions.
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


# -- status.json --------------------------------------------------------------------------------

# "imported": a run fp8ops did not train, read from another tool's logs (run.json's ``imported``
# says from where); nothing can resume it.
State = Literal["running", "paused", "interrupted", "completed", "failed", "stopped", "imported"]


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
    # A Hugging Face base compared with transformers' logits (fp8ops.hf.verify): the largest
    # difference, its bound, the argmax agreement; None where transformers is not installed.
    init_hf_verification: dict[str, Any] | None = None
    initial_weights_fingerprint: str | None = None  # the weights step 1 started from
    initial_weights_fingerprint_scheme: str | None = None
    parameters: int | None = None


class RunOptimizer(_Record):
    distributed: bool = False  # optimizer.distributed: state sharded over data parallel
    # Bytes of float32 main weights and moments each rank holds, by global rank.
    state_bytes_per_rank: list[int] | None = None


class RunTokenizer(_Record):
    kind: str
    fingerprint: str | None = None


class RunData(_Record):
    """The data summary (counts, buckets, ``train``/``eval`` sizes are kept as written)."""

    fingerprint: str | None = None
    kind: str | None = None
    objective: str | None = None
    source: dict[str, Any] | None = None  # where the data came from: file sha256, corpus, ...


class ImportedFile(_Record):
    """One log file an imported run was read from, as it was when read."""

    path: str  # relative to ``ImportedFrom.source``
    sha256: str
    bytes: int
    rank: int
    lines: int  # statistics lines read from it
    skipped: int = 0  # lines left out (a torn last line, a name that cannot be split)


class ImportedFrom(_Record):
    """Where an imported run's telemetry came from (``run.json``'s ``imported``)."""

    kind: Literal["te_debug"]  # Transformer Engine's debug API statistics logs (nvdlfw_inspect)
    source: str  # the log directory, absolute
    files: list[ImportedFile]
    imported_at: str
    fp8ops_version: str
    # What the logs say about the tools that wrote them; None: not in the logs (TE 2.20's
    # statistics logs name no version).
    transformer_engine_version: str | None = None
    nvdlfw_inspect_version: str | None = None
    recipe: str | None = None  # the training recipe the mapping assumed (fp8ops' word), if known
    recipe_from: str | None = None  # how it was known: --recipe, the manifest, the stats' names
    naming: str = "te"  # how module names were made from TE's layer names
    first_iteration: int | None = None
    last_iteration: int | None = None
    mapped: dict[str, str] = {}  # TE stat (tensor_stat) -> the catalogue metric it fills
    kept: list[str] = []  # the store's columns under TE's own names
    warnings: list[str] = []


class RunRecord(_Record):
    """``run.json``: what the run started from, written once when it starts (or, for a run
    fp8ops did not train, when it was imported: ``imported``)."""

    # The revision it started under: every run.json fp8ops writes has it; the readers that rely
    # on it (compare's own-run check) refuse a record without it.
    manifest: str | None = None
    revision: int | None = None
    # Made at random when the run starts, and written into its telemetry store: a store that
    # names another run's id (a link or copy) is not continued. Older runs have none.
    run_id: str | None = None
    command: list[str] = []
    environment: dict[str, str | None] | None = None
    cpu_bf16_gemm: str | None = None
    topology: RunTopology = RunTopology()
    seeds: dict[str, int] | None = None
    model: RunModel = RunModel()
    optimizer: RunOptimizer | None = None  # None: written before it was recorded
    tokenizer: RunTokenizer | None = None
    data: RunData | None = None
    admission: dict[str, int] | None = None
    fp8_casts: str | None = None  # which kernels cast: the same bits either way
    imported: ImportedFrom | None = None  # not trained by fp8ops: read from another tool's logs


# -- the logs -----------------------------------------------------------------------------------


class MetricsRow(_Record):
    """One line of ``metrics.jsonl``: one optimizer step."""

    step: int
    loss: float
    tokens: int
    grad_norm: float | None = None  # None: not finite (JSON has no NaN)
    update_norm: float | None = None
    weight_norm: float | None = None  # the weights' global norm before the step's update
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
    """A module running in a high-precision dtype by approved override, since ``from_step``:
    all its GEMMs, or ``gemms`` only."""

    dtype: str
    reason: str
    approval: str | None
    from_step: int
    revision: str
    gemms: list[str] | None = None  # absent: all three (every file before per-GEMM overrides)


# -- layers.json --------------------------------------------------------------------------------
# Which module runs FP8 and why: fp8ops.admission decides, this is what the run records.

Kind = Literal[
    "qkv", "proj", "fc1", "fc2", "embedding", "position_embedding", "lm_head", "norm", "other"
]
Parallel = Literal["column", "row", "vocab", "replicated"]
ReasonCode = Literal[
    "fp8",
    "excluded",
    "not_included",
    "small_gemm",
    "fp8_disabled",
    "not_fp8_capable",
    "embedding",
    "lm_head",
    "norm",
    "override",
    "unaligned",
    "module_recipe",  # a GEMM's only: its module_recipes entry runs other GEMMs of the module
    "schedule",  # a phase of precision.schedule covers the step
]
Precision = Literal["fp8", "bf16", "fp16", "fp32"]  # "fp8" or precision.base_dtype


class _LayersRecord(BaseModel):
    # The rows are what layers.json holds: strict and closed, as the manifest is.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class GemmShape(_LayersRecord):
    """A GEMM ``y = x @ W^T`` with ``W`` of shape ``[N, K]``: K inputs, N outputs.

    Written ``{"in": K, "out": N}`` (``in`` is a Python keyword, hence the aliases). For an
    embedding K is the vocabulary and N the width; for a norm both are the width.
    """

    k: int = Field(alias="in", ge=1)
    n: int = Field(alias="out", ge=1)

    @classmethod
    def of(cls, k: int, n: int) -> GemmShape:
        return cls.model_validate({"in": k, "out": n})

    def __str__(self) -> str:
        return f"{self.k} x {self.n}"


class Reason(_LayersRecord):
    """Why a module runs where it does: a code for programs, a sentence for people."""

    code: ReasonCode
    text: str


class Formats(_LayersRecord):
    """The FP8 encodings of an admitted module's casts."""

    forward: Literal["E4M3", "E5M2"]
    backward: Literal["E4M3", "E5M2"]


class GemmPrecision(_LayersRecord):
    """What one of a module's GEMMs runs in, and why: FP8 under the module's recipe (the row's
    ``scaling``, else the file's recipe), or the base dtype."""

    precision: Precision
    reason: Reason


class GemmPrecisions(_LayersRecord):
    """A module's three GEMMs (``fp8ops.gemm_roles``): fprop ``y = x W^T``, dgrad ``dx = dy W``,
    wgrad ``dW = dy^T x``."""

    fprop: GemmPrecision
    dgrad: GemmPrecision
    wgrad: GemmPrecision

    @classmethod
    def uniform(cls, precision: str, reason: Reason) -> GemmPrecisions:
        """All three as their module."""
        each = GemmPrecision(precision=precision, reason=reason)
        return cls(fprop=each, dgrad=each, wgrad=each)

    def items(self) -> list[tuple[str, GemmPrecision]]:
        return [(name, getattr(self, name)) for name in GEMMS]


class AdmissionRow(_LayersRecord):
    """One linear-like module and the precision it runs in: "fp8" when some of its GEMMs run
    FP8 (``gemms`` says which), else the base dtype."""

    fqn: str = Field(min_length=1)
    kind: Kind
    parallel: Parallel
    global_shape: GemmShape
    rank_shape: GemmShape
    params_dtype: str
    precision: Precision
    formats: Formats | None  # None unless precision is "fp8"
    reason: Reason
    # The module's own recipe (precision.module_recipes) where it runs FP8 under another than
    # the run's; None: the run's (and every table written before per-module recipes).
    scaling: Literal["current", "block", "mxfp8"] | None = None
    # Each GEMM's precision and why; None (tables written before per-GEMM precision): all three
    # as the module.
    gemms: GemmPrecisions | None = None

    @model_validator(mode="after")
    def _gemms_agree(self) -> AdmissionRow:
        if self.gemms is None:
            return self
        fp8 = [name for name, gemm in self.gemms.items() if gemm.precision == "fp8"]
        other = {gemm.precision for _, gemm in self.gemms.items()} - {"fp8"}
        # FP8 iff a GEMM is; the others in one dtype, the row's when none is FP8
        base = other if self.precision == "fp8" else other | {self.precision}
        if (self.precision == "fp8") != bool(fp8) or len(base) > 1:
            raise ValueError(
                f"gemms: {self.fqn} runs {self.precision}, but its GEMMs say "
                f"{', '.join(f'{n} {g.precision}' for n, g in self.gemms.items())}"
            )
        return self

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def fp8_gemms(self) -> tuple[str, ...]:
        """The GEMMs that run FP8, in the order fprop, dgrad, wgrad."""
        if self.gemms is None:
            return GEMMS if self.fp8 else ()
        return tuple(name for name, gemm in self.gemms.items() if gemm.precision == "fp8")

    @property
    def some_gemms(self) -> bool:
        """An FP8 module with some of its GEMMs in the base dtype."""
        return self.fp8 and len(self.fp8_gemms) < len(GEMMS)

    def gemm_summary(self) -> str:
        """Its GEMMs in words: "fp8", "bf16", or "fprop fp8; dgrad, wgrad bf16"."""
        if not self.some_gemms:
            return self.precision
        high = [(name, gemm) for name, gemm in self.gemms.items() if gemm.precision != "fp8"]
        dtype = high[0][1].precision
        return f"{', '.join(self.fp8_gemms)} fp8; {', '.join(n for n, _ in high)} {dtype}"


@dataclass(frozen=True)
class AdmissionTable:
    """Every linear-like module of a model, in ``named_modules()`` order, with its decision."""

    rows: tuple[AdmissionRow, ...]
    tensor_parallel: int

    def row(self, fqn: str) -> AdmissionRow:
        for row in self.rows:
            if row.fqn == fqn:
                return row
        raise KeyError(fqn)

    @property
    def fp8_fqns(self) -> tuple[str, ...]:
        return tuple(row.fqn for row in self.rows if row.fp8)

    def counts(self) -> dict[str, int]:
        """Modules per reason code, in the order of ``_SUMMARY_LABELS``."""
        found = Counter(row.reason.code for row in self.rows)
        return {code: found[code] for code in _SUMMARY_LABELS if found[code]}

    def summary(self) -> str:
        """One line, e.g. "8 of 16 modules FP8; 8 in bf16: 1 embedding, 1 LM head, 5 norm"."""
        fp8 = sum(row.fp8 for row in self.rows)  # a phase's recipe: reason schedule, in FP8
        line = f"{fp8} of {len(self.rows)} modules FP8"
        base = [row for row in self.rows if not row.fp8]
        if base:
            dtypes = "/".join(sorted({row.precision for row in base}))
            found = Counter(row.reason.code for row in base)
            parts = ", ".join(
                f"{found[c]} {label}" for c, label in _SUMMARY_LABELS.items() if found[c]
            )
            line += f"; {len(base)} in {dtypes}: {parts}"
        some = sum(row.some_gemms for row in self.rows)
        if some:
            line += f"; {some} FP8 with some GEMMs in the base dtype"
        return line


_SUMMARY_LABELS = {
    "fp8": "FP8",
    "excluded": "excluded",
    "override": "override",
    "schedule": "schedule phase",
    "not_included": "not included",
    "small_gemm": "small GEMM",
    "fp8_disabled": "FP8 disabled",
    "not_fp8_capable": "not FP8-capable",
    "embedding": "embedding",
    "lm_head": "LM head",
    "norm": "norm",
    "unaligned": "unaligned",
}


LAYERS_SCHEMA_VERSION = 1


class RecipeRecord(_LayersRecord):
    """The recipe the admitted modules run under, as layers.json writes it: delayed scaling's
    fields, or a stateless recipe's (``scaling`` names which; the other recipe's are null)."""

    scaling: Literal["delayed", "current", "block", "mxfp8"] = "delayed"
    fp8_format: Literal["hybrid", "e4m3"]
    amax_history_len: int | None = Field(None, ge=1)
    amax_compute_algo: str | None = None
    margin: int | None = Field(None, ge=0)
    reduce_amax: bool | None = None
    power_2_scale: bool | None = None
    amax_epsilon: float | None = None
    x_block_scaling_dim: int | None = None
    w_block_scaling_dim: int | None = None
    grad_block_scaling_dim: int | None = None

    @classmethod
    def from_recipe(cls, recipe) -> RecipeRecord:
        """From a ``fp8ops.precision`` recipe (read by its fields: the run package stays below
        precision)."""
        if hasattr(recipe, "kind"):  # a StatelessRecipe
            block = recipe.kind == "block"
            return cls(
                scaling=recipe.kind,
                fp8_format=recipe.fp8_format.value,
                power_2_scale=None if recipe.kind == "mxfp8" else recipe.power_2_scale,
                amax_epsilon=None if recipe.kind == "mxfp8" else recipe.amax_epsilon,
                x_block_scaling_dim=recipe.x_block_scaling_dim if block else None,
                w_block_scaling_dim=recipe.w_block_scaling_dim if block else None,
                grad_block_scaling_dim=recipe.grad_block_scaling_dim if block else None,
            )
        return cls(
            fp8_format=recipe.fp8_format.value,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo.name,
            margin=recipe.margin,
            reduce_amax=recipe.reduce_amax,
        )

    @property
    def summary(self) -> str:
        """The recipe in one line, as the manifest says it (``recipe_line``)."""
        from fp8ops.manifest.schema import recipe_line

        return recipe_line(self)


class TableChange(_LayersRecord):
    """A switch of the table during training, before ``step``: what caused it (a phase of
    ``precision.schedule`` starting or ending), the modules whose precision changed and the
    hash of the table from then on."""

    step: int = Field(ge=1)
    cause: str
    modules: tuple[str, ...]
    table_hash: str = Field(pattern=r"^[0-9a-f]{64}$")


class LayersDocument(_LayersRecord):
    """The content of a run's ``layers.json``."""

    schema_version: Literal[1]
    manifest_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    tensor_parallel: int = Field(ge=1)
    table_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    recipe: RecipeRecord
    rows: tuple[AdmissionRow, ...]
    # The scheduled switches so far, oldest first; left out of the file while empty.
    history: tuple[TableChange, ...] = ()

    @property
    def table(self) -> AdmissionTable:
        return AdmissionTable(rows=self.rows, tensor_parallel=self.tensor_parallel)


def table_hash(rows: tuple[AdmissionRow, ...], recipe: RecipeRecord) -> str:
    """sha256 of the canonical JSON of the rows and the recipe: the identity of a run's
    per-layer precision, which checkpoints carry to refuse a resume under another one.

    The reasons' sentences are left out (their codes stay in): rewording a message in a later
    fp8ops must not make an old checkpoint look like another run.
    """
    content = {
        # Unset fields left out: a delayed recipe hashes as it did before the others existed.
        "recipe": recipe.model_dump(mode="json", exclude_defaults=True),
        "rows": [_hashed_row(row) for row in rows],
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _hashed_row(row: AdmissionRow) -> dict:
    texts = {name: {"reason": {"text"}} for name in GEMMS}
    content = row.model_dump(
        mode="json", by_alias=True, exclude={"reason": {"text"}, "gemms": texts}
    )
    if content["scaling"] is None:  # the run's recipe: a row hashes as it did before the field
        del content["scaling"]
    # All three GEMMs as the module: hashed as before per-GEMM precision, so a run's table
    # keeps the identity its checkpoints carry.
    uniform = {"precision": row.precision, "reason": {"code": row.reason.code}}
    if content["gemms"] is None or all(g == uniform for g in content["gemms"].values()):
        del content["gemms"]
    return content


def write_layers_json(
    run_dir: str | Path,
    table: AdmissionTable,
    recipe,
    *,
    tensor_parallel: int,
    manifest_hash: str,
    history: tuple[TableChange, ...] = (),
) -> Path:
    """Write ``run_dir/layers.json`` atomically (readers see the old file or the new one);
    ``history``: the table's switches so far (:func:`layers_history`)."""
    if tensor_parallel != table.tensor_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel}, but the table was decided for "
            f"tensor_parallel={table.tensor_parallel}"
        )
    record = RecipeRecord.from_recipe(recipe)
    document = LayersDocument(
        schema_version=LAYERS_SCHEMA_VERSION,
        manifest_hash=manifest_hash,
        tensor_parallel=tensor_parallel,
        table_hash=table_hash(table.rows, record),
        recipe=record,
        rows=table.rows,
        history=history,
    )
    path = RunLayout(run_dir).layers
    empty = {"history"} if not history else None
    atomic_write_text(path, document.model_dump_json(by_alias=True, indent=2, exclude=empty) + "\n")
    return path


def layers_history(run_dir: str | Path, *, before: int | None = None) -> tuple[TableChange, ...]:
    """The switches ``run_dir/layers.json`` records, those before step ``before`` only when
    given (a resume drops what its checkpoint had not run yet); none without the file."""
    if not RunLayout(run_dir).layers.is_file():
        return ()
    history = read_layers_json(run_dir).history
    return tuple(c for c in history if before is None or c.step < before)


def read_layers_json(run_dir: str | Path) -> LayersDocument:
    """Read and check ``run_dir/layers.json``; :class:`LayersFileError` names the file."""
    run_dir = Path(run_dir)
    path = RunLayout(run_dir).layers
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "no such run directory"
        raise LayersFileError(f"{run_dir}: {what}")
    if not path.is_file():
        raise LayersFileError(
            f"{path}: no such file; the run has not recorded its per-layer precision "
            "(layers.json is written when training starts)"
        )
    try:
        text = path.read_text(encoding="utf-8")
        document = LayersDocument.model_validate_json(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise LayersFileError(f"{path}: cannot read: {exc}") from None
    except ValidationError as exc:
        raise LayersFileError(f"{path}: corrupt layers file: {_describe(exc)}") from None
    expected = table_hash(document.rows, document.recipe)
    if document.table_hash != expected:
        raise LayersFileError(
            f"{path}: corrupt layers file: table_hash {document.table_hash[:12]}... does not "
            f"match its rows and recipe ({expected[:12]}...); it was edited or damaged"
        )
    return document


def _describe(exc: ValidationError, limit: int = 3) -> str:
    problems = []
    for error in exc.errors()[:limit]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        problems.append(f"{loc.lstrip('.') or 'top level'}: {error['msg']}")
    more = f" (and {exc.error_count() - limit} more)" if exc.error_count() > limit else ""
    return "; ".join(problems) + more


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
        document = loads_json(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunRecordError(f"{file}: no such file") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
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
