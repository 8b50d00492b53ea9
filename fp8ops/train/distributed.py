"""Process groups for a run: one process, or one per rank under torchrun / srun.

torchrun (and fp8ops' SLURM launcher, which starts torchrun) sets ``RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR``/``MASTER_PORT``; a plain ``fp8ops train`` sets none and runs as a world of one on a
private port. Either way Megatron's parallel state is then initialised for the manifest's topology,
so the rest of fp8ops sees the same groups in both cases.

Devices: with CUDA, each rank trains on one GPU, ``cuda:LOCAL_RANK`` (torchrun sets
``LOCAL_RANK``; a plain run uses GPU 0), and the process group is started as
``"cpu:gloo,cuda:nccl"``: collectives on CUDA tensors (amax reductions, gradient sums, TP layers)
go over NCCL, and the small CPU tensors fp8ops agrees on (stop requests, alert flags, FP8 state
digests, token counts, losses, gradient-norm scalars, ``*_object`` collectives, barriers) over
gloo. Every subgroup Megatron creates without naming a backend inherits that pair
(``torch.distributed.new_group`` defaults to the default group's backend string). Without CUDA
everything is gloo on the CPU, as before. ``CUDA_VISIBLE_DEVICES=`` (empty) runs on the CPU on a
GPU machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8ops.errors import Fp8opsError, ManifestError

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Ranks:
    """Where this process sits. ``dp_rank``/``tp_rank`` are Megatron's."""

    rank: int
    world_size: int
    tp_rank: int
    dp_rank: int
    device: torch.device = _CPU  # where this rank's model and batches live

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory; the others only compute."""
        return self.rank == 0


def init_distributed(topology, *, source: str) -> Ranks:
    """Start torch.distributed and Megatron's parallel state for ``topology``.

    The world must be exactly the manifest's: a run that silently used another layout would
    record one topology and train another. ``source`` names the manifest in errors.
    """
    from fp8ops.megatron.compat import parallel_state

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != topology.world_size:
        raise ManifestError(
            f"{source}: this job has {world_size} process(es) but topology asks for "
            f"{topology.world_size} (tensor_parallel {topology.tensor_parallel} x pipeline_parallel "
            f"{topology.pipeline_parallel} x data_parallel {topology.data_parallel}); start it "
            f"with `torchrun --nproc-per-node {topology.world_size}` or change the topology, "
            f"e.g. --set topology.tensor_parallel={world_size}"
        )
    global _owner
    device = rank_device()
    if not dist.is_initialized():
        _start_process_group()
        _owner = "run"
    elif device.type == "cuda":
        # A group started elsewhere (a test, a caller's own): it must still carry fp8ops' CPU
        # collectives, which a plain "nccl" group cannot.
        if "gloo" not in dist.get_backend():
            raise Fp8opsError(
                f"the process group was started with backend {dist.get_backend()!r}, which has no "
                "CPU backend for fp8ops' control collectives; start it with "
                '"cpu:gloo,cuda:nccl" (or let fp8ops start it)'
            )
        torch.cuda.set_device(device)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=topology.tensor_parallel,
        pipeline_model_parallel_size=topology.pipeline_parallel,
    )
    return Ranks(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available (one GPU per rank),
    otherwise the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ManifestError(
            f"this is local rank {local_rank} but only {visible} GPU(s) are visible here: fp8ops "
            "trains with one GPU per rank, so start at most that many processes per node "
            "(torchrun --nproc-per-node) or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def shutdown_distributed() -> None:
    """Undo :func:`init_distributed` (safe to call when nothing was started)."""
    from fp8ops.megatron.compat import parallel_state

    global _owner
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and _owner == "run":
        dist.destroy_process_group()
        _owner = None


@contextlib.contextmanager
def shared_process_group():
    """One process group for several runs in a row (``fp8ops dualtrack``'s tracks): under
    torchrun, a gloo group cannot rendezvous a second time in the same processes (the store
    still holds the first group's addresses), so the runs share this one instead of each
    starting and ending their own."""
    global _owner
    if dist.is_initialized():
        yield
        return
    _start_process_group()
    _owner = "shared"
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _owner = None


# Who started the process group: "run" (init_distributed, which ends it with its run),
# "shared" (shared_process_group, which outlives the runs inside it) or None.
_owner: str | None = None


def _start_process_group() -> None:
    device = rank_device()
    backend = "gloo"
    if device.type == "cuda":
        # Before the group starts, so that NCCL's communicators (created on first use) and
        # torch.cuda.current_device() (Megatron passes it as a device) are this rank's GPU.
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # each tensor's collective goes by its device
    if "RANK" in os.environ:
        dist.init_process_group(backend)  # env:// from torchrun
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )


def _free_port() -> int:
    # The OS picks an unused port; a fixed one would collide with a second run or a test.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
