"""The Transformer Engine path: its configuration everywhere, the model only where TE runs."""

import importlib.util

import pytest
from support.example_manifests import TINY

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.schema import Telemetry
from fp8ops.megatron.te_backend import (
    build_gpt_te,
    te_available,
    te_transformer_config,
)

needs_te = pytest.mark.skipif(not te_available(), reason="needs a GPU with Transformer Engine")


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(TINY)


def test_config_carries_the_manifest_recipe(manifest):
    changed = derive(
        manifest,
        {
            "precision.margin": 2,
            "precision.amax_history_len": 32,
            "precision.amax_compute_algo": "most_recent",
            "topology.amax_reduction": "tp_cp",
        },
        "te config",
    )
    config = te_transformer_config(changed)
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "delayed")
    assert (config.fp8_margin, config.fp8_amax_history_len) == (2, 32)
    assert config.fp8_amax_compute_algo == "most_recent"
    assert config.tp_only_amax_red is True
    assert te_transformer_config(manifest).tp_only_amax_red is False


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"precision.amax_compute_algo": "quantile:0.9"}, "amax_compute_algo 'quantile:0.9'"),
        ({"precision.reduce_amax": False}, "reduce_amax is false"),
        ({"precision.enabled": False}, "precision.enabled is false"),
        ({"model.seq_length": 100}, "model.seq_length 100: TE's FP8 GEMMs take token counts"),
    ],
)
def test_settings_megatron_cannot_carry_to_te_are_refused(manifest, change, message):
    with pytest.raises(Fp8opsError, match=message):
        te_transformer_config(derive(manifest, change, "not expressible on TE"))


@pytest.mark.parametrize("value", ["1", " 1", "2", "yes"])
def test_tes_unfused_scaling_update_is_refused(manifest, monkeypatch, value):
    """TE's Python update rolls a BF16-held module's history and rounds scales differently: the
    bookkeeping fp8ops reproduces and reads would no longer be TE's."""
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", value)
    with pytest.raises(Fp8opsError, match=f"^NVTE_UNFUSED_FP8_UPDATE={value}: TE's unfused"):
        te_transformer_config(manifest)
    for off in ("0", "00", " 0"):  # what TE's int() reads as off
        monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", off)
        assert te_transformer_config(manifest).fp8_recipe == "delayed"


@pytest.mark.parametrize("value", ["dequantized", "high_precision", ""])
def test_a_backward_override_in_the_environment_is_refused(manifest, monkeypatch, value):
    """TE (>= 2.15) takes it as every recipe's default, and DelayedScaling asserts there is none:
    refused by name before Megatron builds a recipe."""
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", value)
    with pytest.raises(Fp8opsError, match=f"^NVTE_BACKWARD_OVERRIDE='{value}': TE makes it"):
        te_transformer_config(manifest)
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE")
    assert te_transformer_config(manifest).fp8_recipe == "delayed"


@pytest.mark.skipif(te_available(), reason="checks the machine without Transformer Engine")
def test_without_te_the_path_refuses_and_names_the_fallback(manifest):
    with pytest.raises(Fp8opsError, match="emulated backend"):
        build_gpt_te(manifest)


@needs_te
def test_te_model_trains_under_delayed_scaling(manifest):  # pragma: no cover - GPU only
    import torch
    import torch.distributed as dist

    from fp8ops.megatron.compat import parallel_state
    from fp8ops.train.distributed import _free_port

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_gpt_te(manifest)
    names = {name for name, _ in model.named_modules()}
    for suffix in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1"):
        assert f"decoder.layers.0.{suffix}" in names
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    s = manifest.model.seq_length
    tokens = torch.randint(0, 256, (2, s), device="cuda")
    positions = torch.arange(s, device="cuda").expand(2, s)
    for _ in range(2):  # Megatron's TransformerBlock enters TE's fp8_autocast itself
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
    scale = qkv.fp8_meta["scaling_fwd"].scale
    assert torch.isfinite(scale).all() and not torch.equal(scale, torch.ones_like(scale))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


# -- per-module BF16 under the delayed-scaling autocast -------------------------------------


def test_the_four_projections_are_swapped_by_spec_and_nothing_else():
    from support.megatron_specs import mlp_as_partial

    from fp8ops.megatron.compat import ModuleSpec, block_submodules, get_gpt_layer_local_spec
    from fp8ops.megatron.spec import get_gpt_layer_fp8_emulated_spec
    from fp8ops.megatron.te_backend import PROJECTIONS, with_bf16_capable_projections
    from fp8ops.precision import DelayedScalingRecipe

    def wrap(cls):
        return type(f"{cls.__name__}Wrapped", (cls,), {})

    def projection(spec, path):
        block, slot = path.split(".")
        value = getattr(block_submodules(getattr(spec.submodules, block)), slot)
        return value.module if isinstance(value, ModuleSpec) else value

    for base in (  # projections as classes (local spec) and as ModuleSpecs (fp8ops' spec)
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        get_gpt_layer_fp8_emulated_spec(DelayedScalingRecipe(amax_history_len=4)),
        mlp_as_partial(get_gpt_layer_local_spec()),  # megatron-core 0.18's MLP block
    ):
        swapped = with_bf16_capable_projections(base, wrap=wrap)
        for path in PROJECTIONS:
            original, now = projection(base, path), projection(swapped, path)
            assert now.__name__ == f"{original.__name__}Wrapped" and issubclass(now, original)
        attention = swapped.submodules.self_attention.submodules
        assert attention.core_attention is base.submodules.self_attention.submodules.core_attention
        assert swapped.submodules.input_layernorm is base.submodules.input_layernorm


