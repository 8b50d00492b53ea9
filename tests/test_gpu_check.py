"""ci/gpu_check.py --smoke: the GPU check's code, run on the CPU at toy sizes (its numbers mean
nothing there), so the script a GPU session depends on cannot rot unnoticed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.ci_scripts import load_script, past_the_check

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs the megatron extra"
)


@pytest.mark.slow
def test_the_smoke_run_passes_every_check_and_prints_the_table_last(tmp_path):
    out = tmp_path / "report" / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ci" / "gpu_check.py"),
            "--smoke",
            "--profile",
            "--micro-batch",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and report["correct"] and report["shape"]["batch"] == 2
    parts = {row["part"] for row in report["rows"]}
    assert parts == {"gemm", "scaling", "throughput", "goal"}
    checks = [row for row in report["rows"] if row["part"] in ("gemm", "scaling")]
    assert all(row["status"] in ("PASS", "info") for row in checks)
    per_k_block = [row for row in checks if row["check"].startswith("block, per K block: ")]
    assert len(per_k_block) == 4 and all(row["ok"] for row in per_k_block)  # oneDNN's, on a CPU
    one_call = [row for row in checks if row["check"].startswith("block, one call: ")]
    assert len(one_call) == 4  # no CPU kernel: each row says why, and fails nothing
    assert all(row["ok"] is None and "not run: " in row["result"] for row in one_call)
    assert any("inductor cast+record" in row["check"] and row["status"] == "PASS" for row in checks)
    assert any(
        "inductor cast+record+count" in row["check"] and row["status"] == "PASS" for row in checks
    )
    throughput = {row["check"]: row for row in report["rows"] if row["part"] == "throughput"}
    assert "tokens/s" in throughput["FP8 scaled_mm, Inductor casts + telemetry"]["result"]
    assert throughput["... counting, Inductor"]["values"]["ms"] > 0  # the cast timings ran
    for kind in ("bf16", "fp8"):
        assert (out.parent / f"gpu_check.profile-{kind}.txt").read_text().strip()
    assert result.stdout.rstrip().splitlines()[-1].startswith("-")  # the table closes the output


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--micro-batch", "0", "0 is not at least 1"),
        ("--steps", "-3", "-3 is not at least 1"),
        ("--telemetry-every", "ten", "'ten' is not a whole number"),
        ("--runs", "fp8,fp9", "fp9: not a configuration; use some of bf16, bf16+telemetry"),
        ("--runs", ",", "no configuration; use some of bf16"),
    ],
)
def test_a_count_that_is_not_a_positive_number_is_refused(
    tmp_path, option, value, message, monkeypatch, capsys
):
    gpu_check = load_script(ROOT / "ci" / "gpu_check.py", monkeypatch)
    # Its first work after the checks (support.ci_scripts).
    monkeypatch.setattr(gpu_check, "environment", past_the_check)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--smoke", option, value, "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and option in err and message in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_runs_times_only_the_configurations_named_and_casts_can_be_skipped(tmp_path):
    out = tmp_path / "r.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ci" / "gpu_check.py"),
            "--smoke",
            "--skip",
            "gemm",
            "--skip",
            "scaling",
            "--skip",
            "casts",
            "--runs",
            "bf16,fp8+telemetry,fp8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    timed = [row["check"] for row in report["rows"] if "tokens/s" in row["result"]]
    assert timed == [
        "BF16",
        "FP8 scaled_mm, Inductor casts",
        "FP8 scaled_mm, Inductor casts + telemetry",
    ]
    assert not [row for row in report["rows"] if "ms" in row["values"]]  # --skip casts
    goals = {row["check"] for row in report["rows"] if row["part"] == "goal"}
    assert goals == {
        "FP8 (Inductor casts) over BF16",
        "telemetry share of the FP8 (Inductor casts) step",
    }
