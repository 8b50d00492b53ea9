"""One webhook call: a JSON POST, tried again on what may pass (a refused connection, a
timeout, HTTP 429 or 5xx) with exponential backoff, a bounded number of times, never past the
time left (:func:`deliver`). A 4xx other than 429 is the webhook saying no (a revoked Slack
URL: 403, 404): trying again would not help.

Nothing here names the URL in what it raises or returns: a webhook URL is a secret (Slack's
carries its token), and the reasons go to stderr and ``events.jsonl``.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import fp8ops

MAX_BACKOFF = 30.0  # seconds between two tries at most, Retry-After included


class DeliveryFailed(Exception):
    """The webhook was not reached, or refused: ``reason`` (no URL), after ``tries`` tries."""

    def __init__(self, reason: str, tries: int):
        super().__init__(f"{reason} ({tries} {'try' if tries == 1 else 'tries'})")
        self.reason, self.tries = reason, tries


class _Again(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


def deliver(
    url: str,
    body: dict[str, Any],
    *,
    timeout: float,
    retries: int,
    backoff: float = 1.0,
    wait: Callable[[float], Any] = time.sleep,
    time_left: Callable[[], float] = lambda: math.inf,
) -> int:
    """POST ``body`` as JSON to ``url``; the number of tries it took. Between tries it waits
    ``backoff`` seconds, doubling (or what a 429's Retry-After asks), through ``wait``; no try
    starts, and none waits longer, than ``time_left()`` allows. Raises :class:`DeliveryFailed`."""
    data = json.dumps(body, allow_nan=False).encode("utf-8")
    reason = "not tried"
    for attempt in range(retries + 1):
        left = time_left()
        if left <= 0:
            raise DeliveryFailed(f"{reason}; no time left to try again", attempt)
        try:
            post(url, data, timeout=min(timeout, left))
            return attempt + 1
        except _Again as again:
            reason = again.reason
            delay = again.retry_after if again.retry_after is not None else backoff * 2**attempt
        if attempt < retries:
            wait(min(delay, MAX_BACKOFF, max(time_left(), 0.0)))
    raise DeliveryFailed(reason, retries + 1)


def post(url: str, data: bytes, *, timeout: float) -> None:
    """One POST; raises :class:`_Again` for what may pass, :class:`DeliveryFailed` for a no."""
    request = urllib.request.Request(
        url,
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": f"fp8ops/{fp8ops.__version__}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read(65536)  # the answer's body, so the connection closes cleanly
    except urllib.error.HTTPError as exc:
        if exc.code == 429 or exc.code >= 500:
            raise _Again(f"HTTP {exc.code}", _retry_after(exc.headers.get("Retry-After"))) from None
        raise DeliveryFailed(f"HTTP {exc.code} (the webhook refused the message)", 1) from None
    except urllib.error.URLError as exc:
        raise _Again(_describe(exc.reason)) from None
    except (TimeoutError, OSError) as exc:  # a timeout while reading the answer
        raise _Again(_describe(exc)) from None


def _describe(reason: object) -> str:
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror  # "Connection refused", "Name or service not known"
    return type(reason).__name__ if isinstance(reason, BaseException) else str(reason)


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: take the ordinary backoff
        return None
