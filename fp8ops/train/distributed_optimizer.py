"""The distributed optimizer: float32 main weights and AdamW moments sharded over data parallel.

``MainParamsOptimizer`` keeps every main weight and both moments on every data-parallel rank,
12 bytes per parameter each. Megatron's distributed optimizer (ZeRO stage 1) keeps only a
1/DP slice of them: gradients are reduce-scattered into the slices, each rank steps its slice,
and the updated weights are all-gathered back into every replica. Megatron's own needs CUDA
(its ``DistributedDataParallel`` grad buffers), so this is the same scheme on
``torch.optim.AdamW`` and torch.distributed, over gloo on the CPU and NCCL on GPUs.

The slices follow Megatron's buffer layout (``ParamAndGradBuffer`` with
``use_distributed_optimizer``) so that a rank owns the same elements it would under Megatron:
parameters in reverse order, each starting at a multiple of 64 elements, one bucket padded to a
multiple of lcm(DP, 128), and rank r owning the r-th of DP equal, contiguous parts of it.

Results match ``MainParamsOptimizer``'s: the same sums, norms and AdamW arithmetic per element
(tested bit for bit at DP 2). Checkpoints hold each parameter's whole state, as
``MainParamsOptimizer``'s do (Megatron's ``fully_reshardable`` format): the slices are
gathered when saving and cut out when loading, so checkpoints move between the two optimizers
and across DP, TP changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fp8ops.train.optimizer import (
    UPDATE_AND_WEIGHTS,
    _MainParams,
    all_reduce_flat,
    global_norms,
    inner_optimizer,
    main_grad,
    norm_kinds,
    partial_over_tensor_parallel,
    sum_over_embedding_group,
    sum_over_tensor_parallel,
    tied_embedding,
)

PARAM_ALIGN = 64  # elements: Megatron starts each parameter at a 128-byte address (16-bit)
BUCKET_ALIGN = 128  # elements: and pads the bucket to lcm(DP, 128) so DP parts are equal


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns: flat ranges in the parameter and the
    buffer."""

    param: int  # index into the optimizer's model_params
    start: int  # in the parameter, flattened
    stop: int
    buffer_start: int  # in the bucket buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BufferLayout:
    """Where every parameter sits in the flat buffer, and which part each DP rank owns."""

    ranges: tuple[tuple[int, int], ...]  # per parameter: [start, stop) in the buffer
    numel: int  # the padded buffer, a multiple of dp
    dp: int

    @classmethod
    def build(cls, numels: list[int], dp: int) -> BufferLayout:
        # Megatron walks the parameters backwards (roughly the order backward produces them).
        ranges: list[tuple[int, int] | None] = [None] * len(numels)
        cursor = 0
        for index in reversed(range(len(numels))):
            start = _round_up(cursor, PARAM_ALIGN)
            ranges[index] = (start, start + numels[index])
            cursor = start + numels[index]
        return cls(tuple(ranges), _round_up(cursor, math.lcm(dp, BUCKET_ALIGN)), dp)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    def pieces(self, dp_rank: int) -> list[Piece]:
        """The parts of parameters inside rank ``dp_rank``'s shard, in buffer order."""
        lo, hi = dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel
        owned = []
        for index, (start, stop) in enumerate(self.ranges):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                owned.append(Piece(index, a - start, b - start, a))
        return sorted(owned, key=lambda p: p.buffer_start)


