"""The boundary with megatron-core: every Megatron name fp8ops uses is imported here.

Three reasons for one module:

1. **Importing megatron-core next to Transformer Engine's recipe-only package.** ``ci/setup.sh``
   installs TE's pure-Python package (``--no-deps``) for ``fp8ops.precision.te_recipe``. Megatron
   guards every TE import with ``except ImportError``, but that package raises ``RuntimeError``
   ("empty meta package") on import, and once its recipe module is loaded,
   ``import transformer_engine.pytorch`` raises ``FileNotFoundError`` (no torch extension). Either
   way ``import megatron.core`` fails. Without CUDA, TE's PyTorch side can never work, so on such a
   machine Megatron is imported once, here, with TE hidden: it takes its own "TE not installed"
   paths, the configuration the CPU reference validated. TE is visible again right after, so
   ``te_recipe`` keeps working. Megatron modules imported later, elsewhere, would not get this
   guard: import them here.
2. **Version-sensitive calls.** The CPU shims replace Megatron's RNG tracker through private
   module globals (:func:`set_rng_tracker` is the one place that knows their names), the amax
   reduction group comes from a getter whose arguments have grown across versions
   (:func:`amax_reduction_group`), a layer spec's MLP block changed shape in 0.18
   (:func:`block_submodules`, :func:`with_block_submodules`), and a config field was renamed in
   0.18 (:func:`whole_layer_cuda_graphs`).
3. **Megatron's JIT fuser off on the CPU.** Its fused functions are wrapped in ``torch.compile``
   as they import, which loads inductor: a second of every process's start, for functions the
   CPU path never calls. On a machine without CUDA Megatron is imported with its own
   ``disable_jit_fuser()`` applied (:class:`_JitFuserOff`).

Supported: megatron-core 0.16.1 (the newest release for Python 3.11; CI tests it) to 0.19, which
need Python >= 3.12. The CPU suite passed against 0.18.2 and 0.19.2 too, and its Megatron, TE,
checkpoint and training test files against 0.17.1, their wheels' code run on Python 3.11
(``ci/megatron_version_check.sh``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Iterator
from dataclasses import replace

import torch


@contextlib.contextmanager
def _transformer_engine_hidden() -> Iterator[None]:
    """Make ``import transformer_engine*`` raise ImportError, then restore what was there.

    A ``None`` entry in ``sys.modules`` is Python's documented way to make an import fail with
    ModuleNotFoundError; already-imported TE modules are put back untouched.
    """
    names = {"transformer_engine", "transformer_engine_torch"}
    names |= {name for name in sys.modules if name.startswith("transformer_engine.")}
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    sys.modules.update(dict.fromkeys(names))
    try:
        yield
    finally:
        for name in names:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)


class _JitFuserOff(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Load ``megatron.core.jit`` as it is, then call its own ``disable_jit_fuser()``.

    Megatron makes ``jit_fuser`` ``torch.compile`` and decorates about 40 fused functions with it
    as their modules import; the first ``torch.compile`` call imports dynamo and inductor
    (measured on 2 cores: ``import fp8ops.megatron`` takes 3.4 s with them, 2.2 s without).
    None of those functions is on fp8ops' CPU path (its configs turn Megatron's fusions off),
    so they are left plain, as Megatron's switch leaves them: the small base model trains to
    the same weights fingerprint either way. Megatron's modules import ``jit_fuser`` by name, so the switch must come between
    ``jit.py`` and its importers: hence a finder, not a call after the import.
    """

    NAME = "megatron.core.jit"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.disable_jit_fuser()


@contextlib.contextmanager
def _jit_fuser_off() -> Iterator[None]:
    finder = _JitFuserOff()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


@contextlib.contextmanager
def _import_guard() -> Iterator[None]:
    with warnings.catch_warnings():
        # Megatron's own deprecation notices about its own modules, raised at import.
        warnings.simplefilter("ignore", DeprecationWarning)
        if torch.cuda.is_available():
            yield  # a GPU machine imports Megatron (and TE) as they are
            return
        # Expected on a CPU machine, and printed once per Megatron module that checks.
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        with _transformer_engine_hidden(), _jit_fuser_off():
            yield