def test_a_bf16_capable_class_keeps_its_forward_while_fp8_is_enabled():
    import torch

    from fp8ops.megatron.te_backend import bf16_capable

    capable = bf16_capable(torch.nn.Linear)
    assert capable is bf16_capable(torch.nn.Linear)  # one subclass per class
    layer = capable(4, 3)
    assert layer.fp8_enabled is True and type(layer).__name__ == "LinearBf16Capable"
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_bf16_modules_come_from_the_overrides_and_must_be_projections(manifest):
    from fp8ops.megatron.te_backend import bf16_module_names

    overridden = derive(
        manifest,
        {"precision.overrides": [{"module": "decoder.layers.1.mlp.linear_fc2", "reason": "r"}]},
        "a fallback",
    )
    assert bf16_module_names(overridden, ["decoder.layers.0.self_attention.linear_qkv"]) == {
        "decoder.layers.1.mlp.linear_fc2",
        "decoder.layers.0.self_attention.linear_qkv",
    }
    layers = manifest.model.num_layers
    with pytest.raises(
        Fp8opsError, match=rf"decoder.layers.{layers}.mlp.linear_fc1, which are not"
    ):
        bf16_module_names(manifest, [f"decoder.layers.{layers}.mlp.linear_fc1"])
    with pytest.raises(Fp8opsError, match="decoder.output_layer"):
        bf16_module_names(manifest, ["decoder.output_layer"])


@needs_te
def test_a_te_module_in_bf16_keeps_its_state_while_the_others_train(manifest):  # pragma: no cover
    import torch
    import torch.distributed as dist

    from fp8ops.megatron.compat import parallel_state
    from fp8ops.train.distributed import _free_port

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    held = "decoder.layers.0.mlp.linear_fc1"
    model = build_gpt_te(manifest, bf16_modules=[held])
    modules = dict(model.named_modules())
    s = manifest.model.seq_length
    tokens = torch.randint(0, 256, (2, s), device="cuda")
    positions = torch.arange(s, device="cuda").expand(2, s)
    for _ in range(3):
        model(tokens, positions, None, labels=tokens).float().mean().backward()
    frozen = modules[held].fp8_meta.get("scaling_fwd")
    if frozen is not None:  # TE may not even build the state of a module never run in FP8
        assert torch.equal(frozen.scale, torch.ones_like(frozen.scale))
        assert not frozen.amax_history.any()
    trained = modules["decoder.layers.0.mlp.linear_fc2"].fp8_meta["scaling_fwd"]
    assert not torch.equal(trained.scale, torch.ones_like(trained.scale))
    assert torch.isfinite(trained.scale).all()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@needs_te
def test_telemetry_reads_a_te_model(manifest):  # pragma: no cover - GPU with TE only
    """What tests/test_te_telemetry.py checks against a stand-in, against TE itself: the row's
    state is TE's fp8_meta, the GEMMs are counted, and a statistics step recounts the casts."""
    import math

    import torch
    import torch.distributed as dist

    from fp8ops.megatron import mark_first_microbatch
    from fp8ops.megatron.compat import parallel_state
    from fp8ops.megatron.te_telemetry import te_telemetry_modules
    from fp8ops.precision import DelayedScalingRecipe
    from fp8ops.telemetry.catalogue import COLUMN
    from fp8ops.telemetry.collector import TelemetryCollector
    from fp8ops.train.distributed import _free_port

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_gpt_te(manifest)
    modules = te_telemetry_modules(model, DelayedScalingRecipe.from_precision(manifest.precision))
    collector = TelemetryCollector(modules, Telemetry(every_steps=2, error_sample_every=2))
    s = manifest.model.seq_length
    tokens = torch.randint(0, 256, (2, s), device="cuda")
    positions = torch.arange(s, device="cuda").expand(2, s)
    rows = []
    for step in (1, 2):
        mark_first_microbatch(model)
        collector.begin_step(step)
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        rows.append(collector.end_step().result())
        model.zero_grad()
    qkv, proj = (
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.0.self_attention.linear_proj",
    )
    row = rows[1]
    at = collector.names.index
    te_scale = model.get_submodule(qkv).fp8_meta["scaling_fwd"].scale
    assert row[at(qkv), COLUMN["input.scale"]] == te_scale[0].item()
    assert row[at(qkv), COLUMN["fp8_gemms"]] == 3
    for metric in ("weight.saturation", "grad_output.underflow"):
        assert math.isfinite(row[at(qkv), COLUMN[metric]]), metric
    assert math.isfinite(row[at(proj), COLUMN["input.saturation"]])  # a plain Linear
    assert math.isnan(row[at(qkv), COLUMN["input.saturation"]])  # a LayerNormLinear
    assert math.isnan(rows[0][at(qkv), COLUMN["weight.saturation"]])  # step 1 does not measure
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
