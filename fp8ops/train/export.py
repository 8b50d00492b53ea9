"""``fp8ops checkpoints export``: one training checkpoint's weights, as a weights checkpoint
or as a Hugging Face checkpoint.

A run writes ``final/`` once, at its last step. The weights a team releases are often an
earlier step's (the best evaluation), and a paused run's weights are the start of a new run on
other data. Both need the checkpoint's model rebuilt in one process from its manifest, its
weights read (a checkpoint saved at any tensor-parallel size reads at 1) and checked against
the fingerprint the checkpoint was saved with; then written as ``final/`` is (``--format
fp8ops``: what ``model.init_checkpoint`` loads) or in Hugging Face form (``--format hf``,
``fp8ops.hf.export``), compared with transformers' reading of what was written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fp8ops.errors import Fp8opsError
from fp8ops.run.layout import MANIFEST


@dataclass
class Exported:
    """A checkpoint's model, read and verified, in one process."""

    model: object
    manifest: object
    meta: object
    source: Path
    tp_group: object


def _refuse_existing(out: Path) -> None:
    if out.exists() or out.with_name(out.name + ".partial").exists():
        raise Fp8opsError(
            f"--out {out}: already exists; fp8ops never writes over files, so "
            "choose a new directory"
        )


@contextmanager
def checkpoint_model(
    run_dir: Path, checkpoint: str | None, *, float32: bool = False
) -> Iterator[Exported]:
    """``run_dir``'s checkpoint ``checkpoint`` (a name or a step; None: the latest) as a
    model at TP 1, its files and weights verified; the process group lives while it is open.
    ``float32``: the model built in float32, the weights widened exactly (``manifest`` is then
    the run's own, not the float32 one)."""
    from fp8ops.checkpoint import CheckpointDir, CheckpointError, weights
    from fp8ops.checkpoint.consistency import read_consistent
    from fp8ops.checkpoint.directory import verify_files
    from fp8ops.manifest import load_manifest, manifest_hash
    from fp8ops.megatron import build_gpt
    from fp8ops.megatron.compat import parallel_state
    from fp8ops.megatron.config import DTYPES
    from fp8ops.precision import DelayedScalingRecipe
    from fp8ops.train.distributed import init_distributed, shutdown_distributed

    store = CheckpointDir(run_dir)
    if not store.complete():
        raise CheckpointError(f"{run_dir}: no checkpoints to export (no {store.path}/step_*)")
    source = store.find(checkpoint)
    meta = read_consistent(source)  # before anything reads what it says
    verify_files(source, meta.files)  # every file whole, as a resume checks
    manifest = load_manifest(source / MANIFEST)
    if manifest_hash(manifest) != meta.manifest:
        raise CheckpointError(
            f"{source}/manifest.yaml is not the manifest the checkpoint names "
            f"({meta.manifest[:12]}); the checkpoint is damaged"
        )
    # One process: the weights are the same at any topology (Megatron reshards on load).
    one = manifest.topology.model_copy(
        update={
            "tensor_parallel": 1,
            "pipeline_parallel": 1,
            "data_parallel": 1,
            "sequence_parallel": False,
        }
    )
    alone = manifest.model_copy(update={"topology": one})
    built = alone
    if float32:
        wide = alone.precision.model_copy(update={"base_dtype": "fp32"})
        built = alone.model_copy(update={"precision": wide})
    if built.precision.backend == "scaled_mm":
        # Nothing here multiplies in FP8 (the comparison with transformers runs outside any FP8
        # scope), so the emulated GEMM's layers, the same parameters, spare a device check that
        # could refuse the export for a GEMM it never runs.
        emulated = built.precision.model_copy(update={"backend": "emulated"})
        built = built.model_copy(update={"precision": emulated})
    precision = built.precision
    ranks = init_distributed(one, source=f"{source / MANIFEST}")
    try:
        recipe = DelayedScalingRecipe.from_precision(precision) if precision.enabled else None
        model = build_gpt(built, recipe, device=ranks.device)
        missing, unexpected = weights.read_weights_into(model, source)
        if missing or unexpected:
            raise CheckpointError(
                f"{source}: checkpoint and model disagree (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]})"
            )
        tp_group = parallel_state.get_tensor_model_parallel_group()
        found = weights.weights_fingerprint(
            model,
            tp_group,
            dtype=DTYPES[alone.precision.base_dtype],  # the values as saved
            scheme=meta.weights_fingerprint_scheme,
        )
        if found != meta.weights_fingerprint:
            raise CheckpointError(
                f"{source}: its weights hash to {found[:12]}, but they were "
                f"saved as {meta.weights_fingerprint[:12]}"
            )
        yield Exported(model, alone, meta, source, tp_group)
    finally:
        shutdown_distributed()


