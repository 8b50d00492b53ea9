"""TE's ``_extra_state`` payload (fp8ops/megatron/te_extra_state.py): written with TE's own
recipe object as TE writes it, read back without running pickled code, loaded into fp8ops'
Megatron layers. TE's recipe module imports on a CPU (ci/setup.sh installs it); the tests that
need it skip without it."""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
from support.te_stand_in import TE_EXTRA_STATE

from fp8ops.errors import Fp8opsError
from fp8ops.megatron.te_extra_state import (
    FP8_KEYS,
    read_extra_state,
    recipe_differences,
    te_extra_state,
)
from fp8ops.precision import DelayedScalingRecipe, Fp8Meta
from fp8ops.precision.formats import Fp8Format
from fp8ops.precision.scaling import parse_amax_algo
from fp8ops.precision.te_recipe import load_te_recipe_module

TE_RECIPE = load_te_recipe_module()
needs_te_recipe = pytest.mark.skipif(TE_RECIPE is None, reason="needs TE's recipe module")
RECIPE = DelayedScalingRecipe(
    fp8_format=Fp8Format.HYBRID,
    amax_history_len=16,
    amax_compute_algo=parse_amax_algo("max"),
    margin=1,
    reduce_amax=True,
)


def trained_meta(seed: int = 0) -> Fp8Meta:
    meta = Fp8Meta.fresh(RECIPE)
    generator = torch.Generator().manual_seed(seed)
    for state in (meta.forward, meta.backward):
        state.amax_history.copy_(torch.rand(state.amax_history.shape, generator=generator) * 9)
        state.scale.copy_(torch.rand(state.scale.shape, generator=generator) * 500)
    return meta


@needs_te_recipe
def test_a_te_payload_round_trips_bit_for_bit_with_its_recipe():
    meta = trained_meta()
    payload = te_extra_state(meta.state_dict(), RECIPE)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    loaded = read_extra_state(payload)
    assert loaded.source == "transformer_engine"
    for key in FP8_KEYS:
        assert torch.equal(loaded.tensors[key], meta.state_dict()[key]), key
    assert recipe_differences(loaded.recipe, RECIPE) == []
    assert loaded.recipe["fp8_format"] == "hybrid" and loaded.recipe["margin"] == 1


@needs_te_recipe
def test_te_itself_unpickles_the_payload_into_its_own_recipe():
    """What TE's set_extra_state gets (after its unsafe-pickle opt-in) is TE's real recipe."""
    state = pickle.loads(te_extra_state(trained_meta().state_dict(), RECIPE).numpy().tobytes())
    recipe = state["recipe"]
    assert type(recipe) is TE_RECIPE.DelayedScaling
    assert recipe.fp8_format == TE_RECIPE.Format.HYBRID and recipe.amax_history_len == 16
    assert state["amax_history_fwd"].shape == (16, 3) and state["scale_bwd"].shape == (2,)
    assert state["extra_fp8_variables"]["num_gemms"] == 1


@needs_te_recipe
def test_a_payload_pickled_where_megatron_replaced_torchs_storage_loader_is_read(monkeypatch):
    """megatron-core 0.17 and later set torch.storage._load_from_bytes to their own
    megatron.core.safe_globals.safe_load_from_bytes when imported, so the tensors of a payload
    pickled in a training process name that function. Read with fp8ops' loader, not it."""
    module = types.ModuleType("megatron.core.safe_globals")

    def safe_load_from_bytes(data):
        raise AssertionError("the payload's loader ran")

    safe_load_from_bytes.__module__ = module.__name__
    safe_load_from_bytes.__qualname__ = "safe_load_from_bytes"
    module.safe_load_from_bytes = safe_load_from_bytes
    meta = trained_meta()
    with monkeypatch.context() as patched:  # as Megatron's __init__ does
        patched.setitem(sys.modules, module.__name__, module)
        patched.setattr(torch.storage, "_load_from_bytes", safe_load_from_bytes)
        payload = te_extra_state(meta.state_dict(), RECIPE)
    data = payload.numpy().tobytes()
    assert b"megatron.core.safe_globals" in data and b"torch.storage" not in data
    loaded = read_extra_state(payload)
    for key in FP8_KEYS:
        assert torch.equal(loaded.tensors[key], meta.state_dict()[key]), key


