"""``import_te_debug``: a run's TE debug statistics logs become an fp8ops run directory.

::

    result = import_te_debug("megatron-run/debug_logs", "runs/te-run", manifest="m.yaml")

Reads every rank's log (``logs.py``), works out the store's columns from the names seen
(``names.py``: TE stats that mean what a catalogue metric means fill it; the others are kept
under TE's names), checks that the ranks agree on their iterations, and writes, into a
temporary directory beside ``out`` that is renamed to ``out`` only once everything is written:

* ``telemetry.zarr``: one rank group per log, the step numbers TE's iteration numbers, every
  iteration between the first and the rank's last a row (NaN where nothing was logged), written
  by :class:`~fp8ops.telemetry.store.TelemetryWriter` (the committed-steps protocol);
* ``run.json`` (``imported``: the files and their sha256, what was mapped and kept, the
  warnings), ``status.json`` (state ``imported``) and ``events.jsonl``;
* with a manifest, ``alerts.jsonl``: its alert rules replayed over the store
  (:mod:`fp8ops.alerts.replay`).

So a failure anywhere (a bad line, a full disk, Ctrl-C) leaves no ``out``; a crash leaves only
the temporary ``.NAME.importing-PID`` directory. ``layers.json`` is not written: TE's logs
give no GEMM shapes, parallelism or admission reasons, and a made-up table would be read as
fact.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp8ops import __version__
from fp8ops.alerts.replay import Replay, record_replay, replay_alerts
from fp8ops.files import append_lines, atomic_write_text, json_line
from fp8ops.manifest import Manifest, load_manifest
from fp8ops.run import RunLayout, RunRecord, Status
from fp8ops.run.records import ImportedFile, ImportedFrom, RunTopology
from fp8ops.te_import.logs import NameTable, RankLog, TeLogError, find_rank_files, read_rank_log
from fp8ops.te_import.names import (
    INF_MEANS_INF_ELEMENT,
    NAMINGS,
    NAN_MEANS_NAN_ELEMENT,
    SLOTS,
    TE_RECIPE,
    catalogue_metric,
    kept_column,
    module_name,
    parse_stat,
    split_name,
)
from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, describe
from fp8ops.telemetry.store import FLUSH_EVERY, STORE_NAME, TelemetryWriter

FP8OPS_RECIPE = {te: ours for ours, te in TE_RECIPE.items()}


@dataclass
class ImportResult:
    """What was imported, and where."""

    run_dir: Path
    modules: tuple[str, ...]
    mapped: dict[str, str]  # TE's "<tensor>_<stat>" -> the catalogue metric it fills
    kept: list[str]  # columns under TE's names
    steps: dict[int, int]  # rank -> committed steps
    first_step: int
    lines: int
    recipe: str | None
    warnings: list[str] = field(default_factory=list)
    replay: Replay | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class _Column:
    """Where one TE name's values go: module and column, the factor from TE's unit, and the
    columns its non-finite values flag (-1: none)."""

    module: int
    column: int
    factor: float
    nan_flag: int
    inf_flag: int
    quantized: bool  # a quantized-tensor stat: the layer ran a quantized cast that step


def import_te_debug(
    log_dir: str | Path,
    out: str | Path,
    *,
    recipe: str | None = None,
    manifest: str | Path | None = None,
    naming: str = "te",
    ranks_may_differ: bool = False,
    command: Sequence[str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> ImportResult:
    """Import ``log_dir``'s statistics logs into the new run directory ``out``.

    ``recipe``: the recipe the layers trained with (fp8ops' word: delayed, current, block,
    mxfp8, nvfp4), which says whether TE's recipe-named stats are the training casts' or a
    "what if"; default: the manifest's, else what the stats' names imply. ``manifest``: also
    replay its alert rules into ``alerts.jsonl``. ``naming``: module names as TE logged them
    (``te``) or, for names from ``infer_and_assign_layer_names``, fp8ops' module paths
    (``inferred``). ``ranks_may_differ``: ranks logging different iterations (not only one
    ending early) is a warning instead of an error. ``warn`` sees each warning as it comes.
    """
    started = time.perf_counter()
    log_dir, out = Path(log_dir).resolve(), Path(out)
    warnings: list[str] = []

    def note(message: str) -> None:
        warnings.append(message)
        if warn is not None:
            warn(message)

    if naming not in NAMINGS:
        raise TeLogError(f"--naming {naming!r}: choose {' or '.join(NAMINGS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TeLogError(
            f"{out} exists and is not an empty directory; fp8ops never writes over a run: "
            "give a new --out"
        )
    loaded = load_manifest(manifest) if manifest is not None else None
    recipe, recipe_from = _recipe(recipe, loaded, manifest)

    files = find_rank_files(log_dir)
    table, logs = NameTable(), []
    splits: dict[str, tuple[str, str, str]] = {}

    def usable(name: str, where: str) -> bool:
        parts = split_name(name)
        if parts is None:
            note(
                f"{where}: {name!r} names no tensor TE logs (activation, gradient, weight, "
                "output, wgrad, dgrad), so its layer and stat cannot be told apart: its lines "
                "are left out"
            )
            return False
        layer, tensor, stat = parts
        try:
            parts = (module_name(layer, naming), tensor, stat)
        except ValueError as exc:
            raise TeLogError(f"{where}: {exc}") from None
        if not parse_stat(stat).known and not any(s[2] == stat for s in splits.values()):
            note(
                f"{where}: {stat!r} is not a stat Transformer Engine documents; kept under its "
                f"own name ({kept_column(tensor, stat)})"
            )
        splits[name] = parts
        return True

    for rank, path in files.items():
        logs.append(read_rank_log(path, rank, table, note, usable))
    lines = sum(len(log.names) for log in logs)
    if lines == 0:
        raise TeLogError(
            f"no statistics lines in {', '.join(str(p) for p in files.values())}: did the run "
            "enable LogTensorStats, LogFp8TensorStats or LogNvfp4TensorStats, and call "
            "debug_api.step() every iteration?"
        )
    recipe, recipe_from = _recipe_from_stats(recipe, recipe_from, splits, table)
    modules, columns, catalogue, mapped, kept = _columns(table, splits, recipe, note)
    first = int(min(log.iterations.min() for log in logs if len(log.names)))
    _check_ranks_agree(logs, ranks_may_differ, note)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)  # a crashed import of ours, this same pid
    work.mkdir()
    try:
        run_id = uuid.uuid4().hex
        steps = _write_store(work / STORE_NAME, logs, modules, columns, catalogue, first, run_id)
        last = first + max(steps.values()) - 1
        imported = ImportedFrom(
            kind="te_debug",
            source=str(log_dir),
            files=[_file_record(log, log_dir) for log in logs],
            imported_at=_now(),
            fp8ops_version=__version__,
            recipe=recipe,
            recipe_from=recipe_from,
            naming=naming,
            first_iteration=first,
            last_iteration=last,
            mapped=mapped,
            kept=kept,
            warnings=warnings,
        )
        _write_records(work, imported, run_id, len(logs), command, logs)
        replay = None
        if loaded is not None:
            replay = replay_alerts(work, loaded)
            record_replay(work, replay, manifest)
        if out.exists():
            out.rmdir()  # empty (checked above); rename(2) would take it, a clear error if not
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    return ImportResult(
        out, modules, mapped, kept, steps, first, lines, recipe, warnings, replay, seconds
    )


# -- the recipe ---------------------------------------------------------------------------------


def _recipe(
    recipe: str | None, manifest: Manifest | None, path: str | Path | None
) -> tuple[str | None, str | None]:
    if recipe is not None:
        if recipe not in TE_RECIPE:
            raise TeLogError(f"--recipe {recipe!r}: choose {', '.join(TE_RECIPE)}")
        return recipe, "--recipe"
    if manifest is not None and manifest.precision.enabled:
        return manifest.precision.scaling, f"the manifest {path}"
    return None, None


def _recipe_from_stats(
    recipe: str | None, recipe_from: str | None, splits: dict, table: NameTable
) -> tuple[str | None, str | None]:
    """Stats only delayed scaling has (TE cannot cast to it as a "what if") name the recipe."""
    delayed = next(
        (
            (name, where)
            for name, where in zip(table.names, table.first_seen, strict=True)
            if name in splits
            and (
                parse_stat(splits[name][2]).recipe == "fp8_delayed_scaling"
                or parse_stat(splits[name][2]).base == "overflows%"
            )
        ),
        None,
    )
    if delayed is None:
        return recipe, recipe_from
    if recipe is not None and recipe != "delayed":
        raise TeLogError(
            f"{delayed[1]}: {delayed[0]} is a delayed-scaling stat, which TE logs only when the "
            f"layers train with delayed scaling, but {recipe_from} says {recipe}; give the "
            "recipe the run trained with"
        )
    return "delayed", recipe_from or f"the stats' names ({delayed[0]}, {delayed[1]})"


# -- columns ------------------------------------------------------------------------------------

_KEPT_UNITS = {
    "min": "value",
    "max": "value",
    "mean": "value",
    "std": "value",
    "l1_norm": "L1",
    "l2_norm": "L2",
    "cur_amax": "|value|",
    "dynamic_range": "log2",
    "underflows%": "%",
    "overflows%": "%",
    "underflows_num": "count",
    "overflows_num": "count",
    "scale_inv_min": "factor",
    "scale_inv_max": "factor",
    "mse": "value^2",
    "total_square_error": "value^2",
}


def _columns(table: NameTable, splits: dict, recipe: str | None, note: Callable[[str], None]):
    """Modules (first appearance), each name's column, the store's catalogue, and the mapped
    and kept names."""
    te_recipe = TE_RECIPE.get(recipe) if recipe else None
    modules: dict[str, int] = {}
    kept: dict[str, int] = {}
    meanings: dict[str, str] = {}
    mapped: dict[str, str] = {}
    cells: dict[tuple[int, int], str] = {}
    columns: list[_Column] = []
    base = len(MODULE_METRIC_NAMES)
    for name, where in zip(table.names, table.first_seen, strict=True):
        layer, tensor, stat_name = splits[name]
        module = modules.setdefault(layer, len(modules))
        stat = parse_stat(stat_name)
        target = catalogue_metric(tensor, stat, te_recipe)
        if target is not None:
            column, factor = MODULE_METRIC_NAMES.index(target.metric), target.factor
            mapped[f"{tensor}_{stat_name}"] = target.metric
            meanings[target.metric] = _meaning(tensor, stat_name, target.metric, target.factor)
        else:
            label = kept_column(tensor, stat_name)
            column, factor = base + kept.setdefault(label, len(kept)), 1.0
        other = cells.setdefault((module, column), name)
        if other != name:
            note(
                f"{where}: {name} fills the same cell as {other}; where both are logged for an "
                "iteration, the later line's value is kept"
            )
        slot = SLOTS.get(tensor)
        nan_flag = inf_flag = -1
        if slot is not None and stat.base in NAN_MEANS_NAN_ELEMENT:
            nan_flag = MODULE_METRIC_NAMES.index(f"{slot}.nan")
        if slot is not None and stat.base in INF_MEANS_INF_ELEMENT:
            inf_flag = MODULE_METRIC_NAMES.index(f"{slot}.inf")
        quantized = stat.quantized and slot is not None
        columns.append(_Column(module, column, factor, nan_flag, inf_flag, quantized))
        if quantized:
            meanings["fp8_enabled"] = (
                "1 where TE logged a quantized tensor's statistic (LogFp8TensorStats, "
                "LogNvfp4TensorStats) of the module at that iteration: it ran a quantized "
                "cast; NaN elsewhere (not known, not 0)"
            )
        for flag, what, where_ in (("nan", "NaN", nan_flag), ("inf", "infinite", inf_flag)):
            if where_ >= 0:
                meanings[f"{slot}.{flag}"] = (
                    f"1 where a value TE logged for the {tensor} was {what} (its max |x|, "
                    "min, max, mean, norms or mse: only such an element makes them so; TE "
                    "counts none, so 1 means at least one); NaN elsewhere"
                )
    catalogue = describe()
    entries = catalogue["module_metrics"]
    for entry in entries:
        if entry["name"] in meanings:
            entry["meaning"] = meanings[entry["name"]]
    for label in kept:
        tensor, stat_name = label.split(".", 2)[1:]
        unit = _KEPT_UNITS.get(parse_stat(stat_name).base, "")
        if parse_stat(stat_name).recipe == "mxfp8" and "scale_inv" in stat_name:
            unit = "E8M0 byte"  # TE reads the raw scale buffer: exponent bytes for MXFP8
        entries.append(
            {
                "name": label,
                "unit": unit,
                "meaning": f"Transformer Engine's {stat_name!r} of the {tensor}, as logged "
                "(four decimals), kept under its own name: no catalogue metric means the same",
            }
        )
    return tuple(modules), columns, catalogue, mapped, list(kept)


def _meaning(tensor: str, stat: str, metric: str, factor: float) -> str:
    scaled = f", divided by {1 / factor:g}" if factor != 1 else ""
    return (
        f"From Transformer Engine's {stat!r} of the {tensor} (nvdlfw_inspect statistics log, "
        f"four decimals{scaled}): over the step's micro-batches and TE's reduction group"
    )


# -- checks -------------------------------------------------------------------------------------


def _check_ranks_agree(logs: list[RankLog], may_differ: bool, note: Callable[[str], None]) -> None:
    """Every rank logs the iterations the others do; one that ends early (a crash, a torn file)
    is a warning, any other difference an error (``may_differ``: a warning too)."""
    logged = [(log, log.steps) for log in logs]
    for log, steps in logged:
        if len(steps) == 0:
            note(f"{log.path}: rank {log.rank} logged no statistics; its telemetry is empty")
    logged = [(log, steps) for log, steps in logged if len(steps)]
    union = np.unique(np.concatenate([steps for _, steps in logged]))
    for log, steps in logged:
        if np.array_equal(steps, union):
            continue
        if np.array_equal(steps, union[: len(steps)]):
            note(
                f"{log.path}: rank {log.rank}'s log ends at iteration {steps[-1]}, the other "
                f"ranks' go on to {union[-1]}: its log was cut short (a crash?); its telemetry "
                f"ends there"
            )
            continue
        # Not a prefix of the union, so some iteration before its last is missing.
        probe = np.setdiff1d(union[union <= steps[-1]], steps)[0]
        other = next(other for other, theirs in logged if probe in theirs)
        what = f"has no iteration {probe}, which {other.path} logged"
        message = (
            f"{log.path}: rank {log.rank} {what}: the ranks disagree on their iterations (logs "
            "of different runs, or different freq per rank)"
        )
        if not may_differ:
            raise TeLogError(
                message + "; if that is how the run logged, import with --ranks-may-differ"
            )
        note(message)


# -- writing ------------------------------------------------------------------------------------


def _write_store(
    path: Path,
    logs: list[RankLog],
    modules: tuple[str, ...],
    columns: list[_Column],
    catalogue: dict,
    first: int,
    run_id: str,
) -> dict[int, int]:
    """Every rank's rows, through TelemetryWriter; rank -> committed steps."""
    names = [m["name"] for m in catalogue["module_metrics"]]
    spec = {
        key: np.array([getattr(c, key) for c in columns])
        for key in ("module", "column", "factor", "nan_flag", "inf_flag", "quantized")
    }
    enabled = MODULE_METRIC_NAMES.index("fp8_enabled")
    attrs = {"run_id": run_id, "imported": "te_debug"}
    step_row = np.full(len(STEP_METRIC_NAMES), np.nan, np.float32)  # TE logs no loss
    steps = {}
    for log in sorted(logs, key=lambda log: log.rank):  # rank 0 creates the store
        count = int(log.iterations.max()) - first + 1 if len(log.names) else 0
        with TelemetryWriter(
            path,
            rank=log.rank,
            modules=modules,
            module_metrics=names,
            first_step=first,
            attrs=attrs,
            catalogue=catalogue,
        ) as writer:
            rows = log.iterations - first
            ids = log.names
            module, column = spec["module"][ids], spec["column"][ids]
            values = log.values * spec["factor"][ids]
            for lo in range(0, count, FLUSH_EVERY):
                hi = min(lo + FLUSH_EVERY, count)
                a, b = np.searchsorted(rows, [lo, hi])
                block = np.full((hi - lo, len(modules), len(names)), np.nan, np.float32)
                r, m = rows[a:b] - lo, module[a:b]
                block[r, m, column[a:b]] = values[a:b]  # in file order: a later line wins
                for flag, bad in (("nan_flag", np.isnan), ("inf_flag", np.isinf)):
                    hit = (spec[flag][ids[a:b]] >= 0) & bad(log.values[a:b])
                    block[r[hit], m[hit], spec[flag][ids[a:b]][hit]] = 1
                quantized = spec["quantized"][ids[a:b]]
                block[r[quantized], m[quantized], enabled] = 1
                for offset in range(hi - lo):
                    writer.append(first + lo + offset, block[offset], step_row)
        steps[log.rank] = count
    return steps


