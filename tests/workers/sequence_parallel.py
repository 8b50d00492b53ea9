"""torchrun worker (2 ranks): the small GPT built at TP 2 with sequence parallelism.

Records the shape of the input layer 0's input norm receives in one forward (the sequence split
over TP), and which parameters fp8ops' optimizers sum over TP (``partial_over_tensor_parallel``).
Writes OUT_DIR/rank{r}.json. Usage: torchrun --standalone --nproc_per_node 2 sequence_parallel.py
OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch

from fp8ops.manifest import derive, load_manifest
from fp8ops.megatron import build_gpt
from fp8ops.train.distributed import init_distributed, shutdown_distributed
from fp8ops.train.optimizer import partial_over_tensor_parallel

TINY = Path(__file__).resolve().parents[2] / "manifests" / "tiny-gpt-cpu.yaml"
CHANGES = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.ffn_hidden_size": 256,
    "model.num_attention_heads": 4,
    "model.seq_length": 64,
    "model.qk_layernorm": True,
    "topology.tensor_parallel": 2,
    "topology.sequence_parallel": True,
}


def main(out_dir: Path) -> None:
    manifest = derive(load_manifest(TINY), CHANGES, "test: sequence parallel")
    ranks = init_distributed(manifest.topology, source="test")
    try:
        model = build_gpt(manifest, recipe=None)
        seen = {}
        norm = model.decoder.layers[0].input_layernorm

        def record_shape(module, args, output) -> None:  # None: the output stays as it is
            seen.setdefault("shape", list(args[0].shape))

        norm.register_forward_hook(record_shape)
        tokens = torch.zeros((2, 64), dtype=torch.int64)
        positions = torch.arange(64).expand(2, 64)
        logits = model(tokens, positions, None, runtime_gather_output=True)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        flags = partial_over_tensor_parallel(model)
        record = {
            "norm_input_shape": seen["shape"],
            "logits_shape": list(logits.shape),
            "summed_over_tp": sorted(n for n, f in zip(names, flags, strict=True) if f),
        }
        (out_dir / f"rank{ranks.rank}.json").write_text(json.dumps(record))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
