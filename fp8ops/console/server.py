"""``fp8ops console``: serve the console notebook with Voila on this machine only.

Voila runs as a child process, bound to 127.0.0.1 on a free port, with a random token in the
URL (other users of a shared machine can reach 127.0.0.1 too). The runs directory and the
operator's name reach the notebook's kernel through the environment (``FP8OPS_CONSOLE_RUNS``,
``FP8OPS_USER``), which Voila passes on to the kernels it starts. Nothing here imports
ipywidgets, plotly or torch: the kernel does, when the page is opened.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp8ops.errors import Fp8opsError

HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
REPO_NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "console.ipynb"


def free_port() -> int:
    """A port nobody listens on now (the OS picks it; Voila binds it a moment later)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def console_notebook() -> Path:
    """The repository's notebooks/console.ipynb; an installed package writes the same
    notebook to a temporary directory."""
    if REPO_NOTEBOOK.is_file():
        return REPO_NOTEBOOK
    from fp8ops.console.notebook import write_notebook

    return write_notebook(Path(tempfile.mkdtemp(prefix="fp8ops-console-")) / "console.ipynb")


@dataclass(frozen=True)
class Server:
    process: subprocess.Popen
    url: str  # with the token

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(
    runs_dir: str | Path,
    user: str | None = None,
    *,
    port: int | None = None,
    log: Path | None = None,
    notebook: Path | None = None,
) -> Server:
    """Start Voila on the console notebook (or ``notebook``) and return once it accepts
    connections. A page viewer never sees a traceback (paths, environment, code): an error in
    the notebook shows Voila's notice, and the traceback goes to the log."""
    if importlib.util.find_spec("voila") is None:
        raise Fp8opsError(
            "the console needs its extra: pip install -e '.[console]' (ipywidgets, plotly, voila)"
        )
    runs = Path(runs_dir).expanduser().resolve()
    if not runs.is_dir():
        raise Fp8opsError(f"{runs}: no such runs directory")
    port = port or free_port()
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, FP8OPS_CONSOLE_RUNS=str(runs))
    if user:
        env["FP8OPS_USER"] = user
    # The kernel is started as "python": keep this interpreter's environment first on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    notebook = notebook or console_notebook()
    command = [
        sys.executable,
        "-m",
        "voila",
        str(notebook),
        "--no-browser",
        f"--Voila.ip={HOST}",
        f"--port={port}",
        "--Voila.port_retries=0",
        f"--Voila.token={token}",
        "--show_tracebacks=False",
    ]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
    # Its own session: a Ctrl-C in the terminal reaches only us, and we stop Voila (SIGTERM,
    # which it handles by shutting its kernels down) instead of Voila asking whether to quit.
    process = subprocess.Popen(
        command,
        env=env,
        cwd=notebook.parent,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(process, f"http://{HOST}:{port}/?token={token}")
    _wait_listening(server, port, log)
    return server


def _wait_listening(server: Server, port: int, log: Path | None) -> None:
    """A TCP connect, not an HTTP request: a GET would make Voila run the notebook."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            said = f"; its output: {log}" if log else ""
            raise Fp8opsError(f"Voila exited with code {server.process.returncode}{said}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    server.stop()
    raise Fp8opsError(f"Voila did not listen on {HOST}:{port} within {READY_TIMEOUT_S:.0f} s")


def serve(
    runs_dir: str | Path, user: str | None, port: int | None, echo: Callable[[str], None] = print
) -> None:
    """``fp8ops console``: start Voila, print the URL, and run until interrupted."""
    log = Path(tempfile.mkdtemp(prefix="fp8ops-console-")) / "voila.log"
    server = start(runs_dir, user, port=port, log=log)
    echo(f"fp8ops console: {server.url}")
    echo(
        f"runs: {Path(runs_dir).expanduser().resolve()}"
        + (f", operator: {user}" if user else "")
        + f"; Voila's log: {log}; Ctrl-C stops it"
    )
    # A SIGTERM (a scheduler, `kill`) takes Voila down with us, as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = server.process.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    if code:
        raise Fp8opsError(f"Voila exited with code {code}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
