"""A Hugging Face checkpoint directory on disk: its files, their fingerprint, lazy reads.

A directory is a Hugging Face checkpoint when it holds ``config.json`` and either
``model.safetensors`` or ``model.safetensors.index.json`` naming its shards. Tensors are read
through safetensors' lazy slices, so a rank reads only the rows it keeps.
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from pathlib import Path

from fp8ops.files import loads_json
from fp8ops.hf.config import CONFIG, HfCheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Metadata a Hugging Face export carries beside the weights, copied from the source.
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
FINGERPRINT_SCHEME = "hf-files"  # sha256 over config.json and the safetensors files, by name


def is_hf_checkpoint(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / CONFIG).is_file() and (
        (directory / SINGLE).is_file() or (directory / INDEX).is_file()
    )


def weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor's file, by tensor name, from the index (or the one file)."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        try:
            index = loads_json((directory / INDEX).read_text())
            weight_map = index["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise HfCheckpointError(
                f"{directory / INDEX}: not a safetensors index ({type(exc).__name__}: {exc}); "
                "it must hold a 'weight_map' of tensor name to file"
            ) from None
        files = {name: directory / file for name, file in weight_map.items()}
    elif (directory / SINGLE).is_file():
        files = None
    else:
        raise HfCheckpointError(
            f"{directory}: no {SINGLE} and no {INDEX}; fp8ops reads Hugging Face weights from "
            "safetensors files"
        )
    with ExitStack() as stack:
        handles = open_files(stack, {directory / SINGLE} if files is None else set(files.values()))
        if files is None:
            return dict.fromkeys(handles[directory / SINGLE].keys(), directory / SINGLE)
        held = {path: set(handle.keys()) for path, handle in handles.items()}
    for name, path in files.items():
        if name not in held[path]:
            raise HfCheckpointError(
                f"{directory / INDEX}: names {name!r} in {path.name}, which does not hold it"
            )
    for path, names in held.items():
        unnamed = sorted(n for n in names if files.get(n) != path)
        if unnamed:
            raise HfCheckpointError(
                f"{path}: holds {unnamed[0]!r}, which {INDEX} does not name there "
                f"({len(unnamed)} such tensors); the index and its shards disagree"
            )
    return files


def open_files(stack: ExitStack, paths) -> dict[Path, object]:
    """``safe_open`` each file (kept open by ``stack``), with errors that name it."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise HfCheckpointError(
            "reading Hugging Face checkpoints needs the safetensors library: "
            "pip install 'fp8ops[hf]'"
        ) from None

    handles = {}
    for path in sorted(paths):
        if not path.is_file():
            raise HfCheckpointError(f"{path}: missing (named by the checkpoint's index)")
        try:
            handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
        except (SafetensorError, OSError) as exc:
            raise HfCheckpointError(
                f"{path}: not a whole safetensors file ({exc}); it is truncated or damaged: "
                "copy it again"
            ) from None
    return handles


def fingerprint(directory: Path) -> str:
    """sha256 over ``config.json``, the index (if any) and the safetensors files the import
    reads (the index's, or ``model.safetensors``), each under its name: a changed file cannot
    pass unnoticed."""
    directory = Path(directory)
    digest = hashlib.sha256()
    if (directory / INDEX).is_file():
        weights = sorted({p.name for p in weight_files(directory).values()})
    else:
        weights = [SINGLE]
    for name in [CONFIG, INDEX, *weights]:
        path = directory / name
        if not path.is_file():
            continue
        digest.update(f"{name}\0".encode())
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()
