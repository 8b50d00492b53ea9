"""Export: a whole (TP 1) Megatron-Core GPT as a Hugging Face checkpoint directory.

The inverse of the import's plan (``mapping.shard_plan`` at TP 1): each parameter is cut at
the plan's boundaries, the vocabulary padding dropped, and each Hugging Face tensor joined from
its pieces. The weights are the model's own high-precision parameters (fp8ops keeps FP8 only as
casts inside the GEMMs, never as stored weights). Before anything is written, the key set and
every shape are checked against the model's Hugging Face form and, when the model was imported,
against the source checkpoint. The directory is written beside its destination and renamed
into place: a failed export leaves nothing that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from fp8ops.hf import checkpoint as files
from fp8ops.hf.config import CONFIG, HfCheckpointError, config_for, differences, read_config
from fp8ops.hf.mapping import hf_shapes, parameter_names, shard_plan

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
MAX_SHARD_BYTES = 2 * 1024**3
SUMMARY = "fp8ops_export.json"  # what an export wrote and how it compared, beside it


def hf_tensors(model: nn.Module, model_cfg) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names and shapes (model at TP 1)."""
    plan = shard_plan(model_cfg, model.vocab_size, 1, 0)
    params = dict(model.named_parameters())
    names = parameter_names(plan, set(params))
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for name, shard in plan.items():
        full = params[names[name]].detach()
        offset = 0
        for piece in shard.pieces:
            part = full.narrow(shard.dim, offset, piece.size)
            offset += piece.size
            if piece.key is not None:
                pieces.setdefault(piece.key, []).append((piece.start, piece.dim, part))
        if offset != full.shape[shard.dim]:
            raise AssertionError(f"{name}: the plan covers {offset} of {full.shape[shard.dim]}")
    tensors = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        dim = parts[0][1]
        joined = torch.cat([t for _, _, t in parts], dim=dim) if len(parts) > 1 else parts[0][2]
        tensors[key] = joined.contiguous()
    return tensors


def write_hf(
    model: nn.Module,
    model_cfg,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    source: Path | None = None,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    check: Callable[[Path], dict] | None = None,
) -> dict:
    """Write ``model`` (TP 1) to the new directory ``out`` in Hugging Face form, in ``dtype``
    (default: the model's): sharded safetensors and their index, ``config.json`` (``source``'s, dtype set; else made from the
    model section), ``generation_config.json`` and the tokenizer files (from ``tokenizer_dir``,
    else ``source``), and ``fp8ops_export.json``, the summary it returns. ``check`` runs on the
    written directory before it is renamed into place (its result joins the summary): when it
    raises, nothing is left at ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    source = Path(source) if source is not None else None
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    partial = out.with_name(out.name + ".partial")
    for taken in (out, partial):
        if taken.exists():
            raise HfCheckpointError(
                f"--out {out}: {taken} already exists (a .partial is an export that did not "
                "finish: remove it); fp8ops never writes over files, so choose a new directory"
            )
    # The config first: a model section with no exact Hugging Face form is refused before any
    # tensor is cut.
    dtype = dtype or next(model.parameters()).dtype
    source_config = read_config(source) if source is not None else None
    config = config_for(model_cfg, dtype=DTYPE_NAMES[dtype], source=source_config)
    found = differences(config, model_cfg, source=f"the exported {CONFIG}")
    if found:
        origin = f"{source / CONFIG}" if source is not None else f"the {CONFIG} made for it"
        raise HfCheckpointError(
            f"{origin} does not mean the run's model section ({'; '.join(found)}); the model "
            "has no exact Hugging Face form: export it with --format fp8ops"
        )
    tensors = {key: t.to(dtype) for key, t in hf_tensors(model, model_cfg).items()}
    _check_against(tensors, hf_shapes(model_cfg), what="the model's Hugging Face form")
    if source is not None:
        with ExitStack() as stack:
            where = files.weight_files(source)
            handles = files.open_files(stack, set(where.values()))
            source_shapes = {
                k: tuple(handles[f].get_slice(k).get_shape()) for k, f in where.items()
            }
        _check_against(tensors, source_shapes, what=f"the source checkpoint {source}")

    partial.mkdir(parents=True)
    try:
        shards = _shards(tensors, max_shard_bytes)
        weight_map, total = {}, 0
        for number, keys in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in keys}, str(partial / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(keys, name)
            total += sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / files.INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (partial / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        summary = {
            "tensors": len(tensors),
            "shards": len(shards),
            "bytes": total,
            "dtype": DTYPE_NAMES[dtype],
            "copied": _copy_metadata(partial, source, tokenizer_dir, config),
        }
        summary |= check(partial) if check is not None else {}
        (partial / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


def _check_against(tensors, shapes, *, what: str) -> None:
    missing = sorted(shapes.keys() - tensors.keys())
    extra = sorted(tensors.keys() - shapes.keys())
    if missing or extra:
        raise HfCheckpointError(
            f"the export's tensors differ from {what}: missing {missing[:3]}, extra {extra[:3]}"
        )
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise HfCheckpointError(
                f"the export's {key} has shape {list(tensors[key].shape)} but {what} has "
                f"{list(shape)}"
            )


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards, size = [[]], 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _copy_metadata(out: Path, source: Path | None, tokenizer_dir: Path | None, config) -> list:
    copied = []
    generation = source / files.GENERATION_CONFIG if source is not None else None
    if generation is not None and generation.is_file():
        shutil.copyfile(generation, out / files.GENERATION_CONFIG)
    else:
        ids = {
            k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
        }
        (out / files.GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
    copied.append(files.GENERATION_CONFIG)
    for directory in (tokenizer_dir, source):
        if directory is None:
            continue
        for name in files.TOKENIZER_FILES:
            if (directory / name).is_file() and not (out / name).exists():
                shutil.copyfile(directory / name, out / name)
                copied.append(name)
    return copied
