"""torchrun worker: the distributed optimizer against the replicated one, step by step.

Every rank builds the same small model twice (bf16 or float32), gives both copies the same
rank-dependent gradients, and steps one with ``MainParamsOptimizer`` and the other with
``DistributedMainParamsOptimizer``; some steps are clipped, one is skipped (inf on one rank).
Then each rank's whole state (gathered) is compared with the replicated optimizer's, and a
fresh distributed optimizer loaded from the replicated one's state takes one more step.
Writes OUT_DIR/rank{r}.json with what it found.
Usage: torchrun --standalone --nproc_per_node N distributed_optimizer.py OUT_DIR {bf16|fp32}
"""

import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fp8ops.manifest.schema import OptimizerConfig
from fp8ops.train.distributed_optimizer import DistributedMainParamsOptimizer
from fp8ops.train.optimizer import MainParamsOptimizer

STEPS = 6
SKIPPED = 3  # the step whose gradients hold an inf on the last rank


def build(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # same weights on every rank; sizes that split across shards
    return nn.Sequential(nn.Linear(37, 53), nn.LayerNorm(53), nn.Linear(53, 11, bias=False)).to(
        dtype
    )


def give_grads(model: nn.Module, step: int, rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    scale = 0.02 if step % 2 else 3.0  # odd steps under the clip, even ones clipped
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)
    if step == SKIPPED and rank == world - 1:
        next(model.parameters()).grad.view(-1)[5] = math.inf


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main(out_dir: Path, dtype_name: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    cfg = OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.1)
    groups = {"tp_group": dist.new_group([rank]), "dp_group": dist.group.WORLD}
    replicated_model, sharded_model = build(dtype), build(dtype)
    replicated = MainParamsOptimizer(replicated_model, cfg, **groups)
    sharded = DistributedMainParamsOptimizer(sharded_model, cfg, **groups)

    found = {"steps": [], "terms": sum(p.numel() for p in replicated_model.parameters())}
    for step in range(STEPS):
        for model in (replicated_model, sharded_model):
            give_grads(model, step, rank, world)
        a, b = replicated.step(lr=1e-2), sharded.step(lr=1e-2)
        found["steps"].append(
            {
                "norm": [a[0], b[0]],
                "skipped": [a[1], b[1]],
                "update_norm": [replicated.last_update_norm, sharded.last_update_norm],
                "weights_equal": same(
                    list(replicated_model.parameters()), list(sharded_model.parameters())
                ),
            }
        )

    whole, theirs = sharded.canonical_state(), replicated.canonical_state()
    found["state_equal"] = all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(whole, theirs, strict=True)
    )
    found["kinds"] = sorted(whole[0])
    found["steps_count"] = [replicated.steps, sharded.steps]
    found["state_bytes"] = [replicated.state_bytes(), sharded.state_bytes()]
    found["pieces"] = len(sharded.pieces)

    # A checkpoint of the replicated optimizer, loaded into a fresh distributed one.
    loaded_model = copy.deepcopy(replicated_model)
    loaded = DistributedMainParamsOptimizer(loaded_model, cfg, **groups)
    loaded.load_canonical_state([{k: v.clone() for k, v in s.items()} for s in theirs])
    loaded.set_steps(replicated.steps)
    for model in (replicated_model, loaded_model):
        give_grads(model, STEPS, rank, world)
    replicated.step(lr=1e-2)
    loaded.step(lr=1e-2)
    found["after_load_equal"] = same(
        list(replicated_model.parameters()), list(loaded_model.parameters())
    )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
