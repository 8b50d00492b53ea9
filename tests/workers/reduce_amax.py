"""torchrun worker: two FP8 linears trained for a few steps with rank-dependent inputs.

Writes each rank's final scales and histories to OUT_DIR/rank{r}.json.
Usage: torchrun --standalone --nproc_per_node 2 reduce_amax.py OUT_DIR {reduce|local}
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.precision import DelayedScalingRecipe, Fp8Linear, Fp8Scope


def main(out_dir: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recipe = DelayedScalingRecipe(amax_history_len=4, reduce_amax=(mode == "reduce"))
    torch.manual_seed(0)  # same weights on every rank
    first, second = Fp8Linear(16, 16, recipe), Fp8Linear(16, 8, recipe)
    scope = Fp8Scope(recipe, group=dist.group.WORLD)
    torch.manual_seed(100 + rank)  # different data per rank
    for step in range(3):
        x = torch.randn(4, 16) * (rank + 1) * (step + 1)
        with scope():
            out = second(first(x))
        (out.square().sum() * (rank + 1)).backward()
    state = {
        name: {k: v.tolist() for k, v in layer.fp8_meta.state_dict().items()}
        for name, layer in (("first", first), ("second", second))
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(state))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