with _import_guard():
    import megatron.core
    from megatron.core import parallel_state, tensor_parallel

    # fully_parallel tries TE, and from 0.17 on dist_checkpointing.save imports it only when
    # first called: imported here, under the guard.
    from megatron.core.dist_checkpointing.strategies import filesystem_async, fully_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_tensor_model_parallel_region,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

MEGATRON_CORE_VERSION: str = megatron.core.__version__


def whole_layer_cuda_graphs() -> dict:
    """TransformerConfig's keyword for CUDA graphs over whole layers. The default, "full", is
    deprecated in favour of [] (the same) and warns; 0.18 renamed the field cuda_graph_scope to
    cuda_graph_modules and warns for the old name too."""
    renamed = "cuda_graph_modules" in TransformerConfig.__dataclass_fields__
    return {"cuda_graph_modules" if renamed else "cuda_graph_scope": []}


def set_rng_tracker(tracker: megatron_random.CudaRNGStatesTracker) -> None:
    """Install ``tracker`` as the one ``get_cuda_rng_tracker()`` returns.

    Megatron has no public setter: ``initialize_rng_tracker`` only chooses between its CUDA and
    TE classes. Setting the initialised flag keeps ``model_parallel_cuda_manual_seed`` from
    replacing it (unless called with ``force_reset_rng=True``).
    """
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        if not hasattr(megatron_random, name):
            raise ImportError(
                f"megatron-core {MEGATRON_CORE_VERSION} has no tensor_parallel.random.{name}; "
                "fp8ops' CPU RNG tracker supports 0.16.1 (see fp8ops/megatron/compat.py)"
            )
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def amax_reduction_group(*, tp_only: bool) -> torch.distributed.ProcessGroup:
    """Megatron's FP8 amax reduction group, as ``fp8_utils.get_fp8_context`` picks it.

    TP x DP x CP by default; TP x CP with ``tp_only`` (Megatron's ``tp_only_amax_red``).
    """
    return parallel_state.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=tp_only
    )


def block_submodules(block):
    """The submodules of a GPT layer spec's attention or MLP block (None if it has none).

    A block is a ``ModuleSpec`` with ``submodules``, except the dense MLP from megatron-core 0.18
    on: ``functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))``.
    """
    if isinstance(block, functools.partial):
        return block.keywords.get("submodules")
    return getattr(block, "submodules", None)


def with_block_submodules(block, **slots):
    """A copy of ``block`` (either shape, :func:`block_submodules`) whose submodules have
    ``slots`` replaced; ``block`` itself is not modified."""
    submodules = replace(block_submodules(block), **slots)
    if isinstance(block, functools.partial):
        return functools.partial(
            block.func, *block.args, **{**block.keywords, "submodules": submodules}
        )
    return replace(block, submodules=submodules)


def transformer_engine_pytorch():
    """``transformer_engine.pytorch``, or None where it cannot work (no CUDA, not installed).

    Never imported on a CPU machine: there TE's PyTorch extension cannot load (module docstring).
    """
    if not torch.cuda.is_available():
        return None
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


def te_gpt_layer_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron's Transformer Engine GPT layer spec (call only where TE imports)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)


__all__ = [
    "MEGATRON_CORE_VERSION",
    "ColumnParallelLinear",
    "GPTModel",
    "ModuleSpec",
    "RowParallelLinear",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "amax_reduction_group",
    "block_submodules",
    "copy_to_tensor_model_parallel_region",
    "filesystem_async",
    "fully_parallel",
    "fused_softmax",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_forward_backward_func",
    "get_gpt_layer_local_spec",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
    "language_module",
    "megatron_random",
    "parallel_state",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "schedules",
    "set_rng_tracker",
    "te_gpt_layer_spec",
    "tensor_parallel",
    "transformer_engine_pytorch",
    "whole_layer_cuda_graphs",
    "with_block_submodules",
]
