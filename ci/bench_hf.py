"""Benchmark (not a test): Hugging Face import and export of a 0.5 B model, time and peak RSS.

    .venv/bin/python ci/bench_hf.py [--tp 1 2] [--layers 24] [--json PATH] [--keep DIR]

In a temporary directory:

1. A randomly initialised Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads over 2
   key/value groups, MLP 4864, vocabulary 151,936, tied embeddings: 494 M parameters) saved by
   transformers in bf16 as sharded safetensors (about 1 GB), with a small tokenizer.
2. **Import** at each TP: ``torchrun --nproc-per-node TP`` of this script's worker, which
   builds the bf16 model from ``fp8ops manifest from-hf``'s manifest and reads the checkpoint
   into it (``fp8ops.hf.load.load_hf_weights``, the fingerprint included): seconds, and each
   rank's peak RSS beside the bytes of its model shard and of the largest source tensor.
3. **Export** at each TP: one bf16 step trained at that TP (``fp8ops train``, FP8 off: it only
   makes the checkpoint), then ``fp8ops checkpoints export --format hf`` of it in its own
   process: seconds and peak RSS, and the comparison with transformers it runs.

Prints a table; ``--json`` writes the numbers as well.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
MIB = 1024**2


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def make_model(directory: Path, layers: int) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from support.hf_models import make_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=layers, **SHAPE, dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="500MB")
    make_tokenizer(directory)
    return sum(p.numel() for p in model.parameters())


def worker(hf_dir: Path, out: Path) -> None:
    """Under torchrun: import ``hf_dir`` at TP = world size; rank r writes out/rank{r}.json."""
    import torch.distributed as dist

    from fp8ops.hf.load import load_hf_weights
    from fp8ops.hf.manifest import manifest_from_hf
    from fp8ops.megatron import build_gpt
    from fp8ops.megatron.compat import parallel_state

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    manifest = manifest_from_hf(hf_dir, seq_length=128, tensor_parallel=tp)
    model = build_gpt(manifest, None)
    built_rss = peak_rss_mib()
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    started = time.perf_counter()
    meta = load_hf_weights(
        model,
        hf_dir,
        manifest.model,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        field="bench",
    )
    seconds = time.perf_counter() - started
    (out / f"rank{dist.get_rank()}.json").write_text(
        json.dumps(
            {
                "import_s": seconds,
                "peak_rss_mib": peak_rss_mib(),
                "rss_after_build_mib": built_rss,
                "shard_mib": shard_bytes / MIB,
                "fingerprint": meta["fingerprint"],
            }
        )
    )
    dist.destroy_process_group()


def run(command: list, **kwargs) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, command))} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return time.perf_counter() - started


def measured_export(run_dir: Path, out: Path) -> dict:
    """``fp8ops checkpoints export --format hf`` in a process of its own, its peak RSS read by
    a small parent (RUSAGE_CHILDREN of a process that ran nothing else)."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:]); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); "
        "sys.exit(r.returncode)"
    )
    command = [sys.executable, "-c", probe, str(REPO / ".venv/bin/fp8ops"), "checkpoints", "export"]
    done = subprocess.run(
        [*command, str(run_dir), "--format", "hf", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"export failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    seconds, rss = map(float, done.stdout.strip().splitlines()[-1].split())
    summary = json.loads((out / "fp8ops_export.json").read_text())
    return {"export_s": seconds, "peak_rss_mib": rss, "verification": summary.get("verification")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="Work in this directory and keep it.")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.layers < 1 or any(tp < 1 for tp in args.tp):
        parser.error("--layers and --tp must be at least 1")

    from rich.console import Console
    from rich.table import Table

    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = root / "qwen2.5-0.5b-random"
    started = time.perf_counter()
    parameters = make_model(hf_dir, args.layers)
    made_s = time.perf_counter() - started
    files_mib = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors")) / MIB
    largest_mib = SHAPE["vocab_size"] * SHAPE["hidden_size"] * 2 / MIB
    manifest = root / "m.yaml"
    fp8ops = str(REPO / ".venv/bin/fp8ops")
    run([fp8ops, "manifest", "from-hf", str(hf_dir), "--out", str(manifest), "--seq-length", "128"])

    results = {"parameters": parameters, "files_mib": files_mib, "largest_tensor_mib": largest_mib}
    for tp in args.tp:
        out = root / f"import-tp{tp}"
        out.mkdir()
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tp}",
        ]
        wall = run([*torchrun, __file__, "--worker", str(hf_dir), str(out)])
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]
        launcher = torchrun if tp > 1 else [sys.executable]
        train = [
            *launcher,
            *("-m", "fp8ops", "train", str(manifest), "--run-dir", str(root / f"run-tp{tp}")),
            "--no-progress",
            *("--set", f"topology.tensor_parallel={tp}", "--set", "precision.enabled=false"),
            *("--set", "schedule.train_steps=1", "--set", "schedule.warmup_steps=0"),
            *("--set", "schedule.global_batch_size=1", "--set", "capability.enabled=false"),
            *("--set", "schedule.eval_iters=1"),
        ]
        train_s = run(train, cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)})
        export = measured_export(root / f"run-tp{tp}", root / f"export-tp{tp}")
        results[f"tp{tp}"] = {"import_wall_s": wall, "ranks": ranks, "train_s": train_s, **export}

    table = Table(
        title=f"Hugging Face import and export, {parameters / 1e6:.0f} M parameters in bf16"
    )
    for column in (
        "TP",
        "import s",
        "rank peak RSS MiB",
        "rank shard MiB",
        "export s",
        "export peak RSS MiB",
        "export vs transformers",
    ):
        table.add_column(column, justify="right")
    for tp in args.tp:
        r = results[f"tp{tp}"]
        check = r["verification"]
        table.add_row(
            str(tp),
            " / ".join(f"{rank['import_s']:.1f}" for rank in r["ranks"]),
            " / ".join(f"{rank['peak_rss_mib']:.0f}" for rank in r["ranks"]),
            " / ".join(f"{rank['shard_mib']:.0f}" for rank in r["ranks"]),
            f"{r['export_s']:.1f}",
            f"{r['peak_rss_mib']:.0f}",
            "-" if check is None else f"{check['max_abs_logit_difference']:.1e}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"model made and saved in {made_s:.0f} s: {files_mib:.0f} MiB of safetensors, largest tensor "
        f"{largest_mib:.0f} MiB; import s includes hashing the files (the fingerprint)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