def _write_records(
    work: Path,
    imported: ImportedFrom,
    run_id: str,
    ranks: int,
    command: Sequence[str] | None,
    logs: list[RankLog],
) -> None:
    layout = RunLayout(work)
    record = RunRecord(
        run_id=run_id,
        command=list(command if command is not None else sys.argv),
        topology=RunTopology(world_size=ranks),
        imported=imported,
    )
    atomic_write_text(layout.run_record, record.model_dump_json(indent=2, exclude_none=True) + "\n")
    status = Status(
        state="imported",
        updated=_now(),
        step=imported.last_iteration,
        reason=f"imported from Transformer Engine debug logs in {imported.source}",
    )
    atomic_write_text(layout.status, status.model_dump_json(indent=2, exclude_none=True) + "\n")
    times = [t for log in logs for t in (log.first_time, log.last_time) if t]
    event = {
        "event": "imported",
        "time": imported.imported_at,
        "source": imported.source,
        "files": len(imported.files),
        "lines": sum(f.lines for f in imported.files),
        "warnings": len(imported.warnings),
        "logged_from": min(times, default=None),
        "logged_to": max(times, default=None),
    }
    append_lines(layout.events, json_line(event))


def _file_record(log: RankLog, source: Path) -> ImportedFile:
    return ImportedFile(
        path=str(log.path.relative_to(source)),
        sha256=log.sha256,  # of the bytes parsed
        bytes=log.size,
        rank=log.rank,
        lines=len(log.names),
        skipped=log.skipped,
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
