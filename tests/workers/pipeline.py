"""torchrun worker (ci/bench_pipeline.py's): the small GPT trained a few FP8 steps at TP ``TP`` (default 1) with
``pipeline_parallel`` = the processes / TP, each step through Megatron's pipeline schedule
(``fp8ops.megatron.pipeline``).

Every rank draws the same batches (two micro-batches per step). The model is built by
``build_gpt`` in float32 under delayed scaling (emulated FP8), per-layer admission applied, and
stepped by ``MainParamsOptimizer`` with the global norm over the stages. Writes
OUT_DIR/rank{r}.json: per step the loss, gradient norm (every stage reports them) and seconds, then this
stage's modules by global name with a sha256 of their FP8 state, its parameter names, and
whether its amax group's ranks agree on their FP8 state.

Usage: python -m torch.distributed.run --standalone --nproc_per_node N pipeline.py OUT_DIR [TP]
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.admission import apply_admission, decide_admission
from fp8ops.checkpoint.state import fp8_digest, fp8_states_agree
from fp8ops.data.batches import MicroBatch
from fp8ops.manifest import derive, load_manifest
from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_modules, mark_first_microbatch
from fp8ops.megatron.compat import parallel_state
from fp8ops.megatron.pipeline import forward_backward
from fp8ops.precision import Fp8Scope, recipe_from_precision
from fp8ops.train.distributed import init_distributed, shutdown_distributed
from fp8ops.train.optimizer import MainParamsOptimizer

TINY = Path(__file__).resolve().parents[2] / "manifests" / "tiny-gpt-cpu.yaml"
STEPS, MICRO_BATCHES, B, S = 4, 2, 2, 64


def batches(step: int) -> list[MicroBatch]:
    generator = torch.Generator().manual_seed(step)
    out = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, 256, (B, S + 1), generator=generator)
        mask = (torch.rand(B, S, generator=generator) > 0.3).float()
        positions = torch.arange(S).expand(B, S)
        out.append(MicroBatch(tokens[:, :-1], tokens[:, 1:], mask, positions, torch.arange(B)))
    return out


def main(out_dir: Path, tensor_parallel: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    changes = {
        "model.num_layers": 4,
        "model.hidden_size": 64,
        "model.ffn_hidden_size": 256,
        "model.num_attention_heads": 4,
        "model.seq_length": S,
        "model.init_checkpoint": None,  # from scratch: every stage draws its weights by name
        "precision.base_dtype": "fp32",
        "topology.tensor_parallel": tensor_parallel,
        "topology.pipeline_parallel": world // tensor_parallel,
        "optimizer.clip_grad": 1.0,
        "capability.enabled": False,  # not under pipelining
    }
    manifest = derive(load_manifest(TINY), changes, "test: pipeline")
    ranks = init_distributed(manifest.topology, source="test")
    try:
        recipe = recipe_from_precision(manifest.precision)
        model = build_gpt(manifest, recipe)
        admission = decide_admission(model, manifest.precision, tensor_parallel=tensor_parallel)
        apply_admission(admission, model)
        group = amax_reduction_group(manifest.topology)
        scope = Fp8Scope(recipe, group=group)
        optimizer = MainParamsOptimizer(
            model,
            manifest.optimizer,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_group=parallel_state.get_data_parallel_group(),
            pp_group=parallel_state.get_pipeline_model_parallel_group(),
        )
        steps = []
        for step in range(STEPS):
            micro = batches(step)
            loss_tokens = sum(mb.loss_mask.sum() for mb in micro).double()
            started = time.perf_counter()
            mark_first_microbatch(model)
            loss = forward_backward(model, micro, loss_tokens=loss_tokens, fp8=scope)
            norm, skipped = optimizer.step(lr=3e-3)
            seconds = time.perf_counter() - started
            steps.append(
                {"loss": loss.item(), "grad_norm": norm, "skipped": skipped, "seconds": seconds}
            )
        modules = fp8_modules(model)
        record = {
            "steps": steps,
            "fp8": {name: fp8_digest(module) for name, module in modules.items()},
            "parameters": [n for n, _ in model.named_parameters()],
            "agree": fp8_states_agree(modules, group).agree,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
        }
        (out_dir / f"rank{ranks.rank}.json").write_text(json.dumps(record))
        dist.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
