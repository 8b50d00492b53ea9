"""torchrun worker: the tiny GPT from manifests/tiny-gpt-cpu.yaml trained a few FP8 steps at
TP = the number of processes (1 or 2), over gloo, in the manifest's bf16 and in fp32.

Each step has two micro-batches (the manifest's 8 = 2 x 4), the FP8 weight cast once per step.
Every rank sees the same batches. Writes OUT_DIR/rank{r}.json with, per dtype: the step losses,
the scales after every step, the final FP8 state of every module, the first step's gradient of
layer 0's input norm, and the local shapes of layer 0's attention weights.

Usage: python -m torch.distributed.run --standalone --nproc_per_node {1|2} megatron_tp.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.manifest import derive, load_manifest
from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_modules, mark_first_microbatch
from fp8ops.megatron.compat import parallel_state
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope

TINY = Path(__file__).resolve().parents[2] / "manifests" / "tiny-gpt-cpu.yaml"
STEPS = 4
SMALL = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.ffn_hidden_size": 256,
    "model.seq_length": 64,
    "model.init_checkpoint": None,
    "schedule.micro_batch_size": 4,
    "schedule.global_batch_size": 8,
    "optimizer.lr": 1e-3,
}


def batches(manifest, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The step's micro-batches: (tokens, position ids, labels), [b, s] each."""
    schedule, model_cfg = manifest.schedule, manifest.model
    b, s = schedule.micro_batch_size, model_cfg.seq_length
    generator = torch.Generator().manual_seed(manifest.seeds.data * 1000 + step)
    micro = []
    for _ in range(schedule.global_batch_size // b):
        tokens = torch.randint(0, model_cfg.vocab_size, (b, s + 1), generator=generator)
        micro.append((tokens[:, :-1], torch.arange(s).expand(b, s), tokens[:, 1:]))
    return micro


def fp8_state(model) -> dict[str, dict[str, list]]:
    return {
        name: {key: value.tolist() for key, value in module.fp8_meta.state_dict().items()}
        for name, module in fp8_modules(model).items()
    }


def train(manifest) -> dict:
    """STEPS optimizer steps of the manifest's model under its recipe; what the test compares."""
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    model = build_gpt(manifest, recipe)
    scope = Fp8Scope(recipe, group=amax_reduction_group(manifest.topology))
    optimizer = torch.optim.AdamW(model.parameters(), lr=manifest.optimizer.lr)
    layer0 = model.decoder.layers[0]
    record = {"losses": [], "scales": []}
    for step in range(STEPS):
        micro_batches = batches(manifest, step)
        mark_first_microbatch(model)
        step_loss = 0.0
        for tokens, positions, labels in micro_batches:
            with scope():
                per_token = model(tokens, positions, None, labels=labels)  # [b, s] float32
            loss = per_token.mean() / len(micro_batches)
            loss.backward()
            step_loss += loss.item()
        if step == 0:
            # Reaches the norm only through linear_qkv's input gradient: at TP=2 it is complete
            # only if copy_to_tensor_model_parallel_region all-reduced it.
            record["norm_grad"] = layer0.input_layernorm.weight.grad.float().tolist()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["losses"].append(step_loss)
        record["scales"].append(
            {name: s["scale_fwd"] + s["scale_bwd"] for name, s in fp8_state(model).items()}
        )
    record["fp8"] = fp8_state(model)
    record["shapes"] = {
        "linear_qkv": list(layer0.self_attention.linear_qkv.weight.shape),
        "linear_proj": list(layer0.self_attention.linear_proj.weight.shape),
    }
    return record


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    # The tolerances in test_megatron_tp.py were measured on this size (the first tiny default).
    tiny = derive(load_manifest(TINY), SMALL, "the layer-equivalence model")  # TP=1, bf16
    if world > 1:
        tiny = derive(tiny, {"topology.tensor_parallel": world}, f"TP={world} test")
    # fp32 as well: without bf16 rounding of partial sums, TP=2 should reproduce TP=1 closely.
    fp32 = derive(tiny, {"precision.base_dtype": "fp32"}, "fp32 comparison")
    result = {"bf16": train(tiny), "fp32": train(fp32)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
