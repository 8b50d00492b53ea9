"""Megatron layer specs in the shapes of other megatron-core releases, for the spec transforms'
tests (test_megatron_layers.py, test_te_backend.py)."""

from __future__ import annotations

import functools
from dataclasses import replace


def mlp_as_partial(layer_spec):
    """``layer_spec`` with its MLP block shaped as megatron-core 0.18 and later make it:
    ``functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))`` (0.16.1 has no
    ``as_mlp_submodule``; a stand-in function takes its place, which the transforms carry over)."""

    def as_mlp_submodule(*args, **kwargs):
        raise AssertionError("a stand-in: never built")

    if isinstance(layer_spec.submodules.mlp, functools.partial):
        return layer_spec  # megatron-core 0.18 or later: already so
    mlp = functools.partial(as_mlp_submodule, submodules=layer_spec.submodules.mlp.submodules)
    return replace(layer_spec, submodules=replace(layer_spec.submodules, mlp=mlp))
