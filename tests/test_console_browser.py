"""The console end to end in a browser: ``fp8ops console`` serves it with Voila, Playwright drives
Debian's Chromium (no browser download: ``ci/setup.sh`` installs the package with apt).

On a real run produced by the trainer: the page renders; picking a module redraws its history
with that module's data; an operator stages it in BF16 and another approves; the ledger on disk
then holds both records; a window what-if comes back from the kernel's worker thread. A screenshot of the page is kept in ``test-artifacts/`` (or
``$FP8OPS_TEST_ARTIFACTS``), and the test prints its path.

Skips, saying why, where Chromium, Playwright or Voila is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("FP8OPS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(
        "no Chromium (Debian: apt-get install chromium; ci/setup.sh does it as root)",
        allow_module_level=True,
    )
for _package in ("playwright", "voila", "megatron"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(
            f"needs {_package}: pip install -e '.[console,megatron]'", allow_module_level=True
        )

from playwright.sync_api import expect, sync_playwright
from support.console_run import STEPS, make_trained_run

from fp8ops.files import read_jsonl
from fp8ops.telemetry import open_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("FP8OPS_TEST_ARTIFACTS", ROOT / "test-artifacts"))
CHROME_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]
URL = re.compile(r"fp8ops console: (http://127\.0\.0\.1:\d+/\?token=\S+)")


@pytest.fixture
def served(small_base, tmp_path):
    """A trained run, and ``fp8ops console RUNS --user ana`` serving it: (run, url)."""
    _, run = make_trained_run(tmp_path, small_base)
    jupyter = tmp_path / "jupyter"  # Jupyter's own files kept apart (kernels come from the venv)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        JUPYTER_CONFIG_DIR=str(jupyter / "config"),
        JUPYTER_DATA_DIR=str(jupyter / "data"),
        JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"),
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "fp8ops", "console", str(run.parent), "--user", "ana"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = server.stdout.readline()  # the command prints the URL once Voila listens
        found = URL.search(line)
        assert found, line + server.stdout.read() if server.poll() is not None else line
        yield run, found.group(1)
    finally:
        server.terminate()  # by its pid; it stops Voila and Voila its kernels
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


def wait_for_records(path: Path, count: int, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = list(read_jsonl(path)) if path.exists() else []
        if len(records) >= count:
            return records
        time.sleep(0.1)
    raise AssertionError(f"{path} has {len(records)} records, not {count}")


def test_pick_a_module_stage_and_approve_in_the_browser(served, tmp_path):
    run, url = served
    store = open_run(run)
    module = store.modules[3]
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROME_ARGS,
            viewport={"width": 1400, "height": 3800},
        )
        page = browser.pages[0] if browser.pages else browser.new_page()
        # The page load starts a kernel and the app: tens of seconds on a busy 2-core machine.
        page.set_default_timeout(120_000)
        expect.set_options(timeout=120_000)
        try:
            page.goto(url)
            detail = page.locator(".fp8ops-detail-fig .js-plotly-plot")
            expect(detail).to_be_visible()
            title = page.locator(".fp8ops-detail-fig .gtitle")
            expect(title).to_have_text(re.compile(re.escape(f"{store.modules[0]} · input")))
            expect(page.locator(".fp8ops-heatmap-fig .js-plotly-plot")).to_be_visible()
            expect(page.locator(".fp8ops-switches-note")).to_contain_text("no precision switches")

            # Pick a module: the plot shows its history.
            page.locator(".fp8ops-module select").select_option(module)
            expect(title).to_have_text(re.compile(re.escape(f"{module} · input")))
            y = _numbers(
                page.evaluate("""() => {
                const y = document.querySelector('.fp8ops-detail-fig .js-plotly-plot').data[0].y;
                return y.bdata ? y : Array.from(y); }""")
            )
            expected = store.module_history(module, "input.amax")["input.amax"].tolist()
            assert y == pytest.approx(expected, rel=1e-6)

            # Stage it as ana (the --user), approve it as ben.
            page.locator(".fp8ops-stage-reason input").fill("e2e: input saturation")
            page.locator("button.fp8ops-stage-button").click()
            message = page.locator(".fp8ops-message")
            expect(message).to_contain_text(f"staged {module} to bf16")
            page.locator(".fp8ops-user input").fill("ben")
            page.locator("button.fp8ops-approve-button").click()
            expect(message).to_contain_text("approved")
            expect(page.locator(".fp8ops-resume")).to_contain_text(f"{module} -> bf16")
            # The follower, on the kernel's event loop, noticed the ledger change.
            expect(page.locator(".fp8ops-live")).to_contain_text(f"followed: step {STEPS}")
            staged, approved = wait_for_records(run / "overrides.jsonl", 2)

            # The what-if runs in the kernel's worker thread and comes back to the page.
            page.locator("button.fp8ops-whatif-button").click()
            expect(page.locator(".fp8ops-whatif")).to_contain_text("steps that overflowed")
            expect(page.locator(".fp8ops-whatif-fig .js-plotly-plot")).to_be_visible()
            shot = ARTIFACTS / "console-e2e.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nscreenshot: {shot}")
        finally:
            browser.close()
    assert (staged["kind"], staged["module"], staged["who"]) == ("staged", module, "ana")
    assert staged["reason"] == "e2e: input saturation"
    assert (approved["kind"], approved["who"], approved["override"]) == (
        "approved",
        "ben",
        staged["hash"],
    )


def _numbers(y) -> list[float]:
    """A plotly trace's y as the browser holds it: a list, or a typed-array spec (base64)."""
    if isinstance(y, dict):  # {"dtype": ..., "bdata": base64}: decode like plotly.js does
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    return json.loads(json.dumps(y))


def test_a_page_viewer_sees_no_traceback_only_the_log_does(tmp_path):
    """An error in the served notebook shows Voila's notice, not the traceback with its paths
    and values; the operator finds it in Voila's log."""
    import urllib.request

    from fp8ops.console.server import start

    notebook = tmp_path / "fails.ipynb"
    cell = {"cell_type": "code", "execution_count": None, "id": "fails", "metadata": {}}
    cell |= {"outputs": [], "source": ["raise RuntimeError('the-secret-in-a-traceback')"]}
    kernel = {"display_name": "Python 3", "language": "python", "name": "python3"}
    notebook.write_text(
        json.dumps({"cells": [cell], "metadata": {"kernelspec": kernel}, "nbformat": 4,
                    "nbformat_minor": 5})
    )  # fmt: skip
    (tmp_path / "runs").mkdir()
    log = tmp_path / "voila.log"
    server = start(tmp_path / "runs", log=log, notebook=notebook)
    try:
        page = urllib.request.urlopen(server.url, timeout=120).read().decode()
    finally:
        server.stop()
    assert "There was an error when executing cell" in page
    assert "the-secret-in-a-traceback" not in page and "RuntimeError" not in page
    assert "the-secret-in-a-traceback" in log.read_text()
