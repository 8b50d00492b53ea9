"""Revisions: a manifest never changes; a change is a new manifest that names its parent.

``derive`` makes the child (number + 1, parent = the parent's hash, a reason).
``ManifestStore`` keeps revisions content-addressed as ``<sha256>.yaml`` and checks that a
chain of them is intact: every file still hashes to its name, every parent is present and
every number is its parent's plus one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from fp8ops.errors import ManifestError, RevisionError
from fp8ops.files import atomic_write_text
from fp8ops.manifest.canonical import content_dict, manifest_hash, to_yaml
from fp8ops.manifest.load import load_manifest
from fp8ops.manifest.messages import dotted, validate_manifest
from fp8ops.manifest.schema import Manifest
from fp8ops.manifest.yaml_io import load_yaml_value

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATH_PART = re.compile(r"([^.\[\]]+)((?:\[[0-9]+\])*)")


# --------------------------------------------------------------------------------------
# Deriving a revision
# --------------------------------------------------------------------------------------


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """``["precision.margin=1", ...]`` -> ``{"precision.margin": 1, ...}``.

    Values are YAML, so ``1`` is an integer, ``1e-5`` a float, ``null`` None and
    ``'["*.linear_qkv"]'`` a list; quote a value to keep it a string (``name='"123"'``).
    """
    changes: dict[str, Any] = {}
    for item in items:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise ManifestError(f"--set {item!r}: expected PATH=VALUE, e.g. precision.margin=1")
        try:
            changes[path.strip()] = load_yaml_value(text)
        except yaml.YAMLError as exc:
            raise ManifestError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    return changes


def derive(
    parent: Manifest, changes: dict[str, Any], reason: str, *, source: str | None = None
) -> Manifest:
    """The next revision of ``parent`` with ``changes`` (dotted paths) applied.

    ``source`` names the result in error messages (default: "revision N of NAME").
    """
    number = parent.revision.number + 1
    source = source or f"revision {number} of {parent.name}"
    if not changes:
        raise ManifestError(f"{source}: no changes given")
    data = content_dict(parent)
    for path, value in changes.items():
        _assign(data, path, value, source)
    data["revision"] = {"number": number, "parent": manifest_hash(parent), "reason": reason}
    child = validate_manifest(data, source)
    if {**content_dict(child), "revision": None} == {**content_dict(parent), "revision": None}:
        raise ManifestError(
            f"{source}: the changes leave the manifest as it was; nothing to derive"
        )
    return child


def _assign(data: dict[str, Any], path: str, value: Any, source: str) -> None:
    """Set ``data["a"]["b"][i] = value`` for ``path`` "a.b[i]".

    A key the schema doesn't know is set all the same: validation then names it and lists
    the keys allowed there.
    """
    steps = _path_steps(path, source)
    if steps[0] == "revision":
        raise ManifestError(f"{source}: {path}: set by derive from the parent and the reason")
    if steps[0] == "schema_version":
        raise ManifestError(f"{source}: {path}: a revision keeps its parent's schema version")
    node: Any = data
    for depth, step in enumerate(steps):
        container = dotted(tuple(steps[:depth]))
        if isinstance(step, str) and not isinstance(node, dict):
            raise ManifestError(f"{source}: {path}: {container} is a value, not a section")
        if isinstance(step, int) and (not isinstance(node, list) or step >= len(node)):
            raise ManifestError(f"{source}: {path}: {container} has no item [{step}]")
        if depth == len(steps) - 1:
            node[step] = value
        elif isinstance(step, str):
            node = node.setdefault(step, {})
        else:
            node = node[step]


def _path_steps(path: str, source: str) -> list[str | int]:
    """ "a.b[2]" -> ["a", "b", 2]."""
    steps: list[str | int] = []
    for part in path.split("."):
        match = _PATH_PART.fullmatch(part)
        if not match:
            raise ManifestError(f"{source}: {path}: not a field path like precision.margin")
        steps.append(match.group(1))
        steps.extend(int(index) for index in re.findall(r"[0-9]+", match.group(2)))
    return steps


# --------------------------------------------------------------------------------------
# Writing files
# --------------------------------------------------------------------------------------


def write_manifest(m: Manifest, path: str | Path) -> Path:
    """Write ``m`` as canonical YAML to ``path``, atomically.

    An existing file with the same content (by hash) is left alone; one with any other
    content is never overwritten.
    """
    path = Path(path)
    digest = manifest_hash(m)
    if path.is_dir():
        raise ManifestError(f"{path}: is a directory; give the manifest file's path")
    if path.exists():
        try:
            existing = manifest_hash(load_manifest(path))
        except ManifestError:
            existing = None
        if existing == digest:
            return path
        raise ManifestError(
            f"{path}: already exists with different content; refusing to overwrite it"
        )
    atomic_write_text(path, to_yaml(m))
    return path


# --------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------


class ManifestStore:
    """A directory of revisions, each stored as ``<sha256 of its canonical form>.yaml``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path_for(self, digest: str) -> Path:
        return self.directory / f"{digest}.yaml"

    def put(self, m: Manifest) -> Path:
        """Store ``m``; storing it again is a no-op. Returns its path."""
        digest = manifest_hash(m)
        path = self.path_for(digest)
        if path.exists():
            try:
                self._check_named_right(path, self._load(path))
            except RevisionError as exc:
                raise RevisionError(f"{exc}; refusing to overwrite it") from None
            return path
        atomic_write_text(path, to_yaml(m))
        return path

    def get(self, digest: str) -> Manifest:
        """The manifest stored under ``digest`` (a full hash or a unique prefix)."""
        path = self.path_for(self.resolve(digest))
        m = self._load(path)
        self._check_named_right(path, m)
        return m

    def hashes(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.yaml") if _SHA256.fullmatch(p.stem))

    def resolve(self, prefix: str) -> str:
        """The full hash a unique prefix (at least 4 hex digits) stands for."""
        if not re.fullmatch(r"[0-9a-f]{4,64}", prefix):
            raise RevisionError(f"{prefix!r}: not a manifest hash (4 to 64 lowercase hex digits)")
        matches = [h for h in self.hashes() if h.startswith(prefix)]
        if not matches:
            raise RevisionError(f"{self.directory}: no manifest {prefix}")
        if len(matches) > 1:
            raise RevisionError(f"{self.directory}: {prefix} is ambiguous: {', '.join(matches)}")
        return matches[0]

    def heads(self) -> list[str]:
        """Hashes no stored manifest names as its parent: the tips of the chains."""
        hashes = self.hashes()
        parents = {self._load(self.path_for(h)).revision.parent for h in hashes}
        return [h for h in hashes if h not in parents]

    def chain(self, digest: str) -> list[Manifest]:
        """The revisions from the root to ``digest``, root first, each link checked."""
        chain = [self.get(digest)]
        while chain[-1].revision.parent is not None:
            child = chain[-1]
            child_path = self.path_for(manifest_hash(child))
            if not self.path_for(child.revision.parent).exists():
                raise RevisionError(
                    f"{child_path}: parent {child.revision.parent} is not in the store "
                    f"{self.directory}"
                )
            parent = self.get(child.revision.parent)
            self._check_number(child_path, child, parent)
            chain.append(parent)
        return chain[::-1]

    def verify(self) -> int:
        """Check every stored file; raise ``RevisionError`` listing every problem.

        Returns the number of manifests checked.
        """
        problems = []
        loaded: dict[str, Manifest] = {}
        for path in sorted(self.directory.glob("*.yaml")):
            if not _SHA256.fullmatch(path.stem):
                problems.append(f"{path}: not a store file (names are <sha256>.yaml)")
                continue
            try:
                m = self._load(path)
                self._check_named_right(path, m)
                loaded[path.stem] = m
            except RevisionError as exc:
                problems.append(str(exc))
        for digest, m in loaded.items():
            parent = m.revision.parent
            if parent is None:
                continue
            if not self.path_for(parent).exists():
                problems.append(f"{self.path_for(digest)}: parent {parent} is not in the store")
            elif parent in loaded:
                try:
                    self._check_number(self.path_for(digest), m, loaded[parent])
                except RevisionError as exc:
                    problems.append(str(exc))
        if problems:
            if len(problems) == 1:
                raise RevisionError(problems[0])
            lines = [f"{self.directory}: {len(problems)} problems", *(f"  {p}" for p in problems)]
            raise RevisionError("\n".join(lines))
        return len(loaded)

    @staticmethod
    def _load(path: Path) -> Manifest:
        try:
            return load_manifest(path)
        except RevisionError:
            raise
        except ManifestError as exc:  # the message already names the file
            raise RevisionError(str(exc)) from None

    @staticmethod
    def _check_named_right(path: Path, m: Manifest) -> None:
        actual = manifest_hash(m)
        if actual != path.stem:
            raise RevisionError(
                f"{path}: content hashes to {actual}, not to its name: "
                "the file was changed after it was stored"
            )

    @staticmethod
    def _check_number(path: Path, child: Manifest, parent: Manifest) -> None:
        if child.revision.number != parent.revision.number + 1:
            raise RevisionError(
                f"{path}: revision number {child.revision.number} does not follow its parent's "
                f"({parent.revision.number}); expected {parent.revision.number + 1}"
            )
