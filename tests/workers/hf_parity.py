"""torchrun worker: each Hugging Face checkpoint given, imported at TP = the number of
processes in float32, and its logits compared with transformers' on a 256-token prompt.

Writes OUT_DIR/tp{N}.json (rank 0): per checkpoint, the largest logit difference; and two
negative controls that must fail the comparison: at TP 2, ``linear_fc1`` loaded as a plain
chunk of the fused [gate; up] tensor; at any TP, Megatron-Core's own llama3 scaling (factor
only) in place of fp8ops' frequencies.

Usage: python -m torch.distributed.run --standalone --nproc_per_node N hf_parity.py OUT_DIR HF_DIR...
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.hf.load import load_hf_weights
from fp8ops.hf.manifest import manifest_from_hf
from fp8ops.hf.verify import our_logits
from fp8ops.megatron import build_gpt
from fp8ops.megatron.compat import parallel_state

SEQ = 256


def logits_difference(model, hf_dir: Path, model_cfg, tp_group) -> float:
    tokens = torch.randint(
        0, model_cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7)
    )
    ours = our_logits(model, tokens, model_cfg.vocab_size, tp_group)
    if dist.get_rank() != 0:
        return 0.0
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)(
            tokens
        ).logits
    return (ours - theirs).abs().max().item()


def main(out: Path, hf_dirs: list[Path]) -> None:
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    result = {}
    for hf_dir in hf_dirs:
        manifest = manifest_from_hf(hf_dir, seq_length=SEQ, tensor_parallel=tp)
        wide = manifest.precision.model_copy(update={"base_dtype": "fp32"})
        manifest = manifest.model_copy(update={"precision": wide})
        model = build_gpt(manifest, None)
        load_hf_weights(model, hf_dir, manifest.model, tp_group=tp_group, field="test")
        result[hf_dir.name] = logits_difference(model, hf_dir, manifest.model, tp_group)

        if tp == 2 and hf_dir.name == "llama-untied":  # the plain chunk of fc1
            layer = model.decoder.layers[0].mlp.linear_fc1
            full = [torch.empty_like(layer.weight) for _ in range(tp)]
            dist.all_gather(full, layer.weight.detach().contiguous(), group=tp_group)
            gate_up = torch.cat([s.chunk(2)[0] for s in full] + [s.chunk(2)[1] for s in full])
            with torch.no_grad():
                layer.weight.copy_(gate_up.chunk(tp)[dist.get_rank()])
            result["control: plain fc1 chunk"] = logits_difference(
                model, hf_dir, manifest.model, tp_group
            )
        if manifest.model.rope_scaling is not None and hf_dir.name == "llama-tied":
            rotary = model.rotary_pos_emb
            head_dim = rotary.inv_freq.numel() * 2
            plain = 1.0 / (
                manifest.model.rotary_base
                ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            )
            rotary.inv_freq = rotary._apply_scaling(
                plain, factor=manifest.model.rope_scaling.factor
            )
            type(rotary).forward.cache_clear()
            result["control: Megatron's llama3 scaling"] = logits_difference(
                model, hf_dir, manifest.model, tp_group
            )
    if dist.get_rank() == 0:
        (out / f"tp{tp}.json").write_text(json.dumps(result, indent=2))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
