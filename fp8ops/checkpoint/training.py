"""Saving and loading a training checkpoint (collective: every rank calls these together).

Save: every rank hands its shards to ``dist_checkpointing.save`` in a hidden ``.partial``
directory; rank 0 then writes the manifest, the seal of where training stood
(``consistency.write_seal``) and ``fp8ops_checkpoint.json`` (with every file's sha256) and
publishes it (``directory.CheckpointDir.publish``).

Load: rank 0 checks the metadata agrees with the rest of the checkpoint (``consistency``),
verifies every file against the saved hashes and the pickles against the allow-list (all ranks
learn the verdict), then every rank loads its shards and puts them back.
The restored weights are re-fingerprinted and every module's FP8 state is re-hashed against the
digests saved with the checkpoint, so a silent reset (scales back to 1, empty histories) or a
mis-mapped state can never pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from fp8ops.checkpoint import state
from fp8ops.checkpoint.consistency import check_consistent, write_seal
from fp8ops.checkpoint.directory import CheckpointDir, CheckpointError, file_digests, verify_files
from fp8ops.checkpoint.meta import CheckpointMeta, Fp8StateRecord, TopologyRecord, write_meta
from fp8ops.checkpoint.sharded_io import load_sharded, save_sharded, saved_keys
from fp8ops.collective import on_rank0, raise_if_any
from fp8ops.manifest import manifest_hash, write_manifest
from fp8ops.run.layout import MANIFEST


@dataclass
class TrainingParts:
    """What a checkpoint saves from, and loads into."""

    model: nn.Module
    optimizer: object  # fp8ops.train.optimizer's (canonical_state, steps, keeps_main_copy)
    fp8_modules: dict[str, nn.Module]
    alert_engine: object | None
    layout: state.Fp8Layout
    ranks: object  # fp8ops.train.distributed.Ranks
    tp_group: object
    stages: int = 1  # topology.pipeline_parallel


def save_checkpoint(
    parts: TrainingParts,
    run_dir: Path,
    *,
    step: int,
    reason: str,
    manifest,
    revisions: list[str],
    environment: dict,
    topology: TopologyRecord,
    admission: str | None,
    sampler: dict,
    telemetry_committed: int | None,
    keep: int | None,
    ledger: dict | None = None,
) -> tuple[Path, float]:
    """Write the checkpoint of ``step`` and publish it, keeping the newest ``keep`` (None:
    every one); returns its path and the seconds taken."""
    from fp8ops.checkpoint.weights import FINGERPRINT_SCHEME, weights_fingerprint

    started = time.perf_counter()
    store = CheckpointDir(run_dir)
    main = parts.ranks.is_main
    partial = on_rank0(main, lambda: store.begin(step), error=CheckpointError)
    weights = state.weights_state(parts.model)
    sharded = {
        **weights,
        **state.optimizer_state(parts.optimizer, weights),
        **state.fp8_state(parts.fp8_modules, parts.layout),
        **state.per_rank_state(parts.alert_engine, parts.ranks),
    }
    digests = state.group_digests(parts.fp8_modules, parts.layout)
    fingerprint = weights_fingerprint(parts.model, parts.tp_group, scheme=FINGERPRINT_SCHEME)
    optimizer_steps = parts.optimizer.steps
    save_sharded(sharded, partial)
    dist.barrier()

    def publish() -> Path:
        write_manifest(manifest, partial / MANIFEST)
        write_seal(
            partial,
            step=step,
            sampler=sampler,
            optimizer_steps=optimizer_steps,
            telemetry_committed=telemetry_committed,
            manifest=manifest_hash(manifest),
            revisions=revisions,
            ledger=ledger,
        )
        meta = CheckpointMeta(
            step=step,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            reason=reason,
            manifest=manifest_hash(manifest),
            revisions=revisions,
            environment=environment,
            topology=topology,
            admission=admission,
            weights_fingerprint=fingerprint,
            weights_fingerprint_scheme=FINGERPRINT_SCHEME,
            fp8=Fp8StateRecord(
                layout=parts.layout.name,
                groups=parts.layout.groups,
                history_len=_history_len(parts.fp8_modules),
                modules=list(digests),  # every stage's
                digests=digests,
            ),
            sampler=sampler,
            optimizer_steps=optimizer_steps,
            optimizer_main=parts.optimizer.keeps_main_copy,
            telemetry_committed=telemetry_committed,
            per_rank_state=True,
            files=file_digests(partial),
            ledger=ledger,
        )
        write_meta(partial, meta)
        return store.publish(partial, step, keep)

    path = on_rank0(main, publish, error=CheckpointError)
    return path, time.perf_counter() - started


def _history_len(modules: dict) -> int:
    return next(iter(modules.values())).fp8_meta.forward.amax_history.shape[0] if modules else 0


def load_checkpoint(
    parts: TrainingParts,
    directory: Path,
    meta: CheckpointMeta,
    *,
    fp8_read: str,
    alert_windows: bool = True,
) -> float:
    """Load ``directory`` into ``parts`` and verify what was restored; returns seconds taken.

    ``fp8_read`` is ``resume.plan_resume``'s mapping: "own" (each state group reads its own
    slice) or "group0" (a topology change over identical groups: every rank reads slice 0).
    Per-rank state (RNG, alert windows) is restored at the same world size and pipeline size
    only, and the alert
    windows only when ``alert_windows`` (the alert configuration is unchanged).
    """
    from fp8ops.checkpoint.weights import weights_fingerprint

    started = time.perf_counter()
    _agree_files_verified(directory, meta, parts.ranks.is_main)
    weights = state.weights_state(parts.model)
    optimizer = state.optimizer_state(parts.optimizer, weights, for_load=True)
    if not meta.optimizer_main:
        optimizer = {k: v for k, v in optimizer.items() if not k.startswith("optimizer.main.")}
    if fp8_read == "own":
        fp8, read_group = state.fp8_state(parts.fp8_modules, parts.layout), parts.layout.group
    else:
        fp8 = state.fp8_state_all_groups(parts.fp8_modules, meta.fp8.groups, parts.ranks.rank)
        read_group = 0
    sharded = {**weights, **optimizer, **fp8}
    # Rank r holds the same modules only at the same world size and the same stages.
    same_world = (
        meta.topology.world_size == parts.ranks.world_size
        and meta.topology.pipeline_parallel == parts.stages
    )
    alerts = parts.alert_engine if alert_windows else None
    if same_world:
        per_rank = state.per_rank_state(alerts, parts.ranks)
        if alerts is not None:
            # A rule added since the save has no windows there: it starts afresh (the others
            # continue), instead of failing the load (AlertEngine.load_state_dict).
            saved = saved_keys(directory)
            per_rank = {k: v for k, v in per_rank.items() if k in saved or "alerts." not in k}
        sharded.update(per_rank)
    loaded = load_sharded(sharded, directory)
    model_keys = {k: loaded[k] for k in weights}
    missing, unexpected = parts.model.load_state_dict(model_keys, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: checkpoint and model disagree (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]})"
        )
    state.restore_optimizer(parts.optimizer, weights, loaded)
    parts.optimizer.set_steps(meta.optimizer_steps)
    state.restore_fp8(parts.fp8_modules, loaded)
    if same_world:
        state.restore_per_rank(loaded, alerts)

    # The same on every rank, under the scheme it was saved with.
    found = weights_fingerprint(parts.model, parts.tp_group, scheme=meta.weights_fingerprint_scheme)
    if found != meta.weights_fingerprint:
        raise CheckpointError(
            f"{directory}: the restored weights hash to {found[:12]}, but they were saved as "
            f"{meta.weights_fingerprint[:12]}; refusing to train on them"
        )
    # Per-rank FP8 state may fail on some ranks only; all of them must stop together.
    try:
        verify_fp8(parts.fp8_modules, meta, read_group, directory)
        problem = None
    except CheckpointError as exc:
        problem = str(exc)
    raise_if_any(problem, error=CheckpointError)
    return time.perf_counter() - started


def verify_fp8(modules: dict, meta: CheckpointMeta, group: int, directory: Path) -> None:
    """Every module's restored FP8 state hashes to what its group saved."""
    for name, module in modules.items():
        saved = meta.fp8.digests.get(name)
        if saved is None:
            raise CheckpointError(
                f"{directory}: holds no FP8 state for {name}; the model has modules the "
                "checkpoint's does not"
            )
        found = state.fp8_digest(module)
        if found != saved[group]:
            raise CheckpointError(
                f"{directory}: {name}'s FP8 state after loading (sha256 {found[:12]}) is not "
                f"the state saved ({saved[group][:12]}): scales or amax histories were lost or "
                "reset; refusing to train on them"
            )


def _agree_files_verified(directory: Path, meta: CheckpointMeta, is_main: bool) -> None:
    """Rank 0 checks the record agrees with itself and the files are whole; every rank raises
    the same error if not."""

    def verify() -> None:
        check_consistent(directory, meta)
        verify_files(directory, meta.files)

    on_rank0(is_main, verify, error=CheckpointError)
