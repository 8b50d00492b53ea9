"""torchrun worker: the auto-degrade policy's run on two ranks with the injected saturation on one
rank's TARGET only (tests/test_auto_degrade.py): at TP 2 one weight shard; at PP 2 the last
stage's, the only one that holds TARGET.

Writes OUT_DIR/rank{r}.json: per step, whether TARGET ran FP8 on this rank (nothing on a stage
without it), and how the run ended.
Usage: torchrun --standalone --nproc_per_node 2 auto_degrade.py MANIFEST RUN_DIR OUT_DIR RANK
(RANK: the rank whose shard is inflated).
"""

import json
import sys
from pathlib import Path

import torch

import fp8ops.megatron  # noqa: F401  (before Megatron-Core: TE's meta-package otherwise)
from fp8ops.manifest import load_manifest
from fp8ops.megatron import fp8_modules
from fp8ops.start import New
from fp8ops.train import open_trainer
from fp8ops.train.distributed import init_distributed, shutdown_distributed
from fp8ops.train.ending import StopRun

TARGET = "decoder.layers.1.mlp.linear_fc1"


def growth(step: int) -> float:
    """As tests/test_auto_degrade.py's: 1.3x a step from step 2 to 5, then 4x a step."""
    factor = 1.0
    for k in range(2, step + 1):
        factor *= 1.3 if k <= 5 else 4.0
    return factor


def main(manifest_path: Path, run_dir: Path, out_dir: Path, inflated: int) -> None:
    manifest = load_manifest(manifest_path)
    ranks = init_distributed(manifest.topology, source=str(manifest_path))
    trainer = open_trainer(New(manifest, [manifest], run_dir, "test"), ranks, progress=False)
    module = fp8_modules(trainer.model).get(TARGET)  # named by its global layer
    calls, fp8_by_step = {"n": 0}, {}

    def grow(mod, args):
        calls["n"] += 1
        step = (calls["n"] + 1) // 2
        if calls["n"] % 2 == 1:  # the step's first micro-batch, when the weight is cast
            fp8_by_step[step] = bool(mod.fp8_enabled)
            if mod.fp8_enabled and ranks.rank == inflated:
                with torch.no_grad():
                    mod.weight.mul_(growth(step))

    if module is not None:
        module.register_forward_pre_hook(grow)
    try:
        trainer.train()
        ended = "finished"
    except StopRun:
        ended = "stopped"
    finally:
        shutdown_distributed()
    record = {"ended": ended, "fp8_by_step": fp8_by_step}
    (out_dir / f"rank{ranks.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
