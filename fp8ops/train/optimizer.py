"""The optimizer step: float32 main weights, data-parallel gradient averaging, clipping, AdamW.

Megatron keeps a float32 "main" copy of bf16/fp16 weights and steps the optimizer on it
(``Float16OptimizerWithFloat16Params``); fine-tuning updates are often below bf16's resolution
and would round away otherwise. Megatron's own optimizers need CUDA, so this is the same scheme
on ``torch.optim.AdamW``: the model's parameters keep the base dtype, the optimizer holds float32
copies, and after each step the copies are rounded back into the model.

The gradient norm is the global one: tensor-parallel shards are summed across the TP group and
replicated parameters counted once (Megatron's ``param_is_not_tensor_parallel_duplicate``), so
TP=1 and TP=2 clip identically.

Tied embeddings under pipeline parallelism: the first stage's embedding and the last stage's
output layer are two copies of one weight (Megatron's ``setup_embeddings_and_output_layer``).
Their gradients are summed over Megatron's embedding group before the step, as Megatron's
``finalize_model_grads`` does, so both copies take the same step; the norms count the first
stage's copy only (``param_is_not_shared``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fp8ops.megatron.compat import parallel_state
from fp8ops.megatron.stages import pipeline_group


def learning_rate(step: int, optimizer_cfg, schedule) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up to ``lr`` over
    ``warmup_steps``, then ``lr_decay`` down to ``min_lr`` at the last step (Megatron's
    OptimizerParamScheduler shape)."""
    peak, floor = optimizer_cfg.lr, optimizer_cfg.min_lr
    warmup, total = schedule.warmup_steps, schedule.train_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.lr_decay == "constant" or total <= warmup + 1:
        return peak
    progress = min(1.0, (step - warmup) / (total - warmup - 1))
    if schedule.lr_decay == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def inner_optimizer(cfg, *, decay: list, no_decay: list) -> torch.optim.Optimizer:
    """The torch optimizer over float32 main tensors. Megatron's default: no weight decay on
    biases and norm weights (1-D parameters), so the caller splits them."""
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)


