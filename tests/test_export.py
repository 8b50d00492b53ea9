"""``fp8ops checkpoints export``: a training checkpoint's weights as a weights checkpoint, the
same as ``final/`` at the last step, loaded and verified as ``model.init_checkpoint``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.weights import META_FILE
from fp8ops.train import run_training

RUN = {
    **SMALL_MODEL,
    **SCHEDULE,
    "model.init_checkpoint": None,
    "schedule.train_steps": 4,
    "schedule.checkpoint_interval": 2,
    "schedule.eval_interval": 4,
    "capability.enabled": False,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 4-step FP8 run with checkpoints at steps 2 and 4, and its final weights."""
    tmp = tmp_path_factory.mktemp("export")
    manifest = write_derived(tmp / "m.yaml", MANIFESTS / "tiny-gpt-cpu.yaml", RUN)
    run_training(manifest, tmp / "run", progress=False)
    return tmp / "run"


def weights_meta(directory: Path) -> dict:
    return json.loads((directory / META_FILE).read_text())


def test_the_last_checkpoint_exports_the_final_weights_and_an_earlier_one_its_own(
    run, cli, tmp_path
):
    latest = cli("checkpoints", "export", run, "--out", tmp_path / "last")
    assert latest.code == 0, latest.err
    final, last = weights_meta(run / "final"), weights_meta(tmp_path / "last")
    assert {k: v for k, v in last.items() if k != "exported_from"} == final
    assert last["exported_from"] == str(run / "checkpoints" / "step_00000004")

    earlier = cli("checkpoints", "export", run, "--checkpoint", "2", "--out", tmp_path / "two")
    assert earlier.code == 0, earlier.err
    two = weights_meta(tmp_path / "two")
    saved = read_meta(run / "checkpoints" / "step_00000002")
    assert two["fingerprint"] == saved.weights_fingerprint != final["fingerprint"]
    assert two["steps"] == 2 and two["manifest"] == saved.manifest
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert two["last_loss"] == losses[1]["loss"]
    assert f"fingerprint {two['fingerprint'][:12]}; give it as model.init_checkpoint" in earlier.out


@pytest.mark.slow
def test_a_new_run_starts_from_exported_weights_and_verifies_them(run, cli, tmp_path):
    assert cli("checkpoints", "export", run, "--checkpoint", "2", "--out", tmp_path / "w").code == 0
    manifest = write_derived(
        tmp_path / "next.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **RUN,
            "model.init_checkpoint": str(tmp_path / "w"),
            "schedule.train_steps": 1,
        },
    )
    run_training(manifest, tmp_path / "next", progress=False)
    model = json.loads((tmp_path / "next" / "run.json").read_text())["model"]
    assert model["init_verified"] is True
    assert model["init_fingerprint"] == weights_meta(tmp_path / "w")["fingerprint"]


def test_bad_requests_are_refused_by_name_and_write_nothing(run, cli, tmp_path):
    (tmp_path / "taken").mkdir()
    taken = cli("checkpoints", "export", run, "--out", tmp_path / "taken")
    assert taken.code == 2 and "already exists; fp8ops never writes over files" in taken.err
    missing = cli("checkpoints", "export", run, "--checkpoint", "3", "--out", tmp_path / "x")
    assert missing.code == 2
    assert "no such checkpoint (this run has: step_00000002, step_00000004)" in missing.err
    none = cli("checkpoints", "export", tmp_path, "--out", tmp_path / "x")
    assert none.code == 2 and f"{tmp_path}: no checkpoints to export" in none.err
    assert not (tmp_path / "x").exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file(run, cli, tmp_path):
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    shard = next(p for p in (copy / "checkpoints" / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = cli("checkpoints", "export", copy, "--checkpoint", "2", "--out", tmp_path / "w")
    assert damaged.code == 2 and shard.name in damaged.err, damaged.err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_in_one_process(tmp_path):
    """Saved at TP 2 by two processes, read at TP 1 by one: the same weights (the export checks
    them against the fingerprint the TP-2 checkpoint was saved with)."""
    tp2 = {**RUN, "topology.tensor_parallel": 2, "schedule.train_steps": 2}
    manifest = write_derived(tmp_path / "tp2.yaml", MANIFESTS / "tiny-gpt-cpu.yaml", tp2)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "fp8ops",
        "train",
        str(manifest),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    export = [
        sys.executable,
        "-m",
        "fp8ops",
        "checkpoints",
        "export",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "w"),
    ]
    done = subprocess.run(export, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    exported, final = weights_meta(tmp_path / "w"), weights_meta(tmp_path / "run" / "final")
    assert exported["fingerprint"] == final["fingerprint"]


@pytest.mark.slow
def test_a_scaled_mm_checkpoint_exports_where_scaled_mm_cannot_run(cli, tmp_path, monkeypatch):
    """Export multiplies nothing in FP8: a checkpoint trained on scaled_mm exports on a machine
    whose GEMMs the device check would refuse."""
    from fp8ops.megatron import model

    native = {**RUN, "schedule.train_steps": 2, "precision.backend": "scaled_mm"}
    manifest = write_derived(tmp_path / "m.yaml", MANIFESTS / "tiny-gpt-cpu.yaml", native)
    run_training(manifest, tmp_path / "run", progress=False)
    monkeypatch.setattr(model, "scaled_mm_unsupported", lambda device: "no FP8 GEMM here")
    exported = cli("checkpoints", "export", tmp_path / "run", "--out", tmp_path / "out")
    assert exported.code == 0, exported.err
    assert weights_meta(tmp_path / "out") == {
        **weights_meta(tmp_path / "run" / "final"),
        "exported_from": str(tmp_path / "run" / "checkpoints" / "step_00000002"),
    }
