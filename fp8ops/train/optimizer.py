"""The optimizer step: float32 main weights, data-parallel gradient averaging, clipping, AdamW.

Megatron keeps a float32 "main" copy of bf16/fp16 weights and steps the optimizer on it
(``Float16OptimizerWithFloat16Params``); fine-tuning updates are often below bf16's resolution
and would round away otherwise. Megatron's own optimizers need CUDA, so this is the same scheme
on ``torch.optim.AdamW``: the model's parameters keep the base dtype, the optimizer holds float32
copies, and after each step the copies are rounded back into the model.

The gradient norm is the global one: tensor-parallel shards are summed across the TP group and
replicated parameters counted once (Megatron's ``param_is_not_tensor_parallel_duplicate``), so
TP=1 and TP=2 clip identically.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


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


class MainParamsOptimizer:
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

    def __init__(self, model: nn.Module, optimizer_cfg, *, tp_group, dp_group):
        self.cfg = optimizer_cfg
        self.tp_group, self.dp_group = tp_group, dp_group
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # Float32 params are their own main copy: no second copy to keep in sync.
        self.main_params = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
            for p in self.model_params
        ]
        # Megatron's default: no weight decay on biases and norm weights (1-D parameters).
        decay = [m for p, m in zip(self.model_params, self.main_params) if p.dim() > 1]
        no_decay = [m for p, m in zip(self.model_params, self.main_params) if p.dim() <= 1]
        groups = [
            {"params": decay, "weight_decay": optimizer_cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if optimizer_cfg.name == "adamw":
            self.inner = torch.optim.AdamW(
                groups,
                lr=optimizer_cfg.lr,
                betas=(optimizer_cfg.beta1, optimizer_cfg.beta2),
                eps=optimizer_cfg.eps,
            )
        else:
            self.inner = torch.optim.SGD(groups, lr=optimizer_cfg.lr, momentum=optimizer_cfg.beta1)
        # Whether each parameter is a TP shard (Megatron marks them) or a replica.
        self._is_shard = [
            bool(getattr(p, "tensor_model_parallel", False)) for p in self.model_params
        ]
        self.last_update_norm: float | None = None

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None

    def step(self, lr: float) -> tuple[float, bool]:
        """One optimizer step at ``lr``; returns (gradient norm before clipping, skipped)."""
        grads = [self._main_grad(p) for p in self.model_params]
        self._sum_over_data_parallel(grads)
        norm = self._global_norm(grads)
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
            self.last_update_norm = self._global_norm(self._copy_back(before))
        else:
            self.last_update_norm = None  # nothing changed: no update, rather than a zero one
        for main in self.main_params:
            main.grad = None
        self.zero_grad()
        return norm, skipped

    def _copy_back(self, before: list[torch.Tensor | None]):
        """Round the stepped main weights into the model, yielding each parameter's change as it
        goes: the update's norm then holds one change at a time, not a copy of the model."""
        with torch.no_grad():
            for param, main, old in zip(self.model_params, self.main_params, before):
                if main is param:
                    yield param - old
                    continue
                new = main.to(param.dtype)  # rounds to the base dtype
                yield new.float() - param.float()
                param.copy_(new)

    def state_dict(self) -> dict:
        return {
            "inner": self.inner.state_dict(),
            "main_params": [m.detach() for m in self.main_params],
        }

    @staticmethod
    def _main_grad(param: nn.Parameter) -> torch.Tensor:
        if param.grad is None:  # a parameter this step's batches never reached
            return torch.zeros_like(param, dtype=torch.float32)
        return param.grad.detach().float()

    def _sum_over_data_parallel(self, grads: list[torch.Tensor]) -> None:
        if dist.get_world_size(self.dp_group) == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _global_norm(self, tensors: Iterable[torch.Tensor]) -> float:
        # [shards' sum of squares, replicas' sum of squares]: shards sum over the TP group,
        # replicas are the same on every TP rank and count once. Accumulated where the
        # gradients are, then brought to the host (one sync, free on the CPU), so the TP sum is
        # a CPU scalar and goes over gloo like fp8ops' other small collectives.
        # ``tensors`` may be a generator (``_copy_back``): zipped first, it runs to its end.
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        shards = torch.zeros((), dtype=torch.float64, device=device)
        replicas = torch.zeros((), dtype=torch.float64, device=device)
        for tensor, is_shard in zip(tensors, self._is_shard):
            if is_shard:
                shards += tensor.double().pow(2).sum()
            else:
                replicas += tensor.double().pow(2).sum()
        shards, replicas = shards.cpu(), replicas.cpu()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(shards, group=self.tp_group)
        return math.sqrt((shards + replicas).item())
