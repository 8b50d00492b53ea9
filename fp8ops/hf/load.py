"""Import: a Hugging Face checkpoint into this rank's Megatron-Core GPT, streamed.

Every check runs before a weight is copied: ``config.json`` means the manifest's model section
(key by key), the checkpoint holds exactly the tensors that model has (none missing, none
extra) in exactly their shapes, and the plan's pieces cover every source tensor once. Then each
parameter is read as the rows its rank keeps (``mapping.shard_plan``) and copied in, one
parameter at a time: peak host memory is the rank's model plus one parameter's slices.
"""

from __future__ import annotations

import itertools
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fp8ops.hf import checkpoint as files
from fp8ops.hf.config import CONFIG, HfCheckpointError, check_window, differences, read_config
from fp8ops.hf.mapping import hf_shapes, parameter_names, shard_plan


def check_config(directory: Path, model_cfg, *, field: str) -> dict:
    """``directory``'s config.json, checked to mean ``model_cfg`` (the manifest's model
    section, ``field`` naming where it points at the checkpoint); returns the config."""
    source = Path(directory) / CONFIG
    config = read_config(directory)
    found = differences(config, model_cfg, source=str(source))
    check_window(config, model_cfg.seq_length, source=str(source))
    if found:
        raise HfCheckpointError(
            f"{field} {str(directory)!r}: the manifest's model section is not this checkpoint's "
            f"model ({'; '.join(found)}); write the section with `fp8ops manifest from-hf "
            f"{directory}` or correct it"
        )
    return config


def check_tensors(directory: Path, model_cfg) -> dict[str, Path]:
    """Each expected tensor's file, after checking the checkpoint holds exactly the expected
    tensors, each in its expected shape."""
    where = files.weight_files(directory)
    expected = hf_shapes(model_cfg)
    missing = sorted(expected.keys() - where.keys())
    extra = sorted(where.keys() - expected.keys())
    if missing:
        raise HfCheckpointError(
            f"{directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
            "the checkpoint does not hold this model"
        )
    if extra:
        raise HfCheckpointError(
            f"{where[extra[0]]}: holds {extra[0]!r}, which this model has no place for "
            f"({len(extra)} such tensors); fp8ops refuses to drop weights"
        )
    with ExitStack() as stack:
        handles = files.open_files(stack, set(where.values()))
        for name, shape in expected.items():
            found = tuple(handles[where[name]].get_slice(name).get_shape())
            if found != shape:
                raise HfCheckpointError(
                    f"{where[name]}: {name!r} has shape {list(found)}, but the model in "
                    f"{CONFIG} needs {list(shape)}"
                )
    return where


def check_coverage(model_cfg, padded_vocab: int, tp: int) -> None:
    """Across all ranks' plans, each Hugging Face tensor goes to one parameter, and its pieces
    cover every row (or column) exactly once per copy: split tensors once in all, whole ones
    once per rank."""
    shapes = hf_shapes(model_cfg)
    target: dict[str, str] = {}
    covered: dict[str, list[tuple[int, int, int]]] = {key: [] for key in shapes}
    for rank in range(tp):
        for name, shard in shard_plan(model_cfg, padded_vocab, tp, rank).items():
            for piece in shard.pieces:
                if piece.key is None:
                    continue
                if target.setdefault(piece.key, name) != name:
                    raise AssertionError(f"{piece.key} feeds {target[piece.key]} and {name}")
                covered[piece.key].append((rank, piece.start, piece.stop, piece.dim))
    for key, shape in shapes.items():
        pieces = covered[key]
        if not pieces:
            raise AssertionError(f"{key} feeds no parameter")
        dim = pieces[0][3]
        whole = all(start == 0 and stop == shape[dim] for _, start, stop, _ in pieces)
        if whole and len(pieces) == tp:
            continue
        spans = sorted((start, stop) for _, start, stop, _ in pieces)
        if (
            spans[0][0] != 0
            or spans[-1][1] != shape[dim]
            or any(a[1] != b[0] for a, b in itertools.pairwise(spans))
        ):
            raise AssertionError(f"{key}: pieces {spans} do not tile {shape[dim]} once")


def load_hf_weights(model: nn.Module, directory: Path, model_cfg, *, tp_group, field: str) -> dict:
    """Read a Hugging Face checkpoint into ``model`` (this rank's shard; collective for the
    fingerprint) and return what the base's record holds: its fingerprint and dtype."""
    from fp8ops.megatron.layers import global_layer_name  # Megatron: only once a model exists

    directory = Path(directory)
    config = check_config(directory, model_cfg, field=field)
    where = check_tensors(directory, model_cfg)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    check_coverage(model_cfg, model.vocab_size, tp)
    params = {global_layer_name(model, n): p for n, p in model.named_parameters()}
    plan = _this_stage(shard_plan(model_cfg, model.vocab_size, tp, rank), model, params)
    names = parameter_names(plan, set(params))
    unfilled = sorted(set(params) - set(names.values()))
    absent = sorted(set(names.values()) - set(params))
    if unfilled or absent:
        raise HfCheckpointError(
            f"{field}: the model built from the manifest does not match the Hugging Face "
            f"mapping (parameters left unfilled: {unfilled[:3]}; mapped but absent: {absent[:3]});"
            " model.normalization must be RMSNorm and model.activation swiglu"
        )
    with torch.no_grad():
        for name, shard in plan.items():
            param = params[names[name]]
            param.copy_(_read_shard(shard, where, param))
    found = [files.fingerprint(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return {
        "format": "hf",
        "fingerprint": found[0],
        "fingerprint_scheme": files.FINGERPRINT_SCHEME,
        "dtype": str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        "verified": True,
    }


def _this_stage(plan: dict, model: nn.Module, params: dict) -> dict:
    """The plan's parameters of this pipeline stage (all of them without pipelining): the
    embedding on the first stage, the final norm and LM head on the last (with tied
    embeddings, a copy of the embedding), and the stage's layers, named by their global
    number."""
    layers = {name.split(".")[2] for name in params if name.startswith("decoder.layers.")}

    def here(name: str) -> bool:
        if name.startswith("decoder.layers."):
            return name.split(".")[2] in layers
        if name.startswith("embedding."):
            return model.pre_process
        return model.post_process  # decoder.final_layernorm, output_layer

    mine = {name: shard for name, shard in plan.items() if here(name)}
    if "output_layer.weight" in params and "output_layer.weight" not in plan:
        # The last stage's copy of a tied embedding (Megatron's): read as the embedding is.
        mine["output_layer.weight"] = plan["embedding.word_embeddings.weight"]
    return mine


def _read_shard(shard, where: dict[str, Path], param) -> torch.Tensor:
    """One parameter's shard from its pieces. The files are opened for this parameter alone:
    safetensors maps them into memory, and the pages read count in the process's memory until
    the file closes, so holding them open would grow to the whole checkpoint."""
    with ExitStack() as stack:
        handles = files.open_files(stack, {where[p.key] for p in shard.pieces if p.key})
        parts = []
        for piece in shard.pieces:
            if piece.key is None:
                parts.append(torch.zeros(piece.size, *param.shape[1:], dtype=param.dtype))
                continue
            lazy = handles[where[piece.key]].get_slice(piece.key)
            rows = slice(piece.start, piece.stop)
            parts.append((lazy[rows] if piece.dim == 0 else lazy[:, rows]).to(param.dtype))
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if tuple(value.shape) != tuple(param.shape):
        raise AssertionError(f"built {tuple(value.shape)} for a parameter of {tuple(param.shape)}")
    return value
