"""The README's main job: `fp8ops demo` on the CPU default manifest."""

import subprocess
import sys
from pathlib import Path

from fp8ops.demo import SPIKE_STEP, run_demo
from fp8ops.manifest import load_manifest

TINY = Path(__file__).parents[1] / "manifests" / "tiny-gpt-cpu.yaml"


def test_demo_shows_delay_window_and_fp8_close_to_fp32():
    manifest = load_manifest(TINY)
    history_len = manifest.precision.amax_history_len
    records = run_demo(manifest, steps=SPIKE_STEP + history_len + 1)
    by_step = {r.step: r for r in records}
    before, spike = by_step[SPIKE_STEP - 1], by_step[SPIKE_STEP]
    # the spike is cast with the old scale (saturates), and lowers the scale for the next step
    assert spike.saturated > 0 and spike.input_scale < before.input_scale / 10
    # the lowered scale holds while the spike is in the window, then recovers
    assert by_step[SPIKE_STEP + history_len - 1].input_scale == spike.input_scale
    assert by_step[SPIKE_STEP + history_len].input_scale > before.input_scale / 2
    # away from the spike, FP8 tracks float32 closely and both learn
    calm = [r for r in records if r.step != SPIKE_STEP]
    assert max(abs(r.loss_fp8 - r.loss_fp32) / r.loss_fp32 for r in calm) < 0.05
    assert records[-1].loss_fp8 < records[0].loss_fp8 * 0.8


def test_demo_command_runs_end_to_end():
    done = subprocess.run(
        [sys.executable, "-m", "fp8ops", "demo", str(TINY), "--steps", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tiny-gpt-cpu" in done.stdout and "input scale" in done.stdout
    assert "largest relative loss gap" in done.stdout
