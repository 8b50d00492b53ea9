"""Transformer Engine's own NVFP4 reference quantizer (``NVFP4QuantizerRef`` in
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, the pure-torch quantizer TE's
tests compare its kernels with, bit for bit), loaded on a machine without TE's CUDA build.

The file's arithmetic is plain torch, but it imports three TE modules that need the compiled
extension: ``quantized_tensor`` (only for two base classes), ``custom_recipes.gemm`` (only for
an enum in a signature) and ``reference_utils`` (pure torch, loaded as it is). The first two
are replaced by stand-ins that carry just those names, in a private copy of the module
namespace, so nothing else sees them. Returns None where TE's package is absent or its layout
has changed (the caller skips).
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from pathlib import Path

_PREFIX = "_fp8ops_te_reference"


class _Quantizer:
    def __init__(self, rowwise: bool = True, columnwise: bool = True):
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def load() -> types.ModuleType | None:
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "pytorch" / "custom_recipes"
    if not (folder / "reference_nvfp4.py").is_file():
        return None
    gemm = _module(
        f"{_PREFIX}.gemm", GEMMType=enum.Enum("GEMMType", "FPROP DGRAD WGRAD"), MMParams=object
    )
    tensor = _module(
        f"{_PREFIX}.quantized_tensor",
        Quantizer=_Quantizer,
        QuantizedTensorStorage=type("QuantizedTensorStorage", (), {}),
    )
    saved = {name: sys.modules.get(name) for name in _names()}
    try:
        utils = _load(folder / "reference_utils.py", f"{_PREFIX}.reference_utils")
        package = _module(_PREFIX, gemm=gemm, reference_utils=utils)
        sys.modules.update(
            {
                "transformer_engine.pytorch.custom_recipes": package,
                "transformer_engine.pytorch.custom_recipes.gemm": gemm,
                "transformer_engine.pytorch.custom_recipes.reference_utils": utils,
                "transformer_engine.pytorch.quantized_tensor": tensor,
            }
        )
        return _load(folder / "reference_nvfp4.py", f"{_PREFIX}.reference_nvfp4")
    except (ImportError, AttributeError):  # a TE release laid out otherwise: nothing to compare
        return None
    finally:  # the stand-ins were needed only while the file's imports ran
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _names() -> tuple[str, ...]:
    return (
        "transformer_engine.pytorch.custom_recipes",
        "transformer_engine.pytorch.custom_recipes.gemm",
        "transformer_engine.pytorch.custom_recipes.reference_utils",
        "transformer_engine.pytorch.quantized_tensor",
    )


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