@needs_te_recipe
def test_a_payload_megatron_wrote_with_its_own_recipe_class_is_read(monkeypatch):
    """Megatron's TE layers hold its TEDelayedScaling (a DelayedScaling subclass defined in
    megatron.core.extensions.transformer_engine), so a Megatron-LM checkpoint's payload names
    that class. Its module imports only with TE's PyTorch side: a stand-in module here."""
    name = "megatron.core.extensions.transformer_engine"
    module = types.ModuleType(name)

    class TEDelayedScaling(TE_RECIPE.DelayedScaling):
        pass

    TEDelayedScaling.__module__, TEDelayedScaling.__qualname__ = name, "TEDelayedScaling"
    module.TEDelayedScaling = TEDelayedScaling
    monkeypatch.setitem(sys.modules, name, module)
    meta = trained_meta()
    state = pickle.loads(te_extra_state(meta.state_dict(), RECIPE).numpy().tobytes())
    megatrons = TEDelayedScaling.__new__(TEDelayedScaling)
    megatrons.__dict__.update(vars(state["recipe"]))
    payload = pickle.dumps({**state, "recipe": megatrons})
    assert f"{name}".encode() in payload and b"TEDelayedScaling" in payload
    loaded = read_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert recipe_differences(loaded.recipe, RECIPE) == []
    assert all(torch.equal(loaded.tensors[key], meta.state_dict()[key]) for key in FP8_KEYS)


@needs_te_recipe
def test_te_2_18_and_later_would_refuse_the_payload_that_fp8ops_reads_safely():
    """TE's own classifier (its _extra_state.py, loaded from the installed file) sends the
    payload to the unsafe path, which TE >= 2.18 refuses without its environment switch."""
    te_extra = TE_EXTRA_STATE
    if te_extra is None:
        pytest.skip("this TE has no pytorch/_extra_state.py (before 2.18)")
    payload = te_extra_state(trained_meta().state_dict(), RECIPE).numpy().tobytes()
    assert os.environ.get(te_extra.UNSAFE_PICKLE_EXTRA_STATE_ENV) != "1"
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):
        te_extra.should_load_extra_state_pickle(payload, "linear_qkv")
    assert read_extra_state(payload) is not None  # fp8ops reads it, no switch needed


class _Exploit:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.makedirs, (str(self.target),))


def test_a_payload_naming_any_other_global_is_refused_before_it_runs(tmp_path):
    target = tmp_path / "created-by-the-pickle"
    payload = pickle.dumps({"scale_fwd": _Exploit(target)})
    with pytest.raises(
        Fp8opsError, match=r"layer\.x: refusing TE extra state that names .*makedirs"
    ):
        read_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8), where="layer.x")
    assert not target.exists()


def test_empty_truncated_and_malformed_payloads():
    assert read_extra_state(torch.empty(0, dtype=torch.uint8)) is None  # no FP8 state
    with pytest.raises(Fp8opsError, match="not a readable TE extra-state payload"):
        read_extra_state(pickle.dumps({"scale_fwd": torch.ones(3)})[:-9])
    with pytest.raises(Fp8opsError, match="without TE's DelayedScaling recipe"):
        read_extra_state(pickle.dumps({"scale_fwd": torch.ones(3)}))
    with pytest.raises(Fp8opsError, match="neither fp8ops' FP8 state"):
        read_extra_state(torch.ones(3))
    with pytest.raises(Fp8opsError, match="lacks scale_bwd"):
        read_extra_state({k: torch.ones(1) for k in FP8_KEYS if k != "scale_bwd"})


def test_fp8ops_state_reads_as_itself():
    state = trained_meta().state_dict()
    loaded = read_extra_state(state)
    assert loaded.source == "fp8ops" and loaded.recipe is None
    assert all(torch.equal(loaded.tensors[k], state[k]) for k in FP8_KEYS)


