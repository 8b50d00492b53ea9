"""What a ledger read is held to, anchored in the run's checkpoints.

The ledger's rules come from the run's manifest: who may approve (``review``), whose keys sign
(``review.allowed_signers``), which policy approves alone (``alerts.auto_degrade``). Anyone who
can write the run directory can also rewrite ``manifest.yaml``, ``status.json`` and
``manifests/``, so a read does not take them at their word: it holds them to the newest
complete checkpoint (``fp8ops_checkpoint.json``), as a resume does. The rule, in full:

1. The checkpoint's revision chain (``revisions``, root first, ending at its ``manifest``) is
   the run's anchored history; each stored copy read must still hash to its name.
2. The revision the run is locked to (``manifest.yaml``, named by ``status.json``) is the
   checkpoint's revision or descends from it through stored revisions: those a resume, its
   applied overrides or an auto-degrade switch wrote since the checkpoint.
3. Such a later revision may keep or tighten the ledger's rules, not loosen them (signatures no
   longer required, self-approval allowed, another allowed-signers file, another auto-degrade
   policy), unless a resume accepted it as drift: its ``resumed`` event in ``events.jsonl``
   lists it among ``new_revisions`` with an ``accepted`` reason. A policy's approval may name
   such a revision, or one of the chain, under the same condition.
4. Every complete checkpoint's ledger anchor (``ledger: {records, head}``) still holds: the
   ledger keeps the records the checkpoint saw, and is not gone
   (:meth:`fp8ops.overrides.Ledger.records`).

A resume reads under the checkpoint it resumes from and the manifest it is about to run (the
checkpoint's revision, or the drift it accepts in the same command): ``run_anchors(run_dir,
resume=plan)``. Every other read (``overrides verify``, ``list``, the console, an append) takes
the newest checkpoint and the locked revision: ``run_anchors(run_dir)``. Before the first
checkpoint nothing anchors the manifest, and the locked revision and its stored parents are
taken as they are (a run without a checkpoint is started over, not resumed: nothing applies
that ledger).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.checkpoint.consistency import read_consistent
from fp8ops.checkpoint.directory import CheckpointDir, checkpoint_step
from fp8ops.checkpoint.meta import LedgerAnchor
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import ManifestStore, manifest_hash
from fp8ops.manifest.schema import Manifest, Review
from fp8ops.run import RunLayout, locked_manifest, read_events

_SHA256 = re.compile(r"[0-9a-f]{64}")


class AnchorError(Fp8opsError):
    """The run's manifest cannot be held to its checkpoint: the ledger's rules are unknown."""


@dataclass
class RunAnchors:
    """The ledger's rules for one read: the revision in force, the revisions a record may cite,
    and the checkpoints' ledger anchors. Made by :func:`run_anchors`."""

    run_dir: Path
    locked: Manifest  # the revision whose review is in force
    checkpoint: Path | None  # the checkpoint it is held to (None: no checkpoint yet)
    ledger: list[tuple[Path, LedgerAnchor]]  # every complete checkpoint's ledger anchor
    anchored: frozenset[str]  # the checkpoint's revision chain (or, without one, the locked one's)
    store: ManifestStore
    # The records the checkpoint's own ledger anchor covers (0: none): the chain fixes them,
    # so only later records can have been written after the rules in force now.
    anchored_records: int = 0
    honoured: dict[str, Manifest] = field(default_factory=dict)  # read so far, rules held
    accepted_now: frozenset[str] = frozenset()  # the drift the resuming command accepts
    _accepted: set[str] | None = None  # revisions a resume accepted as drift (events.jsonl)

    @property
    def review(self) -> Review:
        return self.locked.review

    def revision(self, digest: str) -> Manifest | None:
        """The run's revision ``digest`` if the ledger's rules may come from it (rule 1 or 3 of
        the module docstring); None if the run holds no such revision or it loosened them
        unrecorded."""
        if digest in self.honoured:
            return self.honoured[digest]
        if not _SHA256.fullmatch(digest) or not self.store.path_for(digest).exists():
            return None  # (a record's text names no file outside manifests/)
        if digest in self.anchored:
            self.honoured[digest] = self.store.get(digest)
            return self.honoured[digest]
        try:
            self._descent(self.store.get(digest), self.anchored | self.honoured.keys())
        except AnchorError:
            return None
        return self.honoured[digest]

    def allows_self_approval(self, seq: int) -> bool:
        """Whether the ledger's record number ``seq`` (0-based) may approve what its writer
        staged. A record the checkpoint anchored was written under some revision of the run:
        allowed if one of them (the anchored chain, or a revision after it whose rules are held)
        allowed it. A later record was written under the rules in force now (the locked
        revision), as the command that appends one is held to them: a tightened rule holds."""
        if seq >= self.anchored_records:
            return self.locked.review.allow_self_approval
        revisions = [self.revision(digest) for digest in sorted(self.anchored)]
        revisions += self.honoured.values()
        return any(m is not None and m.review.allow_self_approval for m in revisions)

    def _descent(self, manifest: Manifest, ends: set[str] | frozenset[str]) -> None:
        """Walk ``manifest``'s parents until one in ``ends``: each revision on the way must keep
        its parent's rules or be a resume's accepted drift, and is honoured from then on.
        Raises AnchorError naming the first that fails."""
        digest, passed = manifest_hash(manifest), []
        while digest not in ends:
            parent = manifest.revision.parent
            known = parent in self.honoured or (
                parent is not None and self.store.path_for(parent).exists()
            )
            if not known:
                where = "is a root" if parent is None else f"names parent {parent[:12]}, not stored"
                raise AnchorError(f"revision {digest[:12]} {where}: it does not descend from it")
            above = self.honoured.get(parent) or self.store.get(parent)
            loosened = _loosened(above, manifest)
            if loosened and not self._recorded(digest):
                raise AnchorError(
                    f"revision {digest[:12]} loosens {', '.join(loosened)} relative to its parent "
                    f"{parent[:12]}, and no resume accepted it (no `resumed` event in "
                    f"{RunLayout(self.run_dir).events} lists it with an accepted reason)"
                )
            passed.append((digest, manifest))
            digest, manifest = parent, above
        self.honoured.update(passed)

    def _recorded(self, digest: str) -> bool:
        """A resume accepted revision ``digest`` as drift: this one, or an earlier one whose
        ``resumed`` event says so."""
        if digest in self.accepted_now:
            return True
        if self._accepted is None:
            self._accepted = set()
            for event in read_events(self.run_dir):
                extra = event.model_extra or {}
                if event.event == "resumed" and extra.get("accepted"):
                    self._accepted.update(extra.get("new_revisions") or [])
        return digest in self._accepted


