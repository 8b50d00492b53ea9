"""Checks and work that every rank must come through together.

A rank that raises where the others go on leaves them waiting in their next collective forever
(a broadcast from rank 0 that never comes, a pipeline schedule without its first stage). Here
every rank gets the same outcome: rank 0's result or failure (:func:`on_rank0`), or the first
problem any rank found (:func:`raise_if_any`, :func:`together`). The error the ranks raise
alike is marked ``collective``, so the command line says it once, on rank 0
(``fp8ops.cli.main``).

Without a process group of more than one rank (a test, one process) nothing is exchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch.distributed as dist

from fp8ops.errors import Fp8opsError

T = TypeVar("T")


def on_rank0(is_main: bool, work: Callable[[], T], *, error: type[Fp8opsError] = Fp8opsError) -> T:
    """Run ``work`` on rank 0 (``is_main``) and hand its result to every rank. If it fails,
    rank 0 raises its own exception and every other rank an ``error`` naming it."""
    result, problem, failure = None, None, None
    if is_main:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - reported on every rank, re-raised on rank 0
            problem, failure = f"{exc}", exc
    if _several():
        box = [(result, problem)]
        dist.broadcast_object_list(box, src=0)
        result, problem = box[0]
    if problem is not None:
        if is_main:
            raise failure
        raise _said_once(error(f"rank 0 failed: {problem}"))
    return result


def raise_if_any(problem: str | None, *, error: type[Fp8opsError] = Fp8opsError) -> None:
    """Every rank learns every rank's ``problem`` (None: this rank has none); if any has one,
    all raise the first, as ``error``."""
    everyone = [problem]
    if _several():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problem)
    first = next((p for p in everyone if p is not None), None)
    if first is not None:
        raise _said_once(error(first))


@contextmanager
def together(error: type[Fp8opsError] = Fp8opsError) -> Iterator[None]:
    """A block that every rank enters, and that may raise on some ranks only (a check only
    some of them make): when it raises on any, every rank raises the first rank's problem, as
    ``error``; a rank whose own block raised chains its exception (its traceback, and a full
    disk found in it, are kept)."""
    try:
        yield
    except Exception as exc:  # raised again, on every rank
        try:
            raise_if_any(str(exc), error=error)
        except Fp8opsError as agreed:
            raise agreed from exc
        raise  # not reached: this rank's problem is among those gathered
    else:
        raise_if_any(None, error=error)


def _said_once(exc: Fp8opsError) -> Fp8opsError:
    exc.collective = True  # every rank raises it alike; rank 0 says it
    return exc


def _several() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
