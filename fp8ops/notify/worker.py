"""The notifications' thread: notices in through a bounded queue, each to every webhook whose
level it reaches, with bounded retries (:mod:`fp8ops.notify.delivery`).

What the training step does is :meth:`Notifier.notify`: a notice onto a queue, never waiting.
``alerts.jsonl`` is written before (the trainer's order), so nothing a webhook misses is lost.
A webhook's first failure is reported (``report``: a line on stderr, an event in
``events.jsonl``), the later ones counted; a full queue drops and counts. :meth:`close` gives
what is queued until a deadline (``notifications.exit_wait_seconds``), so a Stop that ends the
process still sends its notice, and counts what it could not send.
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8ops.notify.delivery import DeliveryFailed, deliver
from fp8ops.notify.formats import FORMATS
from fp8ops.notify.notice import Notice

Report = Callable[[str, str, dict[str, Any]], None]

CAPACITY = 1000  # notices: a step with alerts makes one
_POLL = 0.2  # seconds between looks at the queue while closing


@dataclass(frozen=True)
class Target:
    """A webhook: its position in the manifest, the variable that named its URL, its format and
    level, and the URL (read from the environment; kept in memory only)."""

    index: int
    url_env: str
    format: str
    level: str
    url: str

    def label(self) -> str:
        return f"webhook {self.index} ({self.url_env}, {self.format})"


class Notifier:
    def __init__(
        self,
        targets: list[Target],
        *,
        timeout: float,
        retries: int,
        report: Report,
        backoff: float = 1.0,
        capacity: int = CAPACITY,
    ):
        self.targets, self.timeout, self.retries = targets, timeout, retries
        self.report, self.backoff = report, backoff
        self.counts = {t.index: {"sent": 0, "failed": 0} for t in targets}
        self.dropped = 0
        self.unsent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._closing = threading.Event()
        self._deadline = math.inf  # monotonic seconds; set by close()
        self._thread = threading.Thread(target=self._run, name="fp8ops-notify", daemon=True)

    def start(self) -> Notifier:
        self._thread.start()
        atexit.register(self.close)
        return self

    def notify(self, notice: Notice) -> None:
        if self._closing.is_set():
            return
        try:
            self._queue.put_nowait(notice)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.report(
                    "notifications_dropped",
                    f"alert notifications fell {self._queue.maxsize} behind; later ones are "
                    "dropped (and counted). alerts.jsonl has every alert",
                    {},
                )

    def close(self, wait: float = 10.0) -> bool:
        """Send what is queued for at most ``wait`` seconds more; whether all of it went."""
        atexit.unregister(self.close)
        self._deadline = min(self._deadline, time.monotonic() + wait)
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        left = self._queue.qsize() + self.unsent
        if left or self._thread.is_alive():
            self.report(
                "notifications_not_sent",
                f"{left} alert notification(s) could not be sent within {wait:g} s of the run's "
                "end (notifications.exit_wait_seconds); alerts.jsonl has every alert",
                {"unsent": left},
            )
            return False
        return True

    def summary(self) -> dict[str, Any]:
        return {
            "webhooks": {t.label(): self.counts[t.index] for t in self.targets},
            "dropped": self.dropped,
        }

    # -- the thread --------------------------------------------------------------------------

    def _time_left(self) -> float:
        return self._deadline - time.monotonic()

    def _wait(self, seconds: float) -> None:
        """A backoff: cut to the deadline if the run ends meanwhile."""
        end = time.monotonic() + seconds
        if self._closing.wait(seconds):
            remaining = min(end, self._deadline) - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)

    def _run(self) -> None:
        while True:
            try:
                notice = self._queue.get(timeout=_POLL)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if self._time_left() <= 0:
                self.unsent += 1
                continue
            for target in self.targets:
                self._send(target, notice)

    def _send(self, target: Target, notice: Notice) -> None:
        kept = notice.at_least(target.level)
        if kept is None:
            return
        try:
            deliver(
                target.url,
                FORMATS[target.format](kept),
                timeout=self.timeout,
                retries=self.retries,
                backoff=self.backoff,
                wait=self._wait,
                time_left=self._time_left,
            )
            self.counts[target.index]["sent"] += 1
        except DeliveryFailed as failed:
            self.counts[target.index]["failed"] += 1
            if self.counts[target.index]["failed"] == 1:
                self.report(
                    "notification_failed",
                    f"{target.label()} could not be told of step {kept.step}'s alerts: {failed}. "
                    "Later failures are counted, not reported; alerts.jsonl has every alert",
                    {
                        "webhook": target.index,
                        "url_env": target.url_env,
                        "step": kept.step,
                        "error": str(failed),
                    },
                )
