"""Model weights on disk: the base checkpoint a fine-tuning run starts from.

A weights checkpoint is a Megatron ``dist_checkpointing`` directory (so a TP=1 base loads into a
TP=2 run: Megatron reshards on load) plus ``fp8ops_weights.json``: the model section it was
trained with and a fingerprint of the weights. The FP8 state (``_extra_state``) is left out: a
base is a starting point, and a fine-tuning run starts its scaling state fresh from its own
recipe. Full training checkpoints, with the FP8 state and optimizer, are a different thing.

The fingerprint is a sha256 over every parameter's full (unsharded) tensor, each under the name
Megatron checkpoints it by (:func:`weights_fingerprint`), so it is the same at any
tensor-parallel size and in a model of Megatron's local or TE spec. Loading recomputes it: a base
that loaded wrong, or a file that changed, cannot pass unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fp8ops.checkpoint.sharded_io import load_sharded, save_sharded
from fp8ops.errors import ManifestError
from fp8ops.files import loads_json
from fp8ops.manifest.canonical import section_dict
from fp8ops.run.layout import WEIGHTS_META

META_FILE = WEIGHTS_META  # the file's name (fp8ops.run.layout spells it)
# The fields of the model section that do not change the weights' shapes or meaning.
_NOT_ARCHITECTURE = {"init_checkpoint", "fingerprint"}


def architecture(model_cfg) -> dict:
    """The model section's fields that a checkpoint's weights depend on (fields added to the
    schema later left out at their defaults, as the manifest hash leaves them, so a base saved
    before they existed still matches)."""
    return {k: v for k, v in section_dict(model_cfg).items() if k not in _NOT_ARCHITECTURE}


def architecture_fingerprint(model_cfg) -> str:
    """sha256 of :func:`architecture` in canonical JSON: the model config's fingerprint."""
    text = json.dumps(architecture(model_cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# How a fingerprint names and orders the parameters it hashes (recorded beside every fingerprint):
# "checkpoint-keys", the one written now, names each by the key Megatron checkpoints it under;
# "parameter-names", what files written before it hold, by its module path, in module order.
CHECKPOINT_KEYS, PARAMETER_NAMES = "checkpoint-keys", "parameter-names"
FINGERPRINT_SCHEMES = (CHECKPOINT_KEYS, PARAMETER_NAMES)
FINGERPRINT_SCHEME = CHECKPOINT_KEYS  # what fingerprints are written with


def weights_fingerprint(
    model: nn.Module,
    tp_group,
    dtype: torch.dtype | None = None,
    *,
    scheme: str = CHECKPOINT_KEYS,
) -> str:
    """sha256 of the full weights, identical on every rank and at every TP size.

    Each parameter is hashed under its checkpoint name (``scheme`` "checkpoint-keys",
    :func:`checkpoint_names`), in the order of those names as strings (``[10]`` before ``[2]``:
    the names and their order are part of what is hashed). Megatron's local and TE specs
    checkpoint under the same keys (the local ``input_layernorm.weight`` is TE's
    ``linear_qkv.layer_norm_weight``), so a base hashes alike in a model of either spec; module
    paths, and the order modules register in, differ between them. A SwiGLU ``linear_fc1``
    holds ``[gate; up]`` shards per rank; it is hashed as the checkpoint holds it, all gates
    then all ups, the same at every TP size. "parameter-names" is the scheme of files written
    before: module paths, in module order, shards joined rank by rank.

    ``dtype`` hashes the values converted to that dtype (a bf16 base loaded into an fp32 model
    still hashes as the bf16 it was saved as). Each tensor-parallel shard is gathered one
    parameter at a time (peak memory: one full parameter), which is collective: every rank of
    the TP group must call this.

    Under pipeline parallelism each stage holds some of the parameters: the first stage hashes
    them all in the same order, each received from the stage that holds it, and tells the
    others the digest, so a checkpoint hashes alike at every pipeline size too.
    """
    gated = set()
    if scheme == CHECKPOINT_KEYS:
        names = checkpoint_names(model)
        named = sorted(((names[p.data_ptr()], p) for p in model.parameters()), key=lambda x: x[0])
        if model.config.gated_linear_unit:
            gated = {name for name, _ in named if _GATED.search(name)}
    elif scheme == PARAMETER_NAMES:
        named = list(model.named_parameters())
    else:
        raise ValueError(f"fingerprint scheme {scheme!r}: use one of {FINGERPRINT_SCHEMES}")

    def full(name: str, param: torch.Tensor) -> torch.Tensor:
        whole = _gather_full(param, tp_group, parts=2 if name in gated else 1)
        return whole if dtype is None else whole.to(dtype)

    from fp8ops.megatron.stages import pipeline_group

    stages = pipeline_group()
    if stages is not None:
        if scheme != CHECKPOINT_KEYS:  # module paths are a stage's own, not the model's
            raise ManifestError(
                f"weights fingerprinted by module path (scheme {scheme!r}, written by an older "
                "fp8ops) cannot be checked under pipeline parallelism, where module paths are "
                "a stage's own: load them at topology.pipeline_parallel 1, or save them again"
            )
        return _pipelined_fingerprint(named, full, tp_group, stages, dtype)
    digest = hashlib.sha256()
    for name, param in named:
        _hash_tensor(digest, name, full(name, param))
    return digest.hexdigest()


def _hash_tensor(digest, name: str, tensor: torch.Tensor) -> None:
    digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes())


def _pipelined_fingerprint(named, full, tp_group, stages, dtype) -> str:
    """:func:`weights_fingerprint` over the stages of ``stages`` (collective over the world):
    each parameter, in the global order of names, is hashed by the first stage, which receives
    it from the stage holding it (one full parameter in flight at a time)."""
    tp = dist.get_world_size(tp_group)
    shapes = {}
    for name, param in named:
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            shape[param.partition_dim] *= tp
        shapes[name] = (tuple(shape), dtype or param.dtype)
    everyone: list = [None] * dist.get_world_size(stages)
    dist.all_gather_object(everyone, shapes, group=stages)
    # A tied embedding is on the first stage and, as a copy, on the last: hashed as the first's.
    owner = {}
    for stage, held in enumerate(everyone):
        for name in held:
            owner.setdefault(name, stage)
    mine, first = dist.get_rank(stages), dist.get_global_rank(stages, 0)
    params = dict(named)
    device = next(iter(params.values())).device
    digest = hashlib.sha256()
    for name in sorted(owner):
        shape, held_dtype = everyone[owner[name]][name]
        if owner[name] == mine:
            tensor = full(name, params[name])
            if mine != 0:
                # As bytes: every dtype travels, over gloo as over NCCL.
                dist.send(tensor.contiguous().view(-1).view(torch.uint8), dst=first, group=stages)
                continue
        elif mine == 0:
            size = math.prod(shape) * torch.empty((), dtype=held_dtype).element_size()
            raw = torch.empty(size, dtype=torch.uint8, device=device)
            dist.recv(raw, src=dist.get_global_rank(stages, owner[name]), group=stages)
            tensor = raw.view(held_dtype).view(shape)
        else:
            continue
        _hash_tensor(digest, name, tensor)
    found = [digest.hexdigest() if mine == 0 else None]
    dist.broadcast_object_list(found, src=first, group=stages)
    return found[0]


_LAYER = re.compile(r"\.layers\.(\d+)\.")  # a module path's layer number
_GATED = re.compile(r"\.linear_fc1\.(weight|bias)\[")  # SwiGLU's [gate; up] on each rank


def checkpoint_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's checkpoint name, by its storage: the key of its entry in Megatron's
    sharded state dict (layers share one key, stacked on a layer axis), with its layer number:
    ``decoder.layers.mlp.linear_fc1.weight[3]``. The layer comes from the entry's module path,
    the same in either spec, made global under pipeline parallelism (a stage's local layer 0
    is the model's layer at the stage's offset)."""
    names = {}
    from fp8ops.megatron.layers import global_layer_name

    for path, sharded in _weights_only(model.sharded_state_dict()).items():
        if not isinstance(getattr(sharded, "data", None), torch.Tensor):
            continue  # an object, not a tensor: no parameter of its own
        layer = _LAYER.search(global_layer_name(model, path))
        # A layer number in the key itself (Megatron's heterogeneous layers) moves to the end.
        key = _LAYER.sub(".layers.", sharded.key)
        names[sharded.data.data_ptr()] = key + (f"[{layer.group(1)}]" if layer else "")
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.data_ptr() not in names]
    if missing:
        raise KeyError(
            f"parameters without an entry in the model's sharded state dict, so without a "
            f"checkpoint name: {missing[:4]}"
        )
    taken = [names[p.data_ptr()] for p in params.values()]
    if len(set(taken)) != len(taken):  # the order of the hash would then be the model's
        twice = sorted({n for n in taken if taken.count(n) > 1})
        raise KeyError(f"parameters share a checkpoint name: {twice[:4]}")
    return names


def save_weights(model: nn.Module, directory: Path, meta: dict, *, is_main: bool) -> None:
    """Write the model's weights to ``directory`` atomically (collective); ``meta`` goes into
    its metadata file, with the weights' dtype added.

    The checkpoint is written to a temporary sibling and renamed into place when complete, so
    ``directory`` is either absent or a whole checkpoint, never a half-written one.
    """
    directory = Path(directory)
    meta = {
        **meta,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "padded_vocab_size": model.vocab_size,
    }
    partial = directory.with_name(directory.name + ".partial")
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash: never a checkpoint
        partial.mkdir(parents=True)
    dist.barrier()
    save_sharded(_weights_only(model.sharded_state_dict()), partial)
    dist.barrier()
    if is_main:
        (partial / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if directory.exists():  # a resumed run finishing again: the old weights step aside
            old = directory.with_name(directory.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(partial, directory)
            shutil.rmtree(old)
        else:
            os.replace(partial, directory)
    dist.barrier()


def load_base(model: nn.Module, directory: Path, model_cfg, *, tp_group, field: str) -> dict:
    """Load a base into ``model`` and verify it: an fp8ops weights checkpoint
    (:func:`load_weights`) or a Hugging Face checkpoint directory (``fp8ops.hf``); returns its
    metadata (``fingerprint``, ``fingerprint_scheme``, ``dtype``, ``verified``)."""
    if is_hf_base(directory):
        from fp8ops.hf.load import load_hf_weights

        return load_hf_weights(model, Path(directory), model_cfg, tp_group=tp_group, field=field)
    return load_weights(model, directory, model_cfg, tp_group=tp_group, field=field)


def is_hf_base(directory: Path) -> bool:
    """A Hugging Face checkpoint directory, not an fp8ops weights checkpoint."""
    from fp8ops.hf.checkpoint import is_hf_checkpoint

    return not (Path(directory) / META_FILE).exists() and is_hf_checkpoint(directory)


def read_base_meta(
    directory: Path, model_cfg=None, *, field: str, fingerprint: bool = True
) -> dict:
    """What :func:`load_base` would load, checked without loading it: a weights checkpoint's
    metadata, or for a Hugging Face directory its config checked against ``model_cfg`` (when
    given), its tensors against the model, and (``fingerprint``) the hash of its files."""
    if not is_hf_base(directory):
        return read_weights_meta(directory, field=field)
    from fp8ops.hf import checkpoint as hf_files
    from fp8ops.hf.load import check_config, check_tensors

    if model_cfg is not None:
        check_config(directory, model_cfg, field=field)
        check_tensors(directory, model_cfg)
    return {
        "format": "hf",
        "fingerprint": hf_files.fingerprint(directory) if fingerprint else None,
        "fingerprint_scheme": hf_files.FINGERPRINT_SCHEME,
    }


def load_weights(model: nn.Module, directory: Path, model_cfg, *, tp_group, field: str) -> dict:
    """Load a weights checkpoint into ``model`` and verify it; returns its metadata.

    ``field`` names the manifest field that pointed here, for the errors: a missing directory,
    a directory that is not an fp8ops weights checkpoint, an architecture other than the
    manifest's, or weights whose fingerprint no longer matches.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    meta_path = directory / META_FILE
    meta = read_weights_meta(directory, field=field)
    if meta["architecture"] != architecture(model_cfg):
        wanted = architecture(model_cfg)
        differences = [
            f"{key}: checkpoint {meta['architecture'].get(key, 'its default')!r}, manifest "
            f"{wanted.get(key, 'its default')!r}"
            for key in sorted(wanted.keys() | meta["architecture"].keys())
            if meta["architecture"].get(key) != wanted.get(key)
        ]
        raise ManifestError(
            f"{field} {str(directory)!r} holds a different model than the manifest's model "
            f"section ({'; '.join(differences)}); point {field} at a checkpoint of this model"
        )
    if meta.get("padded_vocab_size", model.vocab_size) != model.vocab_size:
        raise ManifestError(
            f"{field} {str(directory)!r} has an embedding of {meta['padded_vocab_size']} rows but "
            f"this run pads the vocabulary to {model.vocab_size} (model.vocab_size at this "
            "topology.tensor_parallel); train at a tensor-parallel size that pads alike"
        )
    try:
        missing, unexpected = read_weights_into(model, directory)
    except (
        CheckpointException,
        OSError,
        EOFError,
        pickle.UnpicklingError,
        ValueError,
        KeyError,
    ) as exc:
        # (CheckpointException, torch's collective read error, is a BaseException that holds
        # each failed rank's exception and traceback.)
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()), exc)
        cause = cause[0] if isinstance(cause, tuple) else cause
        detail = (str(cause).strip().splitlines() or [""])[0][:300]
        raise ManifestError(
            f"{field} {str(directory)!r}: its weights cannot be read ({type(cause).__name__}"
            f"{': ' + detail if detail else ''}); the checkpoint is damaged or incomplete: point "
            f"{field} at a whole one"
        ) from None
    if missing or unexpected:
        raise ManifestError(
            f"{field} {str(directory)!r}: checkpoint and model disagree (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    saved_dtype = getattr(torch, meta["dtype"])
    model_dtype = next(model.parameters()).dtype
    # Loading into a narrower dtype rounds (fp32 base, bf16 run): the saved hash cannot match,
    # so that load is recorded as unverified rather than refused.
    meta["verified"] = model_dtype in (saved_dtype, torch.float32)
    if not meta["verified"]:
        return meta
    found = weights_fingerprint(
        model, tp_group, dtype=saved_dtype, scheme=meta["fingerprint_scheme"]
    )
    if found != meta["fingerprint"]:
        older = ""
        if meta["fingerprint_scheme"] == PARAMETER_NAMES:
            older = (
                " (it was fingerprinted by module path, as fp8ops did before, which cannot match "
                "in a model of Megatron's other layer spec, such as precision.backend 'te': load "
                "it with the backend it was trained with, or train the base again)"
            )
        raise ManifestError(
            f"{meta_path}: the loaded weights hash to {found}, but the checkpoint was saved as "
            f"{meta['fingerprint']}; its files changed or are damaged, so rebuild it{older}"
        )
    return meta


def read_weights_into(model: nn.Module, directory: Path) -> tuple[list[str], list[str]]:
    """Read ``model``'s weights from the checkpoint ``directory`` into it (collective): a
    weights checkpoint, or a training checkpoint, which holds them under the same keys.
    Returns the keys the checkpoint lacked and those the model lacks (``_extra_state`` aside);
    a read error is raised as torch's checkpoint raises it, for the caller to word."""
    sharded = _weights_only(model.sharded_state_dict())
    loaded = load_sharded(sharded, directory)
    missing, unexpected = model.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    return [k for k in missing if not k.endswith("_extra_state")], list(unexpected)


def read_weights_meta(directory: Path, *, field: str) -> dict:
    """The metadata of a weights checkpoint, with errors that say what to do."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(
            f"{field}: base checkpoint {str(directory)!r} does not exist (paths are relative to "
            "the directory you run fp8ops from); train the base first (README: the CPU default "
            f"pre-trains it with manifests/tiny-gpt-cpu-base.yaml) or correct {field}"
        )
    meta_path = directory / META_FILE
    try:
        meta = loads_json(meta_path.read_text())
    except FileNotFoundError:
        if (directory / "config.json").is_file():
            raise ManifestError(
                f"{field}: {str(directory)!r} has a config.json but no model.safetensors or "
                "model.safetensors.index.json: fp8ops reads Hugging Face weights from safetensors "
                "only (save the model with transformers' save_pretrained to convert .bin files)"
            ) from None
        raise ManifestError(
            f"{field}: {str(directory)!r} is not an fp8ops weights checkpoint (no {META_FILE}); "
            "point it at the 'final' directory of a completed run, or at a Hugging Face "
            "checkpoint directory"
        ) from None
    except ValueError as exc:  # not JSON, not UTF-8, nested too deeply
        raise ManifestError(
            f"{meta_path}: not valid JSON ({exc}); the checkpoint is damaged"
        ) from None
    for key in ("architecture", "fingerprint", "dtype"):
        if key not in meta:
            raise ManifestError(f"{meta_path}: missing {key!r}; the checkpoint is damaged")
    meta.setdefault("fingerprint_scheme", PARAMETER_NAMES)  # written before it was named
    if meta["fingerprint_scheme"] not in FINGERPRINT_SCHEMES:
        raise ManifestError(
            f"{meta_path}: fingerprint_scheme {meta['fingerprint_scheme']!r} is not one of "
            f"{FINGERPRINT_SCHEMES}; the checkpoint is from a newer fp8ops, or damaged"
        )
    return meta


def _weights_only(sharded_state_dict: dict) -> dict:
    return {k: v for k, v in sharded_state_dict.items() if not k.endswith("_extra_state")}


def _gather_full(param: nn.Parameter, tp_group, parts: int = 1) -> torch.Tensor:
    """The full tensor of a tensor-parallel shard. ``parts``: each rank's shard holds that many
    blocks along the split (SwiGLU's gate and up), joined block by block across the ranks."""
    # Megatron marks shards on the Parameter itself (tensor_model_parallel, partition_dim).
    local = param.detach()
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(tp_group) == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    dim = param.partition_dim
    blocks = [shard.chunk(parts, dim=dim) for shard in shards]
    return torch.cat([rank[part] for part in range(parts) for rank in blocks], dim=dim)
