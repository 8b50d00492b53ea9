"""``fp8ops checkpoints export``: one training checkpoint's weights as a weights checkpoint.

A run writes ``final/`` once, at its last step. The weights a team releases are often an
earlier step's (the best evaluation), and a paused run's weights are the start of a new run on
other data. Both need what ``final/`` is, a weights checkpoint ``model.init_checkpoint`` loads
and verifies, made from a training checkpoint: its manifest's model, built in one process,
its weights read (a checkpoint saved at any tensor-parallel size reads at 1), checked
against the fingerprint the checkpoint was saved with, and written as ``checkpoint.weights`` does.
"""

from __future__ import annotations

from pathlib import Path

from fp8ops.errors import Fp8opsError
from fp8ops.run.layout import MANIFEST


def export_weights(run_dir: Path, checkpoint: str | None, out: Path) -> dict:
    """Write the weights of ``run_dir``'s checkpoint ``checkpoint`` (a name or a step; None:
    the latest) to ``out``, which must not exist. Returns the written metadata."""
    from fp8ops.checkpoint import CheckpointDir, CheckpointError, read_meta, weights
    from fp8ops.checkpoint.directory import verify_files
    from fp8ops.manifest import load_manifest, manifest_hash
    from fp8ops.megatron import build_gpt
    from fp8ops.megatron.compat import parallel_state
    from fp8ops.precision import DelayedScalingRecipe
    from fp8ops.run import read_metrics
    from fp8ops.train.distributed import init_distributed, shutdown_distributed

    out = Path(out)
    if out.exists() or out.with_name(out.name + ".partial").exists():
        raise Fp8opsError(
            f"--out {out}: already exists; fp8ops never writes over files, so "
            "choose a new directory"
        )
    store = CheckpointDir(run_dir)
    if not store.complete():
        raise CheckpointError(f"{run_dir}: no checkpoints to export (no {store.path}/step_*)")
    source = store.find(checkpoint)
    meta = read_meta(source)
    verify_files(source, meta.files)  # every file whole, as a resume checks
    manifest = load_manifest(source / MANIFEST)
    if manifest_hash(manifest) != meta.manifest:
        raise CheckpointError(
            f"{source}/manifest.yaml is not the manifest the checkpoint names "
            f"({meta.manifest[:12]}); the checkpoint is damaged"
        )
    # One process: the weights are the same at any topology (Megatron reshards on load).
    one = manifest.topology.model_copy(update={"tensor_parallel": 1, "data_parallel": 1})
    alone = manifest.model_copy(update={"topology": one})
    precision = alone.precision
    ranks = init_distributed(one, source=f"{source / MANIFEST}")
    try:
        recipe = DelayedScalingRecipe.from_precision(precision) if precision.enabled else None
        model = build_gpt(alone, recipe, device=ranks.device)
        missing, unexpected = weights.read_weights_into(model, source)
        if missing or unexpected:
            raise CheckpointError(
                f"{source}: checkpoint and model disagree (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]})"
            )
        tp_group = parallel_state.get_tensor_model_parallel_group()
        found = weights.weights_fingerprint(model, tp_group, scheme=meta.weights_fingerprint_scheme)
        if found != meta.weights_fingerprint:
            raise CheckpointError(
                f"{source}: its weights hash to {found[:12]}, but they were "
                f"saved as {meta.weights_fingerprint[:12]}"
            )
        losses = [m.loss for m in read_metrics(run_dir) if m.step == meta.step]
        written = {
            "architecture": weights.architecture(manifest.model),
            "fingerprint": found,
            "fingerprint_scheme": meta.weights_fingerprint_scheme,
            "manifest": meta.manifest,  # what trained them
            "steps": meta.step,
            "last_loss": losses[-1] if losses else None,
            "exported_from": str(source),
        }
        weights.save_weights(model, out, written, is_main=True)
    finally:
        shutdown_distributed()
    return written