@needs_te_recipe
def test_a_window_statistic_recipe_has_no_te_state():
    window = DelayedScalingRecipe(
        amax_history_len=16, amax_compute_algo=parse_amax_algo("quantile:0.9")
    )
    with pytest.raises(Fp8opsError, match="only 'max' and 'most_recent'"):
        te_extra_state(Fp8Meta.fresh(window).state_dict(), window)


@needs_te_recipe
def test_a_megatron_fp8_layer_loads_a_te_payload_and_refuses_another_recipe(megatron_tp1):
    from support.example_manifests import TINY

    from fp8ops.manifest import load_manifest
    from fp8ops.megatron.config import transformer_config
    from fp8ops.megatron.layers import Fp8ColumnParallelLinear

    config = transformer_config(load_manifest(TINY))

    def layer(recipe):
        return Fp8ColumnParallelLinear(
            32,
            64,
            recipe=recipe,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            skip_bias_add=False,
        )

    meta = trained_meta(seed=3)
    target = layer(RECIPE)
    target.set_extra_state(te_extra_state(meta.state_dict(), RECIPE))
    for key, tensor in meta.state_dict().items():
        assert torch.equal(target.get_extra_state()[key], tensor), key
    target.set_extra_state(torch.empty(0, dtype=torch.uint8))  # TE's "no state": kept as is
    assert torch.equal(target.get_extra_state()["scale_fwd"], meta.forward.scale)

    other = DelayedScalingRecipe(amax_history_len=16, amax_compute_algo=parse_amax_algo("max"))
    with pytest.raises(Fp8opsError, match=r"another recipe \(margin: 1 != 0\)"):
        layer(other).set_extra_state(te_extra_state(meta.state_dict(), RECIPE))


def payload_of(state: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


@needs_te_recipe
def test_a_payload_cannot_dodge_the_recipe_check():
    from collections import OrderedDict

    from fp8ops.precision.te_recipe import to_te_recipe

    tensors = trained_meta().state_dict()
    other = DelayedScalingRecipe(amax_history_len=16, amax_compute_algo=parse_amax_algo("max"))
    recipe = to_te_recipe(RECIPE)
    recipe.__dict__["fields"] = OrderedDict()  # a name a record method could have had
    loaded = read_extra_state(payload_of({"recipe": recipe, **tensors}))
    assert recipe_differences(loaded.recipe, other) == ["margin: 1 != 0"]
    with pytest.raises(Fp8opsError, match="without TE's DelayedScaling recipe"):
        read_extra_state(payload_of(tensors))  # no recipe (TE 1.x, or made up)
    with pytest.raises(Fp8opsError, match="without TE's DelayedScaling recipe"):
        read_extra_state(payload_of({"recipe": {"margin": 0}, **tensors}))
    del recipe.__dict__["margin"]
    with pytest.raises(Fp8opsError, match="recipe in the payload lacks margin"):
        read_extra_state(payload_of({"recipe": recipe, **tensors}))


@needs_te_recipe
def test_loaded_tensors_are_float32_detached_and_on_the_host():
    tensors = {k: v.clone().requires_grad_() for k, v in trained_meta().state_dict().items()}
    loaded = read_extra_state(
        payload_of(
            {
                "recipe": load_te_recipe_module().DelayedScaling(margin=1, amax_history_len=16),
                **tensors,
            }
        )
    )
    assert all(not t.requires_grad and t.device.type == "cpu" for t in loaded.tensors.values())
    meta = Fp8Meta.fresh(RECIPE)
    meta.load_state_dict(tensors)  # a state that requires grad must not pass it on
    assert not meta.forward.scale.requires_grad and meta.forward.scale.grad_fn is None
    doubles = {k: v.double() for k, v in trained_meta().state_dict().items()}
    with pytest.raises(Fp8opsError, match=r"must be float32: scale_fwd \(torch.float64\)"):
        read_extra_state(doubles)


def test_an_old_torch_is_refused_before_anything_is_unpickled(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(Fp8opsError, match="needs torch >= 2.6"):
        read_extra_state(pickle.dumps({"scale_fwd": torch.ones(3)}))