def main_grad(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient in float32 (zeros for one this step's batches never reached)."""
    if param.grad is None:
        return torch.zeros_like(param, dtype=torch.float32)
    return param.grad.detach().float()


def norm_kinds(params: list[nn.Parameter]) -> list[bool | None]:
    """How the global norm counts each parameter: True a TP shard (Megatron marks them), False
    a replica, None not at all (the last stage's copy of a tied embedding, Megatron's
    ``shared``: its first stage counts it)."""
    return [
        None if getattr(p, "shared", False) else bool(getattr(p, "tensor_model_parallel", False))
        for p in params
    ]


def tied_embedding(model: nn.Module, params: list[nn.Parameter]) -> list[bool]:
    """Per parameter, whether it is this stage's copy of a tied embedding held on two pipeline
    stages, whose gradient is summed over the embedding group."""
    if not getattr(model, "share_embeddings_and_output_weights", False) or pipeline_group() is None:
        return [False] * len(params)
    copy = model.shared_embedding_or_output_weight()  # None on the stages in between
    return [p is copy for p in params]


def sum_over_embedding_group(grads: list[torch.Tensor], tied: list[bool]) -> None:
    """Sum, in place, the float32 gradients ``tied`` marks over the first and last stages."""
    mine = [g for g, is_tied in zip(grads, tied, strict=True) if is_tied]
    if mine:  # only the two stages holding a copy are in the group
        all_reduce_flat(mine, parallel_state.get_embedding_group())


def global_norm(
    tensors: Iterable[torch.Tensor],
    is_shard: list[bool | None],
    tp_group,
    device: torch.device,
    pp_group=None,
) -> float:
    """The global L2 norm of per-parameter ``tensors``: TP shards summed over the TP group,
    replicas (the same on every TP rank) counted once (Megatron's
    ``param_is_not_tensor_parallel_duplicate``), ``None`` ones not (:func:`norm_kinds`).

    Accumulated in float64 on ``device``, where the tensors are, then brought to the host (one
    sync, free on the CPU), so the TP sum is a CPU scalar and goes over gloo like fp8ops' other
    small collectives. ``tensors`` may be a generator: zipped first, it runs to its end.
    ``pp_group``: the pipeline stages, whose parameters are disjoint. Each stage goes on from
    the sums of the stages before it, so the parameters are added in the whole model's order and
    the norm is the one without pipelining, bit for bit; the last stage's is everyone's.
    """
    rows = ((tensor,) for tensor in tensors)
    return global_norms(rows, (sum_of_squares,), is_shard, tp_group, device, pp_group)[0]


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's sum of squares as the norms here add them: in float64, whose squares of
    float32 and bf16 values are exact, in a fixed order (the same on every parallel layout)."""
    return tensor.double().pow(2).sum()


def quick_sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's sum of squares in float64 without a float64 copy of it (measured 4x faster
    than :func:`sum_of_squares` on the CPU, and as close, within float64 rounding): for the
    weights' norm, taken every step and compared only with the update's."""
    return torch.linalg.vector_norm(tensor, dtype=torch.float64).square()


def global_norms(
    rows: Iterable[tuple[torch.Tensor, ...]],
    squares: tuple[Callable[[torch.Tensor], torch.Tensor], ...],
    is_shard: list[bool | None],
    tp_group,
    device: torch.device,
    pp_group=None,
) -> list[float]:
    """:func:`global_norm` of several tensors per parameter at once (``rows`` yields one tuple
    per parameter, ``squares`` how each one's sum of squares is taken): one pass over the
    parameters and one set of collectives for all the norms. With :func:`sum_of_squares`, a
    norm is summed in the order :func:`global_norm` sums it alone: that norm, bit for bit."""
    stages = pp_group is not None and dist.get_world_size(pp_group) > 1
    sums = torch.zeros(2, len(squares), dtype=torch.float64)  # shards, replicas
    if stages and dist.get_rank(pp_group) > 0:
        dist.recv(sums, src=dist.get_global_rank(pp_group, dist.get_rank(pp_group) - 1))
    shards = [value.to(device) for value in sums[0]]
    replicas = [value.to(device) for value in sums[1]]
    for row, shard in zip(rows, is_shard):
        if shard is None:
            continue
        into = shards if shard else replicas
        for j, (tensor, square) in enumerate(zip(row, squares, strict=True)):
            into[j] += square(tensor)
    sums = torch.stack([torch.stack(shards).cpu(), torch.stack(replicas).cpu()])
    last = not stages or dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1
    if not last:
        next_stage = dist.get_global_rank(pp_group, dist.get_rank(pp_group) + 1)
        dist.send(sums, dst=next_stage)
    elif dist.get_world_size(tp_group) > 1:  # the TP group is within one stage
        dist.all_reduce(sums[0], group=tp_group)
    total = sums[0] + sums[1]
    if stages:
        dist.broadcast(
            total,
            src=dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1),
            group=pp_group,
        )
    return [math.sqrt(value) for value in total.tolist()]


def partial_over_tensor_parallel(model: nn.Module) -> list[bool]:
    """Per trainable parameter, whether its gradient is a partial sum over the TP group that
    must be summed there before the step (Megatron's ``finalize_model_grads`` rule): the norms
    under sequence parallelism (each rank saw part of the sequence; they carry
    ``sequence_parallel``) and the query/key norms (each rank saw its own heads)."""
    config = getattr(model, "config", None)
    sequence_parallel = getattr(config, "sequence_parallel", False)
    qk_layernorm = getattr(config, "qk_layernorm", False)
    return [
        (sequence_parallel and getattr(param, "sequence_parallel", False))
        or (qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
        for name, param in model.named_parameters()
        if param.requires_grad
    ]


def sum_over_tensor_parallel(grads: list[torch.Tensor], partial: list[bool], tp_group) -> None:
    """Sum, in place, the float32 gradients ``partial`` marks."""
    all_reduce_flat(
        [g for g, is_partial in zip(grads, partial, strict=True) if is_partial], tp_group
    )


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, in one collective rather than one per tensor."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# How _copy_back's (change, weights before it) are squared: the update norm as every norm here,
# the weights' quickly (quick_sum_of_squares).
UPDATE_AND_WEIGHTS = (sum_of_squares, quick_sum_of_squares)


class _MainParams:
    """What both optimizers share: a torch optimizer stepping float32 ``main_params`` for the
    model's ``model_params``, and its state as checkpoints read it."""

    cfg: object
    inner: torch.optim.Optimizer
    model_params: list[nn.Parameter]
    main_params: list[torch.Tensor]
    last_update_norm: float | None
    # The weights' norm before that update, which the update_blowup alert compares it with;
    # measured in the update norm's pass (_copy_back), not a pass and collectives of its own.
    last_weight_norm: float | None = None

    @property
    def moment_kinds(self) -> tuple[str, ...]:
        if isinstance(self.inner, torch.optim.AdamW):
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.cfg.beta1 else ()

    @property
    def keeps_main_copy(self) -> bool:
        """Whether separate float32 main weights exist (a float32 model's are its own)."""
        return any(p.dtype != torch.float32 for p in self.model_params)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: the moments, and main weights where they
        are separate tensors (a distributed optimizer's slices always are); counted from the
        main tensors, whose shapes the moments share, so nothing is allocated to count it."""
        total = 0
        for param, main in zip(self._owners(), self.main_params):
            copies = len(self.moment_kinds) + (main is not param)
            total += main.numel() * main.element_size() * copies
        return total

    def ensure_state(self) -> None:
        """Create the state as torch would at its first step (zeros, step 0), so that a
        checkpoint before any step, and a load into a fresh optimizer, have tensors to fill."""
        for main in self.main_params:
            state = self.inner.state[main]
            for kind in self.moment_kinds:
                if state.get(kind) is None:
                    state[kind] = torch.zeros_like(main, memory_format=torch.preserve_format)
            if isinstance(self.inner, torch.optim.AdamW) and "step" not in state:
                state["step"] = torch.tensor(0.0)

    @property
    def steps(self) -> int:
        """How many steps were taken (AdamW's per-tensor count; all agree). SGD keeps none: 0.
        A distributed rank owning no elements has none either; rank 0, whose count is the one
        recorded, always owns the first."""
        if not isinstance(self.inner, torch.optim.AdamW):
            return 0
        counts = {int(self.inner.state[m].get("step", torch.tensor(0.0))) for m in self.main_params}
        if len(counts) > 1:
            raise RuntimeError(
                f"optimizer parameters disagree on their step count: {sorted(counts)}"
            )
        return counts.pop() if counts else 0

    def set_steps(self, steps: int) -> None:
        if isinstance(self.inner, torch.optim.AdamW):
            for main in self.main_params:
                self.inner.state[main]["step"] = torch.tensor(float(steps))

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None

    @property
    def _device(self) -> torch.device:
        return self.model_params[0].device if self.model_params else torch.device("cpu")

    def _owners(self) -> list[nn.Parameter]:
        """The model parameter each main tensor belongs to."""
        raise NotImplementedError


class MainParamsOptimizer(_MainParams):
    """AdamW (or SGD) on float32 copies of the model's parameters.

    ``step()`` takes the model's gradients as they are after backward (already summed over
    micro-batches), sums them over data-parallel replicas, clips, steps and copies back. A sum,
    not a mean: each rank's loss is already divided by the token count of the whole global
    batch (Megatron's per-token loss), so the sum is the global batch's gradient.
    It returns the global gradient norm before clipping, and whether the step was skipped
    because that norm is not finite (the weights are then left untouched).
    ``last_update_norm`` is then the global norm of what the step changed in the model's
    weights, in their own dtype: an update that rounds away in bf16 does not count.
    """

    def __init__(self, model: nn.Module, optimizer_cfg, *, tp_group, dp_group, pp_group=None):
        self.cfg = optimizer_cfg
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # Float32 params are their own main copy: no second copy to keep in sync.
        self.main_params = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
            for p in self.model_params
        ]
        self.inner = inner_optimizer(
            optimizer_cfg,
            decay=[m for p, m in zip(self.model_params, self.main_params) if p.dim() > 1],
            no_decay=[m for p, m in zip(self.model_params, self.main_params) if p.dim() <= 1],
        )
        self._is_shard = norm_kinds(self.model_params)
        self._partial_over_tp = partial_over_tensor_parallel(model)
        self._tied = tied_embedding(model, self.model_params)
        self.last_update_norm: float | None = None

    def step(self, lr: float) -> tuple[float, bool]:
        """One optimizer step at ``lr``; returns (gradient norm before clipping, skipped)."""
        grads = [main_grad(p) for p in self.model_params]
        sum_over_tensor_parallel(grads, self._partial_over_tp, self.tp_group)
        all_reduce_flat(grads, self.dp_group)
        sum_over_embedding_group(grads, self._tied)
        norm = global_norm(grads, self._is_shard, self.tp_group, self._device, self.pp_group)
        skipped = not math.isfinite(norm)
        if not skipped:
            if self.cfg.clip_grad is not None and norm > self.cfg.clip_grad:
                # torch's clip_grad_norm_ factor, with its epsilon.
                factor = self.cfg.clip_grad / (norm + 1e-6)
                torch._foreach_mul_(grads, factor)
            for main, grad in zip(self.main_params, grads):
                main.grad = grad
            for group in self.inner.param_groups:
                group["lr"] = lr
            # Float32 parameters are stepped in place: keep their old values to measure the step
            # (a float32 base dtype only; bf16/fp16 models compare against their own weights).
            before = [
                p.detach().clone() if m is p else None
                for p, m in zip(self.model_params, self.main_params)
            ]
            self.inner.step()
            self.last_update_norm, self.last_weight_norm = global_norms(
                self._copy_back(before),
                UPDATE_AND_WEIGHTS,
                self._is_shard,
                self.tp_group,
                self._device,
                self.pp_group,
            )
        else:  # nothing changed: no update, rather than a zero one
            self.last_update_norm = self.last_weight_norm = None
        for main in self.main_params:
            main.grad = None
        self.zero_grad()
        return norm, skipped

    def _copy_back(self, before: list[torch.Tensor | None]):
        """Round the stepped main weights into the model, yielding each parameter's change and
        its weights before it as it goes: the norms then hold one parameter at a time, not a
        copy of the model, and read the old weights in the pass that measures the change."""
        with torch.no_grad():
            for param, main, old in zip(self.model_params, self.main_params, before):
                if main is param:
                    yield param - old, old
                    continue
                new = main.to(param.dtype)  # rounds to the base dtype
                yield new.float() - param.float(), param  # read before the copy below
                param.copy_(new)

    # -- checkpoints: each parameter's whole state (here, the optimizer's own tensors) ------

    def canonical_state(self, *, for_load: bool = False) -> list[dict[str, torch.Tensor]]:
        """Per model parameter, its float32 state by kind: the moments, and "main" where a
        separate copy is kept. Loads fill these tensors in place (``for_load`` changes
        nothing here)."""
        self.ensure_state()
        state = []
        for param, main in zip(self.model_params, self.main_params):
            tensors = {kind: self.inner.state[main][kind] for kind in self.moment_kinds}
            if main is not param:
                tensors["main"] = main.detach()
            state.append(tensors)
        return state

    def load_canonical_state(self, loaded: list[dict[str, torch.Tensor]]) -> None:
        """Take each parameter's loaded state; without "main" (a float32 checkpoint), the main
        weights are the model's."""
        self.ensure_state()
        with torch.no_grad():
            for param, main, state in zip(self.model_params, self.main_params, loaded, strict=True):
                for kind in self.moment_kinds:
                    self.inner.state[main][kind].copy_(state[kind])
                if main is not param:
                    main.copy_(state.get("main", param.float()))

    def _owners(self) -> list[nn.Parameter]:
        return self.model_params
