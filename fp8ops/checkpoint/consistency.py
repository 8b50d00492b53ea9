"""One definition of "this checkpoint is consistent": where its metadata says training stood
agrees with everything else the checkpoint holds.

``fp8ops_checkpoint.json`` is not in its own hash list, so an edit of it (a step "corrected" by
hand, a file copied from another checkpoint) is caught by nothing else: a resume from a record
whose step is ahead of its weights and data position trains on with steps skipped and reports
the run completed. So every reader of a checkpoint (the resume's planning and load, ``fp8ops
checkpoints list`` and ``export``) calls :func:`read_consistent` before it reads or advises
anything else about it, and a checkpoint that disagrees with itself is refused as damaged,
naming the previous checkpoint to resume from.

What is cross-checked, all from small files (no tensor is read, torch is not imported):

* the directory's name (``step_N``) names the record's step;
* the seal, ``fp8ops_progress.json``: the step, data position, optimizer step count, telemetry
  commit, revision chain and ledger anchor, written beside the tensors and so covered by the
  record's sha256 of every file; checkpoints saved before it existed have none and skip this;
* the optimizer steps at most once a step (``optimizer_steps``), and the telemetry store was
  committed up to the step at most (``telemetry_committed``);
* the revision chain (``revisions``) ends at the checkpoint's manifest, each revision's parent
  the one before it; the chain and the ledger anchor are sealed too, since the ledger's rules
  are read from them (``fp8ops.overrides.anchors``);
* the data position: every step, skipped ones too, takes one global batch from the sampler
  (``fp8ops.data.sampler``), so while the run kept one ``schedule.global_batch_size`` the
  position is where ``step`` batches end.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fp8ops.checkpoint.directory import META_FILE, CheckpointError, checkpoint_step, damaged
from fp8ops.checkpoint.meta import CheckpointMeta, read_meta
from fp8ops.errors import Fp8opsError
from fp8ops.files import loads_json
from fp8ops.manifest import ManifestStore
from fp8ops.run import RunLayout, read_run_record

SEAL_FILE = "fp8ops_progress.json"
# Where training stood, and what the ledger's rules are read from: the revision chain and the
# ledger anchor (a revision added to the chain, or the anchor dropped, would loosen them).
_SEALED = (
    "step",
    "sampler",
    "optimizer_steps",
    "telemetry_committed",
    "manifest",
    "revisions",
    "ledger",
)


def write_seal(directory: Path, **fields) -> None:
    """The record's ``_SEALED`` fields, written into a save before its files are hashed."""
    if set(fields) != set(_SEALED):
        raise ValueError(f"a seal holds exactly {_SEALED}, not {sorted(fields)}")
    (Path(directory) / SEAL_FILE).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def read_consistent(directory: Path) -> CheckpointMeta:
    """The metadata of the checkpoint in ``directory``, once it agrees with itself."""
    meta = read_meta(directory)
    check_consistent(directory, meta)
    return meta


def check_consistent(directory: Path, meta: CheckpointMeta) -> None:
    """Raise :class:`CheckpointError` if ``meta`` disagrees with the rest of its checkpoint."""
    directory = Path(directory)
    for check in (_name, _seal, _counts, _revision_chain, _data_position):
        problem = check(directory, meta)
        if problem is not None:
            raise CheckpointError(
                f"{directory / META_FILE}: {problem}: the checkpoint disagrees with itself (its "
                f"record was edited, or it is damaged), so nothing it says can be trusted; "
                f"{damaged(directory)}"
            )


def _name(directory: Path, meta: CheckpointMeta) -> str | None:
    named = checkpoint_step(directory.name)
    if named is not None and named != meta.step:
        return f"it says step {meta.step}, but its directory {directory.name} is step {named}'s"
    return None


