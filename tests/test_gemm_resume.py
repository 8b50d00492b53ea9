"""Per-GEMM precision across a resume, end to end on the small model: an override of wgrad alone,
staged and approved in the ledger, applied by the resume as a ``precision.overrides`` entry with
its ``gemms``; what the run records of it; a stop and resume after it equal to the straight run
bit for bit; and a per-GEMM change written into the manifest at resume refused as drift."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.small_model import write_small_finetune

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.manifest import load_manifest
from fp8ops.overrides import Ledger
from fp8ops.run import read_fallbacks, read_metrics
from fp8ops.run.records import read_layers_json
from fp8ops.telemetry import open_run
from fp8ops.train import run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

N = 3
FC1 = "decoder.layers.1.mlp.linear_fc1"


@pytest.mark.slow  # three trainings of the small model
def test_a_wgrad_override_applies_at_resume_and_a_stop_after_it_resumes_as_straight(
    small_base, tmp_path, cli
):
    manifest = write_small_finetune(
        tmp_path / "m.yaml",
        small_base,
        {
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": 2 * N,
            "data.num_examples": 400,
            "telemetry.every_steps": 1,
        },
    )
    run = tmp_path / "run"
    run_training(manifest, run, progress=False, stop_at=N)
    ledger = Ledger(run)
    staged = ledger.stage(FC1, "weight gradient underflows", who="ana", gemms=["wgrad"])
    approval = ledger.approve(staged.id, who="ben").approval
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)

    # Straight on from the approval: the resume applies it and trains to the end.
    result = cli("resume", run, "--no-progress")
    assert result.code == 0, result.err
    locked = load_manifest(run / "manifest.yaml")
    (entry,) = locked.precision.overrides
    assert (entry.module, entry.gemms, entry.approval) == (FC1, ("wgrad",), approval)
    assert f"{FC1} to bf16 (wgrad) ({staged.id[:12]})" in locked.revision.reason
    row = read_layers_json(run).table.row(FC1)
    assert (row.precision, row.fp8_gemms, row.gemms.wgrad.reason.code) == (
        "fp8",
        ("fprop", "dgrad"),
        "override",
    )
    assert read_fallbacks(run)[FC1].gemms == ["wgrad"]
    assert read_fallbacks(run)[FC1].from_step == N + 1
    (applied,) = [r for r in Ledger(run).records() if r["kind"] == "applied"]
    assert applied["step"] == N + 1  # the first step the resume runs
    # Telemetry: one GEMM a micro-batch in bf16 from the resume on, none before; the input,
    # weight and gradient are all still cast (fprop and dgrad read them), so measured.
    history = open_run(run).module_history(FC1)
    fallback, fp8 = history["fallback_gemms"].to_numpy(), history["fp8_gemms"].to_numpy()
    micro_batches = fp8[0] / 3
    assert micro_batches >= 1 and (fallback[:N] == 0).all()
    assert (fallback[N:] == micro_batches).all() and (fp8[N:] == 2 * micro_batches).all()
    assert np.isfinite(history["grad_output.scale"].to_numpy()).all()

    # The same, stopped one step after the override took effect and resumed.
    paused = cli("resume", copy, "--stop-at", N + 1, "--no-progress")
    assert paused.code == 0, paused.err
    assert json.loads((copy / "status.json").read_text())["state"] == "paused"
    # A per-GEMM change written into the manifest now is drift, as any precision change.
    hand = f"precision.overrides=[{{module: {FC1}, reason: r, gemms: [dgrad, wgrad]}}]"
    drift = cli("resume", copy, "--set", hand, "--no-progress")
    assert drift.code == 4 and "precision.overrides" in drift.err, drift.err
    finished = cli("resume", copy, "--no-progress")
    assert finished.code == 0, finished.err
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert [m.loss for m in read_metrics(copy)] == [m.loss for m in read_metrics(run)]
    final, straight = (r / "checkpoints" / checkpoint_name(2 * N) for r in (copy, run))
    assert read_meta(final).weights_fingerprint == read_meta(straight).weights_fingerprint
    assert read_layers_json(copy).table_hash == read_layers_json(run).table_hash
