"""The small base model the end-to-end tests fine-tune from: the small model pre-trained for 4 steps
in bf16, trained once and cached on disk (``build/test-cache/base-<key>/run``).

The key hashes what the run depends on: the base manifest's canonical hash
(:func:`fp8ops.manifest.manifest_hash`), every file of the ``fp8ops`` package imported (so any
change to its code rebuilds it), and the torch, megatron-core and Python versions (the corpus is
Python's own docstrings). The build holds an exclusive lock on
``base-<key>.lock``, so two pytest-xdist workers build it once between them; it trains into a
temporary directory beside the cache and renames it into place, so a killed build never leaves a
cache behind. ``CONTENTS.json`` lists every file's sha256: a cache whose files differ from it is
rebuilt, and :func:`changed_files` tells a session that a test wrote into it (the ``small_base``
fixture fails then). Tests use the run read-only, or a copy of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from fp8ops.manifest import Manifest, derive, load_manifest, manifest_hash, write_manifest
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "test-cache"  # /build/ is in .gitignore
CONTENTS = "CONTENTS.json"
KEEP = 4  # cached bases of other keys kept (the newest), for switching between branches

# The small model pre-trained for 4 steps, evaluated at the end.
BASE_CHANGES = {**SMALL_MODEL, **SCHEDULE, "schedule.train_steps": 4, "schedule.eval_interval": 4}


def base_manifest() -> Manifest:
    return derive(load_manifest(MANIFESTS / "tiny-gpt-cpu-base.yaml"), BASE_CHANGES, "test: small")


def package_hash() -> str:
    """sha256 over the ``fp8ops`` package's files (the copy imported here), by relative path."""
    import fp8ops

    root = Path(fp8ops.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
            continue
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(manifest: Manifest) -> str:
    import torch

    parts = (
        manifest_hash(manifest),
        package_hash(),
        torch.__version__,
        _version("megatron-core"),
        sys.version,
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _contents(run: Path) -> dict[str, str]:
    return {
        str(path.relative_to(run)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(run.rglob("*"))
        if path.is_file()
    }


def changed_files(cached: Path) -> list[str]:
    """The files of the cached base directory ``cached`` added, removed or changed since it was
    built (all of them if it has no ``CONTENTS.json``)."""
    try:
        recorded = json.loads((cached / CONTENTS).read_text())
    except (OSError, ValueError):
        return ["(no readable CONTENTS.json)"]
    now = _contents(cached / "run") if (cached / "run").is_dir() else {}
    return sorted(
        name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name)
    )


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_base(cache: Path = CACHE) -> Path:
    """The cached base directory (``run/``: the base run, ``base.yaml``: its manifest), trained
    first if there is none for this key or it was changed."""
    manifest = base_manifest()
    key = cache_key(manifest)
    cached = cache / f"base-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"base-{key}.lock"):
        if cached.is_dir() and not changed_files(cached):
            return cached
        for stale in [cached, *cache.glob(f".building-{key}-*")]:  # changed, or a killed build
            shutil.rmtree(stale, ignore_errors=True)
        building = Path(tempfile.mkdtemp(prefix=f".building-{key}-", dir=cache))
        building.chmod(0o755)
        try:
            _train(manifest, building)
            os.rename(building, cached)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    _prune(cache, keep=cached)
    return cached


def _train(manifest: Manifest, out: Path) -> None:
    from fp8ops.train import run_training

    run_training(write_manifest(manifest, out / "base.yaml"), out / "run", progress=False)
    (out / CONTENTS).write_text(json.dumps(_contents(out / "run"), indent=1) + "\n")


def _prune(cache: Path, keep: Path) -> None:
    """Remove the cached bases of other keys but the newest ``KEEP`` (one being built, its lock
    held, is left alone)."""
    others = sorted(
        (p for p in cache.glob("base-*") if p.is_dir() and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in others[KEEP:]:
        with open(cache / f"{old.name}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)
        (cache / f"{old.name}.lock").unlink(missing_ok=True)
