"""Megatron's ``dist_checkpointing`` save and load, as every fp8ops checkpoint calls them.

Both are collective and synchronous. Two things wrap Megatron's calls:

* Megatron 0.16 calls torch.distributed.checkpoint APIs that torch 2.13 deprecates
  (ShardedTensor, load_state_dict): a warning per call that the user cannot act on, silenced.
* Megatron's torch_dist writer passes its write results back through a queue that it makes, at
  the first save of a process, in a multiprocessing Manager: a spawned interpreter, which imports
  torch to unpickle them (1.7 s per rank, and an interpreter with torch left in memory:
  ``docs/benchmarks/checkpoint.md``). A synchronous save puts and takes them in the saving
  thread, so a thread queue carries them; a fresh one for each save, so a save that failed
  between the two never hands its results to the next. Where a Megatron version has no such
  queue, nothing changes.
"""

from __future__ import annotations

import queue
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def save_sharded(sharded_state_dict: dict, directory: Path) -> None:
    """Write ``sharded_state_dict`` into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    from fp8ops.megatron.compat import filesystem_async

    if hasattr(filesystem_async, "_results_queue"):
        filesystem_async._results_queue = queue.Queue()
    with _quiet_dcp():
        dist_checkpointing.save(sharded_state_dict, str(directory))


def load_sharded(sharded_state_dict: dict, directory: Path) -> dict:
    """Read the tensors ``sharded_state_dict`` describes from ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    with _quiet_dcp():
        return dist_checkpointing.load(sharded_state_dict, str(directory))


def saved_keys(directory: Path) -> set[str]:
    """The keys of the tensors saved in ``directory`` (its metadata file; no tensor is read)."""
    from megatron.core import dist_checkpointing

    with _quiet_dcp():
        return set(dist_checkpointing.load_tensors_metadata(str(directory)))


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
