"""A short human summary of a manifest: what `fp8ops manifest validate` prints."""

from __future__ import annotations

from fp8ops.manifest.canonical import manifest_hash
from fp8ops.manifest.schema import Manifest

# What each precision.backend runs, in the words of the summary.
_BACKENDS = {
    "emulated": "emulated (FP8 values multiplied in float32; any device)",
    "scaled_mm": "scaled_mm (torch._scaled_mm: FP8 tensor cores on sm_89+ GPUs, oneDNN on CPUs)",
    "te": "te (Transformer Engine's layer spec and fp8_autocast; GPU with TE only)",
}


def summary_rows(m: Manifest) -> list[tuple[str, str]]:
    """``(label, text)`` rows: identity first, then the precision policy, model and layout."""
    p, model, topo = m.precision, m.model, m.topology
    revision = "0 (root)"
    if m.revision.parent is not None:
        revision = f"{m.revision.number} (parent {m.revision.parent[:12]}: {m.revision.reason})"
    small = p.small_gemm
    small_rule = (
        f"keep K or N < {small.min_dim}, or < {small.min_flops_per_token:,} FLOPs/token, "
        f"in {p.base_dtype}"
        if small.enabled
        else "off (every included module runs FP8)"
    )
    reduction = (
        f"all-reduce over {topo.amax_reduction}" if p.reduce_amax else "off (per-rank scales)"
    )
    return [
        ("name", m.name),
        ("revision", revision),
        ("sha256", manifest_hash(m)),
        (
            "precision",
            (
                f"{p.fp8_format} FP8, {p.scaling} scaling, history {p.amax_history_len} "
                f"({p.amax_compute_algo}), margin {p.margin}, base {p.base_dtype}"
            )
            if p.enabled
            else f"FP8 off: everything in {p.base_dtype} (a control or base run)",
        ),
        ("FP8 GEMM", _BACKENDS[p.backend] if p.enabled else "none (FP8 off)"),
        ("amax reduction", reduction),
        ("FP8 modules", ", ".join(p.include_modules)),
        ("excluded", ", ".join(p.exclude_modules) or "none"),
        ("small GEMMs", small_rule),
        (
            "model",
            (
                f"{model.arch}: {model.num_layers} layers, hidden {model.hidden_size}, "
                f"ffn {model.ffn_hidden_size}, {model.num_attention_heads} heads, "
                f"seq {model.seq_length}"
            ),
        ),
        ("tokenizer", _tokenizer(m)),
        ("data", _data(m)),
        (
            "topology",
            (
                f"TP {topo.tensor_parallel} x PP {topo.pipeline_parallel} "
                f"x DP {topo.data_parallel} = {topo.world_size} ranks"
            ),
        ),
    ]


def _tokenizer(m: Manifest) -> str:
    t = m.tokenizer
    if t.kind == "byte":
        return "byte (UTF-8 bytes, ids 0-255)"
    eod = f"eod_token {t.eod_token!r}" if t.eod_token else "eod from tokenizer_config.json"
    return f"{t.kind}: {t.path} ({eod})"


def _data(m: Manifest) -> str:
    d = m.data
    source = {
        "corpus": "built-in corpus (Python's docstrings)",
        "tasks": f"built-in tasks, {d.num_examples:,} examples",
        "jsonl": f"jsonl: {d.path}",
    }[d.kind]
    padding = "; batches padded to their longest row" if d.pad_to == "longest" else ""
    return f"{source}; eval_fraction {d.eval_fraction:g}, split version {d.split_version}{padding}"
