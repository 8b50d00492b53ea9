"""Surgery on a saved checkpoint, for the checkpoint tests: its metadata edited, a file's entry in
its hash list rewritten."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from fp8ops.checkpoint.directory import META_FILE


def edit_meta(checkpoint: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite ``fp8ops_checkpoint.json`` with ``edit`` applied to its JSON (the file is not in
    its own hash list, so nothing else notices)."""
    path = checkpoint / META_FILE
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=2) + "\n")


def rehash(checkpoint: Path, name: str) -> None:
    """Record ``name``'s current size and sha256 in the checkpoint's hash list, as if it had
    been saved that way: only checks beyond the hashes can then catch a change to it."""
    data = (checkpoint / name).read_bytes()

    def update(meta: dict) -> None:
        meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    edit_meta(checkpoint, update)