class DistributedMainParamsOptimizer(_MainParams):
    """AdamW (or SGD) on this data-parallel rank's slice of the float32 main weights.

    The same contract as ``MainParamsOptimizer``: ``step(lr)`` takes the gradients backward left
    in the model (summed over micro-batches), sums them over DP, clips by the global norm, steps
    and writes the new weights into every replica; it returns (norm before clipping, skipped).
    """

    def __init__(self, model: nn.Module, optimizer_cfg, *, tp_group, dp_group, pp_group=None):
        self.cfg = optimizer_cfg
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.model_params}
        if len(dtypes) > 1:  # the new weights are gathered in one buffer of the model's dtype
            raise ValueError(
                f"the distributed optimizer needs one parameter dtype, the model has "
                f"{sorted(map(str, dtypes))}"
            )
        self._is_shard = norm_kinds(self.model_params)
        self._partial_over_tp = partial_over_tensor_parallel(model)
        self._tied = tied_embedding(model, self.model_params)
        self.dp_rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        self.layout = BufferLayout.build([p.numel() for p in self.model_params], dp)
        self.pieces = self.layout.pieces(self.dp_rank)
        self._shard_start = self.dp_rank * self.layout.shard_numel
        # One float32 main tensor per piece (Megatron's shard_fp32_from_float16 groups): the
        # optimizer state lives only for what this rank owns.
        self.main_params = [
            self._flat(p.param)[p.start : p.stop].detach().float().clone().requires_grad_()
            for p in self.pieces
        ]
        self.inner = inner_optimizer(
            optimizer_cfg,
            decay=[m for p, m in zip(self.pieces, self.main_params) if self._dim(p) > 1],
            no_decay=[m for p, m in zip(self.pieces, self.main_params) if self._dim(p) <= 1],
        )
        self.last_update_norm: float | None = None

    def step(self, lr: float) -> tuple[float, bool]:
        """One optimizer step at ``lr``; returns (gradient norm before clipping, skipped)."""
        shard = self._reduce_scatter_grads()
        grads = [shard[self._local(p)] for p in self.pieces]
        norm = self._norm(grads)
        skipped = not math.isfinite(norm)
        if not skipped:
            if self.cfg.clip_grad is not None and norm > self.cfg.clip_grad:
                shard.mul_(self.cfg.clip_grad / (norm + 1e-6))  # torch's clip_grad_norm_ factor
            for main, grad in zip(self.main_params, grads):
                main.grad = grad
            for group in self.inner.param_groups:
                group["lr"] = lr
            self.inner.step()
            # Both norms over the whole gathered weights, which every DP rank holds: no
            # collective over DP (each rank finds the same), one pass for both.
            self.last_update_norm, self.last_weight_norm = global_norms(
                self._copy_back(),
                UPDATE_AND_WEIGHTS,
                self._is_shard,
                self.tp_group,
                self._device,
                self.pp_group,
            )
        else:
            self.last_update_norm = self.last_weight_norm = None
        for main in self.main_params:
            main.grad = None
        self.zero_grad()
        return norm, skipped

    # -- checkpoints: each parameter's whole state ------------------------------------------

    def canonical_state(self, *, for_load: bool = False) -> list[dict[str, torch.Tensor]]:
        """Per model parameter, its whole float32 state by kind (the moments, and "main" for a
        parameter that is not float32), gathered from every DP rank (collective). Checkpoints
        store this; ``for_load`` gives empty tensors of the same shapes to load into."""
        self.ensure_state()
        copies = self.moment_kinds + (("main",) if self.keeps_main_copy else ())
        whole = {}
        for kind in copies:
            if for_load:  # on the host: loading must not need the whole state on the device
                whole[kind] = torch.empty(self.layout.numel, dtype=torch.float32)
                continue
            local = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self._device)
            for piece, main in zip(self.pieces, self.main_params):
                value = main if kind == "main" else self.inner.state[main][kind]
                local[self._local(piece)] = value.detach()
            whole[kind] = self._all_gather(local)
        state = []
        for param, (start, stop) in zip(self.model_params, self.layout.ranges):
            kinds = copies if param.dtype != torch.float32 else self.moment_kinds
            state.append({kind: whole[kind][start:stop].view_as(param) for kind in kinds})
        return state

    def load_canonical_state(self, loaded: list[dict[str, torch.Tensor]]) -> None:
        """Cut this rank's slices out of each parameter's whole loaded state; without "main"
        (a float32 parameter, or a checkpoint of a float32 model), the main weights are the
        model's."""
        self.ensure_state()
        with torch.no_grad():
            for piece, main in zip(self.pieces, self.main_params):
                state = loaded[piece.param]
                for kind in self.moment_kinds:
                    flat = state[kind].reshape(-1)[piece.start : piece.stop]
                    self.inner.state[main][kind].copy_(flat)
                source = state.get("main", self.model_params[piece.param].detach())
                main.copy_(source.reshape(-1)[piece.start : piece.stop])

    def _owners(self) -> list[nn.Parameter]:
        return [self.model_params[piece.param] for piece in self.pieces]

    # -- the step's parts -------------------------------------------------------------------

    def _reduce_scatter_grads(self) -> torch.Tensor:
        """This rank's slice of the DP-summed float32 gradients (padding is zeros); the
        gradients that are partial over TP summed there first."""
        buffer = torch.zeros(self.layout.numel, dtype=torch.float32, device=self._device)
        for param, (start, stop) in zip(self.model_params, self.layout.ranges):
            buffer[start:stop] = main_grad(param).reshape(-1)
        views = [buffer[start:stop] for start, stop in self.layout.ranges]
        sum_over_tensor_parallel(views, self._partial_over_tp, self.tp_group)
        self._sum_tied_embedding(views)
        if self.layout.dp == 1:
            return buffer
        shard = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self._device)
        dist.reduce_scatter_tensor(shard, buffer, group=self.dp_group)
        return shard

    def _sum_tied_embedding(self, views: list[torch.Tensor]) -> None:
        """A tied embedding's two copies (first and last stage) must take the same step, so
        their gradients must be equal bit for bit. The two stages' buffers place the copies
        apart, where a reduce-scatter may add their DP parts in other orders: each copy is summed
        whole here instead, over DP and then over the two stages (the replicated optimizer's
        order), and passed to the reduce-scatter by DP rank 0 alone; adding zeros is exact."""
        tied = [view for view, is_tied in zip(views, self._tied, strict=True) if is_tied]
        if not tied:
            return
        all_reduce_flat(tied, self.dp_group)
        sum_over_embedding_group(views, self._tied)
        if self.dp_rank != 0:
            for view in tied:
                view.zero_()

    def _norm(self, grads: list[torch.Tensor]) -> float:
        # Each rank holds a disjoint slice: sum the squares over DP, then TP shards over TP,
        # replicas once (they sit at the same place in every TP rank's buffer).
        sums = torch.zeros(2, dtype=torch.float64, device=self._device)
        for piece, grad in zip(self.pieces, grads):
            kind = self._is_shard[piece.param]
            if kind is not None:  # not the last stage's copy of a tied embedding
                sums[0 if kind else 1] += grad.double().pow(2).sum()
        sums = sums.cpu()
        if self.layout.dp > 1:
            dist.all_reduce(sums, group=self.dp_group)
        shards, replicas = sums[0], sums[1]
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(shards, group=self.tp_group)
        total = shards + replicas
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(total, group=self.pp_group)  # the stages' parameters are disjoint
        return math.sqrt(total.item())

    def _copy_back(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Gather every rank's new weights (in the model's dtype) into each replica, yielding
        each parameter's change in float32 and its weights before it as it goes."""
        dtype = self.model_params[0].dtype if self.model_params else torch.float32
        local = torch.zeros(self.layout.shard_numel, dtype=dtype, device=self._device)
        for piece, main in zip(self.pieces, self.main_params):
            local[self._local(piece)] = main.detach().to(dtype)  # rounds to the base dtype
        whole = self._all_gather(local)
        with torch.no_grad():
            for param, (start, stop) in zip(self.model_params, self.layout.ranges):
                new = whole[start:stop].view_as(param)
                yield new.float() - param.float(), param  # read before the copy below
                param.copy_(new)

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.layout.dp == 1:
            return local
        whole = torch.empty(self.layout.numel, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(whole, local, group=self.dp_group)
        return whole

    def _local(self, piece: Piece) -> slice:
        offset = piece.buffer_start - self._shard_start
        return slice(offset, offset + piece.numel)

    def _flat(self, index: int) -> torch.Tensor:
        return self.model_params[index].detach().reshape(-1)

    def _dim(self, piece: Piece) -> int:
        return self.model_params[piece.param].dim()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
