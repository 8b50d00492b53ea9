"""A read that must not wait on a FIFO: run in a thread, and a read still waiting after a
generous timeout fails the test instead of hanging it (the FIFO is then opened for writing,
which lets the waiting ``open`` return, so the thread ends too)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# A refusal takes microseconds; a minute is far beyond a machine twice as slow and busy.
TIMEOUT_S = 60.0


def without_waiting(read: Callable[[], Any], fifo: Path) -> Any:
    """``read()``'s result, or the exception it raised (returned, for the test to look at);
    the test fails if ``read`` is still waiting on ``fifo`` after :data:`TIMEOUT_S`."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = read()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the waiting open returns
        thread.join(TIMEOUT_S)
        pytest.fail(f"reading {fifo} waited on the FIFO for {TIMEOUT_S:.0f} s")
    return outcome["result"]