def _seal(directory: Path, meta: CheckpointMeta) -> str | None:
    path, saved = directory / SEAL_FILE, meta.files.get(SEAL_FILE)
    if saved is None:
        if path.exists():  # its hash taken out of the record
            return f"{SEAL_FILE} is not among the files it lists with their sha256"
        return None  # saved before checkpoints were sealed
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return f"{SEAL_FILE}, its sealed record of where training stood, is missing"
    if hashlib.sha256(data).hexdigest() != saved["sha256"]:
        return f"{SEAL_FILE} changed since it was saved (sha256 mismatch)"
    try:
        sealed = loads_json(data)
    except ValueError:
        return f"{SEAL_FILE} is not valid JSON"
    if not isinstance(sealed, dict):
        return f"{SEAL_FILE} is not a record"
    recorded = meta.model_dump(mode="json", include=set(_SEALED))
    for field in _SEALED:
        if sealed.get(field) != recorded[field]:
            return (
                f"it says {field} {recorded[field]}, but the record sealed with its files "
                f"({SEAL_FILE}) says {sealed.get(field)}"
            )
    return None


def _revision_chain(directory: Path, meta: CheckpointMeta) -> str | None:
    """``revisions`` is the chain of the checkpoint's own revision: it ends there, and each
    revision the run stores names the one before it as its parent (a revision's name is its
    hash, so no other can be slipped in)."""
    if meta.revisions[-1:] != [meta.manifest]:
        return f"its revision chain does not end at its own manifest {meta.manifest[:12]}"
    store = ManifestStore(RunLayout(directory.parent.parent).manifests)
    for parent, child in zip(meta.revisions, meta.revisions[1:]):
        if not store.path_for(child).exists():
            continue  # not stored in this run: the resume's own checks say so
        try:
            named = store.get(child).revision.parent
        except (Fp8opsError, OSError):
            return None  # an edited or unreadable revision: check_run_revisions names it
        if named != parent:
            return (
                f"its revision chain lists {parent[:12]} before {child[:12]}, whose parent is "
                f"{str(named)[:12]}"
            )
    return None


def _counts(directory: Path, meta: CheckpointMeta) -> str | None:
    if meta.optimizer_steps > meta.step:
        return (
            f"it says the optimizer took {meta.optimizer_steps} steps in {meta.step} training "
            "steps (at most one a step)"
        )
    if meta.telemetry_committed is not None and meta.telemetry_committed > meta.step:
        return (
            f"it says telemetry was committed up to step {meta.telemetry_committed}, after its "
            f"step {meta.step}"
        )
    position = [meta.sampler.get(key) for key in ("epoch", "cursor")]
    if None in position or min(position) < 0:
        return f"its data position (sampler {meta.sampler}) is not one a sampler can be at"
    return None


def _data_position(directory: Path, meta: CheckpointMeta) -> str | None:
    """Where ``meta.step`` global batches end: ``epoch`` full passes of ``n // batch`` steps
    (an incomplete last batch is dropped), then ``cursor`` sequences into the next pass. A new
    pass starts only when a batch is drawn, so after its first step its cursor is >= one batch.
    """
    batch = _one_global_batch_size(directory, meta)
    if batch is None:
        return None
    epoch, cursor, step = meta.sampler["epoch"], meta.sampler["cursor"], meta.step
    taken, rest = divmod(cursor, batch)
    if epoch == 0:
        fits = cursor == step * batch
    else:  # the steps of each earlier pass, (step - taken) / epoch, are a whole number >= taken
        fits = rest == 0 and taken >= 1 and (step - taken) % epoch == 0
        fits = fits and (step - taken) // epoch >= taken
    if fits:
        return None
    ends = f" (epoch 0, cursor {step * batch})" if epoch == 0 else ""
    return (
        f"its data position (sampler epoch {epoch}, cursor {cursor}) is not where {step} steps "
        f"of {batch} sequences end{ends}"
    )


def _one_global_batch_size(directory: Path, meta: CheckpointMeta) -> int | None:
    """The global batch size of every revision the checkpoint's run trained under: those of its
    chain from the one the run started with (``run.json``), read from the run's
    ``manifests/``. None when it changed (an accepted drift) or cannot be told (the resume's own
    checks say why)."""
    run = directory.parent.parent
    try:
        started = read_run_record(run).manifest
    except (Fp8opsError, OSError):
        return None
    if started not in meta.revisions:
        return None
    store = ManifestStore(RunLayout(run).manifests)
    sizes = set()
    for digest in meta.revisions[meta.revisions.index(started) :]:
        try:
            sizes.add(store.get(digest).schedule.global_batch_size)
        except (Fp8opsError, OSError):
            return None
    return sizes.pop() if len(sizes) == 1 else None
