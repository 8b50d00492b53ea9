"""Megatron-Core on a CPU-only torch build: the few shims it needs, all here.

These are fp8ops' only patches of other libraries outside tests. :func:`apply_cpu_shims` applies
them when CUDA is absent and does nothing on a GPU machine, where Megatron's own CUDA paths are the
intended ones. It is idempotent. Each shim names the Megatron code that needs it (as found in
megatron-core 0.16.1; ``compat.py`` covers 0.17-0.19).

1. RNG tracker: every forward forks Megatron's CUDA RNG tracker (attention dropout, even at p=0).
2. ``torch.cuda.current_device``: Megatron passes it as a device argument in ~40 places.
3. Default causal mask: built with ``device="cuda"`` when the caller passes no attention mask.
4. Checkpoint writer: ``torch.cuda.synchronize()`` after the tensors are copied to host memory.
5. Pipeline schedules: each schedule's token counter is created with ``device="cuda"``.
6. Tied embeddings across pipeline stages: the last stage's copy is moved to CUDA before the
   first stage's values are summed into it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from fp8ops.megatron.compat import (
    filesystem_async,
    fused_softmax,
    language_module,
    megatron_random,
    schedules,
    set_rng_tracker,
)


def apply_cpu_shims() -> None:
    """Make megatron-core run on a CPU-only torch build; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        return
    _install_cpu_rng_tracker()
    _current_device_is_cpu()
    _default_causal_mask_on_cpu()
    _checkpoint_preload_without_cuda_sync()
    _schedules_count_tokens_on_cpu()
    _tied_embedding_copy_on_cpu()


# -- 1. RNG tracker --------------------------------------------------------------------------


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's RNG tracker with the CPU generator in place of the CUDA one.

    ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state`` and ``fork`` calls
    ``_get_cuda_rng_state``/``_set_cuda_rng_state`` (tensor_parallel/random.py), which raise
    "Torch not compiled with CUDA enabled". ``DotProductAttention.forward`` forks the tracker on
    every call, so without this no forward pass runs. Same names and seeds as Megatron's, so
    ``model_parallel_cuda_manual_seed`` seeds it as usual.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")  # Megatron's own check and type
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _install_cpu_rng_tracker() -> None:
    # Kept once installed: a second call must not drop the seeds already added to it.
    if not isinstance(megatron_random.get_cuda_rng_tracker(), CpuRNGStatesTracker):
        set_rng_tracker(CpuRNGStatesTracker())


# -- 2. torch.cuda.current_device ------------------------------------------------------------


def _cpu_current_device() -> str:
    return "cpu"


def _current_device_is_cpu() -> None:
    # Megatron uses torch.cuda.current_device() as a *device argument*: utils.py's
    # GlobalMemoryBuffer.get_tensor (the attention's baddbmm buffer, every forward),
    # state_dict_saver.save_state_dict_async_finalize (checkpoint save), the sequence-parallel
    # gathers in mappings.py. On a CPU build it raises; "cpu" puts those tensors where the
    # rest of the model is. Only reached without CUDA, where the real one could never succeed.
    torch.cuda.current_device = _cpu_current_device


# -- 3. default causal mask ------------------------------------------------------------------


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``transformer/utils.py:get_default_causal_mask`` on the CPU: True above the diagonal."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _default_causal_mask_on_cpu() -> None:
    # FusedScaleMaskSoftmax.forward_torch_softmax builds the causal mask itself when the caller
    # passes attention_mask=None (as Megatron's GPT training does without a data-loader mask),
    # with device="cuda" hard-coded. fused_softmax imported the function by name, so the name
    # to replace is fused_softmax's own.
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask


# -- 4. checkpoint writer --------------------------------------------------------------------


def _preload_tensors_without_cuda_sync(write_buckets, non_blocking=True):
    # Host tensors are copied synchronously, so there is nothing to wait for.
    return _original_preload_tensors(write_buckets, non_blocking=False)


_original_preload_tensors = filesystem_async.FileSystemWriterAsync.preload_tensors


def _checkpoint_preload_without_cuda_sync() -> None:
    # dist_checkpointing's FileSystemWriterAsync.preload_tensors ends with torch.cuda.synchronize()
    # when non_blocking, and get_save_function_and_args always passes non_blocking=True, so every
    # save raises on a CPU build. (A save also needs psutil, which megatron-core does not declare.)
    filesystem_async.FileSystemWriterAsync.preload_tensors = staticmethod(
        _preload_tensors_without_cuda_sync
    )


# -- 5. pipeline schedules -------------------------------------------------------------------


class _TorchWithCpuZeros(types.ModuleType):
    """``torch`` as ``schedules.py`` sees it, except that ``zeros(..., device="cuda")`` makes a
    CPU tensor."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def _schedules_count_tokens_on_cpu() -> None:
    # Every schedule in pipeline_parallel/schedules.py (no pipelining, 1F1B, interleaved) starts
    # with total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda"), which raises on a
    # CPU build; it only sums the token counts loss functions return. The module's other torch
    # calls take their devices from the tensors they are given.
    if not isinstance(schedules.torch, _TorchWithCpuZeros):
        schedules.torch = _TorchWithCpuZeros("torch")


# -- 6. tied embeddings across pipeline stages -----------------------------------------------


@contextlib.contextmanager
def _tensors_stay_on_the_cpu() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself, for the duration."""
    saved = torch.Tensor.__dict__.get("cuda")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        if saved is None:
            del torch.Tensor.cuda
        else:
            torch.Tensor.cuda = saved


def _tied_embedding_copy_on_cpu() -> None:
    # LanguageModule.setup_embeddings_and_output_layer (models/common/language_module) gives the
    # last pipeline stage its copy of tied embeddings: zeroed, then all-reduced over the
    # embedding group with the first stage's, after `weight.data = weight.data.cuda()`, which
    # raises on a CPU build. Only during that call, the copy stays on the CPU instead.
    module = language_module.LanguageModule
    original = module.setup_embeddings_and_output_layer
    if getattr(original, "cpu_shim", False):
        return

    def setup_embeddings_and_output_layer(self) -> None:
        with _tensors_stay_on_the_cpu():
            original(self)

    setup_embeddings_and_output_layer.cpu_shim = True
    module.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
