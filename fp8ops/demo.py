"""A short FP8 demo on a single linear layer, driven by a manifest's precision policy.

It fits one layer of the manifest's MLP shape (hidden -> ffn) to a fixed random teacher, once
under FP8 delayed scaling and once in float32 from the same initial weights, and shows
per step what delayed scaling did: the amaxes, the scales they produced for the next step,
how many values saturated or underflowed, and the loss gap to float32. One activation spike
shows the delay (the spike itself saturates: the scale in use was set before it) and the
window (the lowered scale stays until the spike leaves the amax history).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from fp8ops.precision import DelayedScalingRecipe, Fp8Linear, Fp8Scope

DEMO_STEPS = 24
TOKENS = 64
SPIKE_STEP = (
    6  # one activation outlier: the scale drops at once, recovers when it leaves the window
)


@dataclass
class DemoStep:
    step: int
    loss_fp8: float
    loss_fp32: float
    input_amax: float
    input_scale: float
    weight_scale: float
    grad_scale: float
    saturated: float  # fraction of input elements clipped at the FP8 max
    underflow: float  # fraction of non-zero input elements flushed to zero


def run_demo(manifest, steps: int = DEMO_STEPS) -> list[DemoStep]:
    """Train the FP8 layer and its float32 twin side by side; return one record per step."""
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    hidden, ffn = manifest.model.hidden_size, manifest.model.ffn_hidden_size
    torch.manual_seed(manifest.seeds.model)
    fp8_layer = Fp8Linear(hidden, ffn, recipe)
    fp8_layer.track_stats = True
    fp32_layer = copy.deepcopy(fp8_layer)  # same weights; never enters a scope
    teacher = torch.randn(ffn, hidden) / hidden**0.5
    scope = Fp8Scope(recipe)
    # The MSE averages over tokens x ffn outputs, so gradients are small: lr 2 lets the
    # layer visibly fit the teacher within the demo's steps.
    optimizers = [torch.optim.SGD(m.parameters(), lr=2.0) for m in (fp8_layer, fp32_layer)]

    generator = torch.Generator().manual_seed(manifest.seeds.data)
    records = []
    for step in range(1, steps + 1):
        x = torch.randn(TOKENS, hidden, generator=generator)
        if step == SPIKE_STEP:
            x[0, 0] = 100.0
        target = x @ teacher.T
        with scope():
            loss_fp8 = torch.nn.functional.mse_loss(fp8_layer(x), target)
        loss_fp32 = torch.nn.functional.mse_loss(fp32_layer(x), target)
        for loss, optimizer in zip((loss_fp8, loss_fp32), optimizers):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        meta, stats = fp8_layer.fp8_meta, fp8_layer.last_cast_stats["input"]
        records.append(
            DemoStep(
                step=step,
                loss_fp8=loss_fp8.item(),
                loss_fp32=loss_fp32.item(),
                input_amax=stats.amax.item(),
                input_scale=meta.forward.scale[0].item(),
                weight_scale=meta.forward.scale[1].item(),
                grad_scale=meta.backward.scale[0].item(),
                saturated=int(stats.saturated) / stats.numel,
                underflow=int(stats.underflow) / stats.numel,
            )
        )
    return records


def print_demo(records: list[DemoStep], console: Console) -> None:
    table = Table(title="FP8 delayed scaling on one linear layer (scales are after the step)")
    for column in ("step", "loss fp8", "loss fp32", "input amax", "input scale",
                   "weight scale", "grad scale", "saturated", "underflow"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(
            str(r.step), f"{r.loss_fp8:.4f}", f"{r.loss_fp32:.4f}", f"{r.input_amax:.3g}",
            f"{r.input_scale:.4g}", f"{r.weight_scale:.4g}", f"{r.grad_scale:.4g}",
            f"{r.saturated:.3%}", f"{r.underflow:.3%}",
        )  # fmt: skip
    console.print(table)
    gap = max(abs(r.loss_fp8 - r.loss_fp32) / r.loss_fp32 for r in records)
    console.print(f"largest relative loss gap FP8 vs float32: {gap:.2%}")
