"""What the run ran on: versions and devices, recorded with every run and checkpoint.

Resumption compares these (a different torch or Transformer Engine can change numerics, and FP8
kernels differ between GPU generations), so the fingerprint lists every version that can.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def environment_fingerprint() -> dict[str, str | None]:
    """Versions of Python, torch, megatron-core, Transformer Engine and the CUDA stack; ``None``
    for what is absent. Plain strings, so it compares and serialises as JSON.

    Versions come from the installed distributions, and torch is only imported where an NVIDIA
    driver is present (to ask for the CUDA stack): a resume refused for drift answers before
    torch's second of import time.
    """
    cuda = NVIDIA_DRIVER.exists() and _torch_cuda()
    if cuda:
        import torch
    return {
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "torch": _version("torch"),
        "megatron_core": _version("megatron-core"),
        "transformer_engine": _version("transformer-engine"),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": str(torch.backends.cudnn.version()) if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "driver": _nvidia_driver() if cuda else None,
    }


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        with open(NVIDIA_DRIVER) as f:
            return f.readline().strip()
    except OSError:
        return None
