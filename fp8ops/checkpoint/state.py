"""What a training checkpoint holds, as Megatron ``ShardedTensor``s, and how it is put back.

Four kinds of state, all tensors, all through ``dist_checkpointing`` (so weights and optimizer
state reshard when the tensor-parallel size changes):

* **weights**: Megatron's own sharded state dict of the model, without ``_extra_state``
  (Megatron would pickle it as a ``ShardedObject``).
* **optimizer**: float32 main weights and the AdamW moments, each parameter's whole state sharded
  exactly like the parameter (``optimizer.<kind>.<parameter key>``), so it reshards with it on a
  TP change, and a DP change or the other optimizer cuts its own slices out of it.
* **FP8 state**: every module's scales and full forward/backward amax histories, stored once per
  *state group* (the ranks that share one state because their amaxes are reduced together) as
  ``fp8.<module>.<tensor>`` with a leading group axis. See :class:`Fp8Layout`.
* **per-rank state**: the torch RNG and the alert engine's windows, one row per rank
  (restored only at the same world size; they have no meaning on another layout).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

FP8_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


@dataclass(frozen=True)
class Fp8Layout:
    """Which state group this rank's FP8 state belongs to, and how many groups there are.

    The group is the set of ranks whose amaxes are all-reduced together: their states are
    identical, so one of them (``replica == 0``) writes the group's copy. Under pipeline
    parallelism every stage holds other modules, so groups and replicas are counted within a
    stage (over its TP x DP ranks), and each stage's modules are written by that stage.
    """

    name: str  # "shared" | "per_dp_replica" | "per_rank" | "none"
    groups: int
    group: int  # this rank's group index
    replica: int  # this rank's index inside its group

    @classmethod
    def for_run(cls, *, fp8: bool, reduce_amax: bool, topology, ranks) -> Fp8Layout:
        in_stage = ranks.dp_rank * topology.tensor_parallel + ranks.tp_rank
        if not fp8:
            return cls("none", 1, 0, in_stage)
        if not reduce_amax:
            return cls("per_rank", topology.stage_ranks, in_stage, 0)
        if topology.amax_reduction == "tp_cp" and topology.data_parallel > 1:
            return cls("per_dp_replica", topology.data_parallel, ranks.dp_rank, ranks.tp_rank)
        return cls("shared", 1, 0, in_stage)


# -- FP8 state digests --------------------------------------------------------------------


def fp8_digest(module) -> str:
    """sha256 of one module's FP8 state: every tensor's bytes in a fixed order."""
    digest = hashlib.sha256()
    for key, tensor in sorted(module.fp8_meta.state_dict().items()):
        digest.update(f"{key}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Agreement:
    """Whether every rank of a group holds the same FP8 state (:func:`fp8_states_agree`)."""

    agree: bool  # across every group (each rank learns the same answer)
    ranks: int  # in this rank's group
    digest: str  # this rank's combined digest


def fp8_states_agree(modules: dict[str, nn.Module], group) -> Agreement:
    """Compare every rank's FP8 state across ``group`` (collective over the whole world).

    Reduced amaxes make scales and histories identical across an amax reduction group; a rank
    that drifted (a missed collective, a module that ran on one rank only) would quietly train
    with other scales. One sha256 per rank, combined from the checkpoint's per-module digests
    (one definition of "the same state"), is gathered over ``group``; the verdict is then
    reduced over the world, since with several groups (one per DP replica) every rank must take
    the same path after it.
    """
    digest = hashlib.sha256()
    for module in modules.values():
        digest.update(fp8_digest(module).encode())
    mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    ranks = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(everyone, mine, group=group)
    agree = torch.tensor(float(all(torch.equal(mine, other) for other in everyone)))
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return Agreement(agree=bool(agree.item()), ranks=ranks, digest=digest.hexdigest())


def group_digests(modules: dict[str, nn.Module], layout: Fp8Layout) -> dict[str, list[str]]:
    """Every module of every pipeline stage -> one digest per state group, as the group's first
    rank holds it (collective). Ranks are gathered in rank order, and Megatron numbers the first
    stage's ranks first, so the modules come in the model's order."""
    mine = {name: fp8_digest(module) for name, module in modules.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (layout.group, layout.replica, mine))
    by_group: dict[int, dict[str, str]] = {}
    for group, replica, digests in everyone:
        if replica == 0:  # one writer per group and stage; the stages' modules differ
            by_group.setdefault(group, {}).update(digests)
    names = dict.fromkeys(name for _, _, digests in everyone for name in digests)
    return {name: [by_group[g][name] for g in range(layout.groups)] for name in names}


# -- building the sharded state dict ---------------------------------------------------------


def weights_state(model: nn.Module) -> dict:
    """Megatron's sharded state dict of the model, minus ``_extra_state``."""
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def optimizer_state(optimizer, weights: dict, *, for_load: bool = False) -> dict:
    """The optimizer's state, each tensor a ``ShardedTensor`` shaped like its parameter's.

    ``optimizer.canonical_state()`` gives every parameter's whole float32 state by kind (the
    moments, and "main" where separate main weights are kept), whichever optimizer holds it
    (a distributed one gathers its slices), so checkpoints move between optimizers and DP sizes.
    """
    state = {}
    canonical = optimizer.canonical_state(for_load=for_load)
    for param, tensors in zip(optimizer.model_params, canonical, strict=True):
        # Dict keys are unique per parameter; ShardedTensor keys are not (a layer's tensors
        # share one key and differ by their offset on the layer axis).
        name, sharded = _sharded_param(weights, param)
        for kind, tensor in tensors.items():
            fields = {"key": f"optimizer.{kind}.{sharded.key}", "data": tensor}
            # A SwiGLU linear_fc1 is a ShardedTensorFactory (it splits into gate and up when
            # saved), which has no dtype field: it takes its tensor's, as Megatron's own
            # optimizer state does (make_sharded_optimizer_tensor).
            if hasattr(sharded, "dtype"):
                fields["dtype"] = tensor.dtype
            state[f"optimizer.{kind}.{name}"] = dataclasses.replace(sharded, **fields)
    return state


