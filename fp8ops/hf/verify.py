"""The built-in check of an import or export: fp8ops' logits against transformers' own model.

A conversion that maps a tensor wrongly usually still loads (the shapes match); only the logits
show it. So with transformers installed (the ``hf`` extra), each import and export runs both
models on one fixed prompt, in the dtype of fp8ops' model and outside any FP8 scope, and records
the largest logit difference. In float32 the two agree to about 1e-6; in bf16 the GEMMs' rounding
differs, so the bound there is loose and the greedy (argmax) tokens must agree as well.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from fp8ops.hf.config import HfCheckpointError

PROMPT_TOKENS = 128
PROMPT_SEED = 0
# Largest logit difference accepted, relative to the largest logit (at least 1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
ARGMAX_AGREEMENT = {torch.float32: 1.0, torch.bfloat16: 0.9, torch.float16: 0.95}


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def prompt(vocab_size: int, seq_length: int, multiple: int = 1) -> torch.Tensor:
    """The fixed prompt: ``min(128, seq_length)`` token ids drawn from seed 0, cut to a multiple
    of ``multiple`` (under sequence parallelism every TP rank takes an equal part)."""
    length = min(PROMPT_TOKENS, seq_length)
    length -= length % multiple
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


@torch.no_grad()
def our_logits(model, tokens: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """fp8ops' logits for ``tokens`` (collective over ``tp_group``, and over the pipeline
    stages, the last of which computes them): vocab-parallel shards gathered, padding rows
    dropped, as float32 on the CPU."""
    # Here, not at the top: a GGUF conversion checks its prompt without Megatron installed.
    from fp8ops.megatron.pipeline import Prompts, last_stage_output
    from fp8ops.megatron.stages import pipeline_group

    device = next(model.parameters()).device
    positions = torch.arange(tokens.shape[1], device=device)[None]
    was_training = model.training
    model.eval()
    try:
        if pipeline_group() is not None:
            return last_stage_output(
                model,
                Prompts(tokens.to(device), positions),
                lambda logits: logits[..., :vocab_size].float().cpu(),
                like=torch.zeros((*tokens.shape, vocab_size)),
            )
        local = model(tokens.to(device), positions, attention_mask=None)
    finally:
        model.train(was_training)
    local = local.float().contiguous()
    if dist.get_world_size(tp_group) > 1:
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(shards, local, group=tp_group)
        local = torch.cat(shards, dim=-1)
    return local[..., :vocab_size].cpu()


@torch.no_grad()
def reference_logits(hf_dir: Path, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits for ``tokens`` from the checkpoint ``hf_dir``, on the CPU."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    return reference(tokens).logits.float()


def compare(model, hf_dir: Path, model_cfg, *, tp_group, what: str) -> dict:
    """Compare ``model`` with transformers' reading of ``hf_dir`` (collective; transformers
    runs on global rank 0). Returns the record: the largest difference, the bound, the argmax
    agreement and whether both held."""
    dtype = next(model.parameters()).dtype
    sequence_parallel = getattr(getattr(model, "config", None), "sequence_parallel", False)
    multiple = dist.get_world_size(tp_group) if sequence_parallel else 1
    tokens = prompt(model_cfg.vocab_size, model_cfg.seq_length, multiple)
    ours = our_logits(model, tokens, model_cfg.vocab_size, tp_group)
    result = [None]
    if dist.get_rank() == 0:
        theirs = reference_logits(hf_dir, tokens, dtype)
        largest = theirs.abs().max().item()
        scale = max(1.0, largest)
        difference = (ours - theirs).abs().max().item()
        agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        result[0] = {
            "what": what,
            "reference": f"transformers {_version()}",
            "dtype": str(dtype).removeprefix("torch."),
            "tokens": tokens.shape[1],
            "max_abs_logit_difference": difference,
            "max_abs_logit": largest,
            "bound": TOLERANCE[dtype] * scale,
            "argmax_agreement": agreement,
            "passed": difference <= TOLERANCE[dtype] * scale
            and agreement >= ARGMAX_AGREEMENT[dtype],
        }
    dist.broadcast_object_list(result, src=0)
    return result[0]


def require(record: dict, *, source: str) -> None:
    """``--verify``: a comparison that failed is an error."""
    if not record["passed"]:
        raise HfCheckpointError(
            f"{source}: fp8ops' logits differ from transformers' by "
            f"{record['max_abs_logit_difference']:.3g} (bound {record['bound']:.3g}; argmax "
            f"agreement {record['argmax_agreement']:.3f}) on the fixed prompt; the conversion is "
            "not exact"
        )


def _version() -> str:
    import transformers

    return transformers.__version__