def _loosened(parent: Manifest, child: Manifest) -> list[str]:
    """The fields by which ``child``'s ledger rules are looser than ``parent``'s."""
    before, after, found = parent.review, child.review, []
    if before.require_signatures and not after.require_signatures:
        found.append("review.require_signatures")
    if after.allow_self_approval and not before.allow_self_approval:
        found.append("review.allow_self_approval")
    # Other signers (a file of other bytes, or none) may be other people's keys.
    if before.allowed_signers_sha256 not in (None, after.allowed_signers_sha256):
        found.append("review.allowed_signers")
    policy = child.alerts.auto_degrade
    if policy is not None and policy != parent.alerts.auto_degrade:
        found.append("alerts.auto_degrade")
    return found


def run_anchors(run_dir: Path, resume=None) -> RunAnchors:
    """The rules a read of ``run_dir``'s ledger holds it to (module docstring): held to the
    newest complete checkpoint and the revision the run is locked to; or, for a ``resume`` (a
    ``fp8ops.start.Resume``, read by duck typing: ``overrides`` sits below ``start``), to the
    checkpoint it resumes from and the revision it will run, with the drift it accepts."""
    run_dir = Path(run_dir)
    store = ManifestStore(RunLayout(run_dir).manifests)
    checkpoints = CheckpointDir(run_dir).complete()
    if resume is not None:  # the later ones are superseded by this resume, read or not
        checkpoints = [d for d in checkpoints if checkpoint_step(d.name) <= resume.meta.step]
    # Each checked to agree with itself (its revisions a true chain, its anchor sealed).
    ledger = [
        (d, meta.ledger) for d in checkpoints if (meta := read_consistent(d)).ledger is not None
    ]
    if resume is not None:  # its checkpoint's own files were checked by the resume already
        new = {manifest_hash(m): m for m in resume.new_revisions}
        anchors = RunAnchors(
            run_dir,
            resume.manifest,
            resume.checkpoint,
            ledger,
            frozenset(resume.meta.revisions),
            store,
            anchored_records=resume.meta.ledger.records if resume.meta.ledger else 0,
            honoured={resume.meta.manifest: resume.saved_manifest, **new},
            accepted_now=frozenset(new),
        )
        anchors._descent(resume.manifest, {resume.meta.manifest})
        return anchors
    try:
        locked = locked_manifest(run_dir)
    except Fp8opsError as exc:
        raise AnchorError(str(exc)) from None
    if not checkpoints:  # nothing anchors the manifest yet: its stored chain as it is
        chain, current = {manifest_hash(locked)}, locked
        while (parent := current.revision.parent) is not None and store.path_for(parent).exists():
            current = store.get(parent)
            chain.add(manifest_hash(current))
        anchors = RunAnchors(run_dir, locked, None, ledger, frozenset(chain), store)
        anchors.honoured[manifest_hash(locked)] = locked
        return anchors
    checkpoint = checkpoints[-1]
    meta = read_consistent(checkpoint)
    if not store.path_for(meta.manifest).exists():
        raise AnchorError(
            f"{checkpoint}: saved under manifest {meta.manifest[:12]}, which is not one of this "
            f"run's revisions ({store.directory}): the ledger's review rules cannot be read. "
            "Restore the run's manifests/ from a copy"
        )
    anchors = RunAnchors(
        run_dir,
        locked,
        checkpoint,
        ledger,
        frozenset(meta.revisions),
        store,
        anchored_records=meta.ledger.records if meta.ledger else 0,
    )
    try:
        anchors._descent(locked, {meta.manifest})
    except AnchorError as exc:
        layout = RunLayout(run_dir)
        raise AnchorError(
            f"{layout.manifest}: the run is locked to revision {manifest_hash(locked)[:12]} "
            f"({layout.status}), but checkpoint {checkpoint.name} was saved under "
            f"{meta.manifest[:12]} and {exc}. The ledger's rules are held to the checkpoint's "
            "revision, and a revision written into manifests/ by hand changes none of them: "
            f"restore manifest.yaml and status.json (`fp8ops resume {run_dir}` returns them to "
            "the checkpoint's revision), or change the rules as a resume does: fp8ops resume "
            f'{run_dir} --set FIELD=VALUE --accept-drift "why"'
        ) from None
    return anchors