def _sharded_param(weights: dict, param: torch.Tensor):
    for name, sharded in weights.items():
        if sharded.data is not None and sharded.data.data_ptr() == param.data_ptr():
            return name, sharded
    raise KeyError(
        f"a trained parameter of shape {tuple(param.shape)} has no entry in the model's sharded "
        "state dict, so its optimizer state has no checkpoint key"
    )


def fp8_state(modules: dict[str, nn.Module], layout: Fp8Layout) -> dict:
    """Each module's FP8 tensors as this rank's group's slice of ``[groups, ...]`` tensors
    (written by the group's first rank; the others hold replicas)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    state = {}
    for name, module in modules.items():
        for tensor_name, tensor in module.fp8_meta.state_dict().items():
            key = f"fp8.{name}.{tensor_name}"
            state[key] = ShardedTensor.from_rank_offsets(
                key,
                tensor,
                (0, layout.group, layout.groups),
                replica_id=layout.replica,
                prepend_axis_num=1,
            )
    return state


def fp8_state_all_groups(modules: dict[str, nn.Module], groups: int, rank: int) -> dict:
    """Load targets for a topology change: every rank reads the saved ``[groups, ...]`` tensors
    whole (rank 0 as the main replica) and takes group 0, the groups being identical."""
    from megatron.core.dist_checkpointing import ShardedTensor

    state = {}
    for name, module in modules.items():
        for tensor_name, tensor in module.fp8_meta.state_dict().items():
            key = f"fp8.{name}.{tensor_name}"
            # On the module's device, as its own-group target would be (dist_checkpointing
            # loads into the tensors it is given).
            whole = torch.empty((groups, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            state[key] = ShardedTensor.from_rank_offsets(key, whole, replica_id=rank)
    return state


def restore_fp8(modules: dict[str, nn.Module], loaded: dict) -> None:
    """Put loaded FP8 tensors back: an own-group slice, or group 0 of the whole tensor."""
    for name, module in modules.items():
        shapes = {t: v.shape for t, v in module.fp8_meta.state_dict().items()}
        module.fp8_meta.load_state_dict(
            {t: loaded[f"fp8.{name}.{t}"].reshape(-1, *shapes[t])[0] for t in FP8_TENSORS}
        )


def per_rank_state(alert_engine, ranks) -> dict:
    """This rank's RNG and alert windows, as row ``rank`` of ``[world, ...]`` tensors (host
    tensors on any device: torch's CPU generator, numpy windows). Nothing in training draws from
    the CUDA generator (no dropout; weights are initialised on the CPU), so it is not saved."""
    from megatron.core.dist_checkpointing import ShardedTensor

    tensors = {"rng.torch": torch.get_rng_state()}
    if alert_engine is not None:
        for name, array in alert_engine.state_dict().items():
            if array.size:  # a run without FP8 modules has empty per-module windows
                tensors[f"alerts.{name}"] = torch.from_numpy(np.ascontiguousarray(array)).clone()
    return {
        f"rank.{key}": ShardedTensor.from_rank_offsets(
            f"rank.{key}", t, (0, ranks.rank, ranks.world_size), replica_id=0, prepend_axis_num=1
        )
        for key, t in tensors.items()
    }


def restore_per_rank(loaded: dict, alert_engine) -> None:
    # Loaded into the host tensors per_rank_state gave; .cpu() is free there.
    torch.set_rng_state(loaded["rank.rng.torch"].cpu().reshape(-1))
    if alert_engine is not None:
        # Reshaped to the engine's own shapes: a 0-d value comes back with the rank axis.
        # Keys the checkpoint lacks (a rule added since) are left out: the engine starts those
        # rules afresh.
        shapes = {k: v.shape for k, v in alert_engine.state_dict().items()}
        alert_engine.load_state_dict(
            {
                k: loaded[f"rank.alerts.{k}"].cpu().numpy().reshape(shape)
                if np.prod(shape)
                else np.empty(shape)
                for k, shape in shapes.items()
                if f"rank.alerts.{k}" in loaded or not np.prod(shape)
            }
        )


def restore_optimizer(optimizer, weights: dict, loaded: dict) -> None:
    """Hand each parameter's loaded state to the optimizer, which takes its own part; "main"
    is absent from a checkpoint of a float32 model (its weights are the main weights)."""
    state = []
    for param in optimizer.model_params:
        name, _ = _sharded_param(weights, param)
        keys = {kind: f"optimizer.{kind}.{name}" for kind in (*optimizer.moment_kinds, "main")}
        state.append({kind: loaded[key] for kind, key in keys.items() if key in loaded})
    optimizer.load_canonical_state(state)