def export_weights(run_dir: Path, checkpoint: str | None, out: Path) -> dict:
    """Write the weights of ``run_dir``'s checkpoint to ``out`` (a new directory) as an fp8ops
    weights checkpoint. Returns the written metadata."""
    from fp8ops.checkpoint import weights
    from fp8ops.run import read_metrics

    out = Path(out)
    _refuse_existing(out)
    with checkpoint_model(run_dir, checkpoint) as found:
        losses = [m.loss for m in read_metrics(run_dir) if m.step == found.meta.step]
        written = {
            "architecture": weights.architecture(found.manifest.model),
            "fingerprint": found.meta.weights_fingerprint,
            "fingerprint_scheme": found.meta.weights_fingerprint_scheme,
            "manifest": found.meta.manifest,  # what trained them
            "steps": found.meta.step,
            "last_loss": losses[-1] if losses else None,
            "exported_from": str(found.source),
        }
        weights.save_weights(found.model, out, written, is_main=True)
    return written


def export_hf(
    run_dir: Path, checkpoint: str | None, out: Path, *, verify: bool | None = None
) -> dict:
    """Write the weights of ``run_dir``'s checkpoint to ``out`` (a new directory) as a Hugging
    Face checkpoint, compared, before it is renamed into place, with transformers' reading of
    it. ``verify``: None compares where transformers is installed and records the result; True
    also makes a mismatch (or no transformers) an error, leaving nothing at ``out``; False skips
    the comparison. Returns the summary, also written beside the export (``fp8ops_export.json``)."""
    from fp8ops.checkpoint.weights import is_hf_base
    from fp8ops.hf import verify as hf_verify
    from fp8ops.hf.export import write_hf
    from fp8ops.megatron.config import DTYPES

    out = Path(out)
    _refuse_existing(out)
    if verify and not hf_verify.transformers_available():
        raise Fp8opsError(
            "--verify needs transformers to read the export back: pip install 'fp8ops[hf]'"
        )
    compare = verify is not False and hf_verify.transformers_available()
    # Read in float32 (the saved values widened exactly) and written back in the run's dtype:
    # the comparison with transformers then runs both models in float32, with a tight bound.
    with checkpoint_model(run_dir, checkpoint, float32=True) as found:
        model_cfg, tokenizer = found.manifest.model, found.manifest.tokenizer
        base = model_cfg.init_checkpoint
        source = Path(base) if base is not None and is_hf_base(Path(base)) else None
        tokenizer_dir = None
        if tokenizer.kind == "huggingface":
            path = Path(tokenizer.path)
            tokenizer_dir = path if path.is_dir() else path.parent

        def check(written: Path) -> dict:
            record = {"exported_from": str(found.source), "steps": found.meta.step}
            if compare:
                record["verification"] = hf_verify.compare(
                    found.model, written, model_cfg, tp_group=found.tp_group, what="export"
                )
                if verify:
                    hf_verify.require(record["verification"], source=str(out))
            return record

        return write_hf(
            found.model,
            model_cfg,
            out,
            dtype=DTYPES[found.manifest.precision.base_dtype],
            source=source,
            tokenizer_dir=tokenizer_dir,
            check=check,
        )
