"""The FP8 Megatron GPT on one process (TP=1): structure, FP8 state, equivalence with Megatron's
local GPT outside a scope, and the CPU shims. The TP=2 checks are in test_megatron_tp.py."""

import functools
import importlib.util
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from support.example_manifests import TINY
from support.megatron_specs import mlp_as_partial

if importlib.util.find_spec("megatron") is None:  # not importorskip: fp8ops.megatron imports it
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.manifest import derive, load_manifest
from fp8ops.megatron import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    amax_reduction_group,
    apply_cpu_shims,
    build_gpt,
    fp8_modules,
    get_gpt_layer_fp8_emulated_spec,
    mark_first_microbatch,
    with_fp8_projections,
)
from fp8ops.megatron.compat import (
    ColumnParallelLinear,
    filesystem_async,
    get_gpt_layer_local_spec,
    language_module,
    megatron_random,
)
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope

# Megatron's own deprecation notices, raised by its local spec and layers whatever fp8ops does.
pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

PROJECTIONS = {
    "self_attention.linear_qkv": Fp8ColumnParallelLinear,
    "self_attention.linear_proj": Fp8RowParallelLinear,
    "mlp.linear_fc1": Fp8ColumnParallelLinear,
    "mlp.linear_fc2": Fp8RowParallelLinear,
}
INPUT, WEIGHT, OUTPUT = 0, 1, 2
GRAD_OUTPUT, GRAD_INPUT = 0, 1


@pytest.fixture(scope="module", autouse=True)
def _megatron_tp1(megatron_tp1):
    """Every test here runs on a one-rank TP=1 Megatron (tests/conftest.py)."""


@pytest.fixture(scope="module")
def manifest():
    """The CPU default without its base: its weights drawn by global name (init.py)."""
    return derive(load_manifest(TINY), {"model.init_checkpoint": None}, "no base")


@pytest.fixture(scope="module")
def recipe(manifest):
    return DelayedScalingRecipe.from_precision(manifest.precision)


@pytest.fixture
def model(manifest, recipe):
    return build_gpt(manifest, recipe)


@pytest.fixture
def scope(manifest, recipe):
    return Fp8Scope(recipe, group=amax_reduction_group(manifest.topology))


def make_batch(manifest, seed=0):
    """(tokens, position ids, labels), each [b, s]: random byte tokens, next-token labels."""
    b, s = manifest.schedule.micro_batch_size, manifest.model.seq_length
    tokens = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], torch.arange(s).expand(b, s), tokens[:, 1:]


def loss_of(model, batch, attention_mask=None):
    tokens, positions, labels = batch
    return model(tokens, positions, attention_mask, labels=labels).mean()  # float32


def fp8_step(model, scope, batch):
    with scope():
        loss = loss_of(model, batch)
    loss.backward()
    return loss


# -- structure -------------------------------------------------------------------------------


def test_fp8_modules_are_the_four_projections_under_te_spec_names(model, manifest):
    expected = {
        f"decoder.layers.{i}.{name}": cls
        for i in range(manifest.model.num_layers)
        for name, cls in PROJECTIONS.items()
    }
    found = fp8_modules(model)
    assert {name: type(module) for name, module in found.items()} == expected
    # Embedding, LM head and norms stay Megatron's plain modules.
    assert type(model.output_layer) is ColumnParallelLinear
    for name, module in model.named_modules():
        if name not in expected:
            assert not isinstance(module, tuple(PROJECTIONS.values())), name
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # precision.base_dtype


def test_spec_transform_refuses_a_spec_it_does_not_know(recipe):
    already_fp8 = get_gpt_layer_fp8_emulated_spec(recipe)
    with pytest.raises(ValueError, match="self_attention.linear_qkv"):
        with_fp8_projections(already_fp8, recipe)


def test_spec_transform_swaps_an_mlp_given_as_megatron_018s_partial(recipe):
    local = mlp_as_partial(get_gpt_layer_local_spec())
    before = repr(local)
    swapped = with_fp8_projections(local, recipe)
    assert repr(local) == before  # the given spec is not modified

    mlp = swapped.submodules.mlp
    assert isinstance(mlp, functools.partial) and mlp.func is local.submodules.mlp.func
    assert mlp.keywords.keys() == {"submodules"}
    fc1, fc2 = mlp.keywords["submodules"].linear_fc1, mlp.keywords["submodules"].linear_fc2
    assert (fc1.module, fc2.module) == (Fp8ColumnParallelLinear, Fp8RowParallelLinear)
    assert fc1.params["recipe"] is recipe and fc2.params["recipe"] is recipe
    assert swapped.submodules.self_attention.submodules.linear_qkv.module is Fp8ColumnParallelLinear

    # An MLP already swapped is refused, in this shape too.
    swapped_mlp_only = replace(local, submodules=replace(local.submodules, mlp=mlp))
    with pytest.raises(ValueError, match="mlp.linear_fc1"):
        with_fp8_projections(swapped_mlp_only, recipe)


def test_build_checks_the_topology_against_megatrons_parallel_state(manifest, recipe):
    tp2 = derive(manifest, {"topology.tensor_parallel": 2}, "mismatch")
    with pytest.raises(ValueError, match="TP, PP, DP"):
        build_gpt(tp2, recipe)


# -- outside a scope: Megatron's local GPT -----------------------------------------------------


@pytest.mark.slow
def test_outside_a_scope_the_model_is_megatrons_local_gpt(model, manifest):
    plain = build_gpt(manifest, None)  # Megatron's own local spec, same seed
    ours = dict(model.named_parameters())
    theirs = dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name

    batch = make_batch(manifest)
    loss, plain_loss = loss_of(model, batch), loss_of(plain, batch)
    # Exact: outside a scope our layers call the same torch operations on the same operands.
    assert torch.equal(loss, plain_loss)
    loss.backward()
    plain_loss.backward()
    for name, param in ours.items():
        assert torch.equal(param.grad, theirs[name].grad), name


def test_each_weight_is_drawn_from_the_seed_and_its_global_name(model, manifest):
    """fp8ops/megatron/init.py: a weight follows from ``seeds.model`` and its global name alone
    (so a pipeline stage draws its layers as the whole model does), by Megatron's own
    initialisation: fc2 and the attention output scaled by depth, norms and biases constant."""
    from fp8ops.megatron.init import _seed, init_by_global_name

    params = dict(model.named_parameters())
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    torch.manual_seed(_seed(manifest.seeds.model, name))
    alone = torch.empty(params[name].shape)
    model.config.init_method(alone)
    assert torch.equal(params[name], alone.to(params[name].dtype))  # the same draw, TP 1
    std = model.config.init_method_std
    fc2 = params["decoder.layers.0.mlp.linear_fc2.weight"].float()
    assert fc2.std().item() == pytest.approx(
        std / math.sqrt(2 * manifest.model.num_layers), rel=0.05
    )
    assert not torch.equal(params[name], params["decoder.layers.0.mlp.linear_fc1.weight"])

    other = build_gpt(derive(manifest, {"seeds.model": manifest.seeds.model + 1}, "test"), None)
    assert not torch.equal(dict(other.named_parameters())[name], params[name])

    model.register_parameter("extra", torch.nn.Parameter(torch.randn(3)))
    with pytest.raises(RuntimeError, match="extra: a parameter drawn at random"):
        init_by_global_name(model, model.config, manifest.seeds.model, 0, 1)


def test_a_model_whose_base_overwrites_it_is_not_drawn_again(manifest, recipe, monkeypatch):
    """A fine-tuning run loads model.init_checkpoint over every weight: every rank drew every
    whole weight again by name first, for nothing."""
    from fp8ops.megatron import model as model_module

    drawn = []
    monkeypatch.setattr(model_module, "init_by_global_name", lambda *args: drawn.append(args))
    fine_tuning = derive(manifest, {"model.init_checkpoint": "base/final"}, "a base")
    build_gpt(fine_tuning, recipe)
    assert drawn == []
    build_gpt(manifest, recipe)  # from scratch: drawn
    assert len(drawn) == 1


# -- inside a scope: FP8 -------------------------------------------------------------------------


@pytest.mark.slow
def test_one_step_gives_finite_values_and_real_scales(model, scope, manifest):
    loss = fp8_step(model, scope, make_batch(manifest))
    assert math.isfinite(loss.item())
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), name
    for name, module in fp8_modules(model).items():
        forward, backward = module.fp8_meta.forward.scale, module.fp8_meta.backward.scale
        for slot, scale in (
            ("input", forward[INPUT]),
            ("weight", forward[WEIGHT]),
            ("grad_output", backward[GRAD_OUTPUT]),
        ):
            assert torch.isfinite(scale) and scale != 1.0, f"{name} {slot}"
        # No FP8 output is requested, so those slots stay as TE leaves them.
        assert forward[OUTPUT] == 1.0 and backward[GRAD_INPUT] == 1.0


@pytest.mark.slow
def test_amax_histories_roll_once_per_update(model, scope, manifest):
    steps = 3
    for seed in range(steps):
        fp8_step(model, scope, make_batch(manifest, seed))
    length = manifest.precision.amax_history_len
    for name, module in fp8_modules(model).items():
        for history in (
            module.fp8_meta.forward.amax_history[:, [INPUT, WEIGHT]],
            module.fp8_meta.backward.amax_history[:, [GRAD_OUTPUT]],
        ):
            assert history.shape[0] == length
            # [0 (accumulator, cleared), zeros not reached yet, one amax per update]
            assert (history[: length - steps] == 0).all(), name
            assert (history[length - steps :] > 0).all(), name


@pytest.mark.slow
def test_fp8_loss_is_close_to_but_not_the_high_precision_loss(model, scope, manifest):
    fp8_step(model, scope, make_batch(manifest, seed=1))  # scales from real amaxes, not 1
    batch = make_batch(manifest, seed=2)
    with torch.no_grad():
        high_precision = loss_of(model, batch).item()
        with scope():
            fp8 = loss_of(model, batch).item()
    assert fp8 != high_precision
    # Observed: 1e-4 to 3e-4 on a loss of 5.56; E4M3 has 3 mantissa bits, so single products
    # are off by up to 6%, but the errors are unbiased and average out over the sums.
    assert abs(fp8 - high_precision) < 2e-3


@pytest.mark.slow
def test_weight_is_cast_once_per_step_across_micro_batches(model, scope, manifest):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, micro_batches = 2, 2
    for step in range(steps):
        mark_first_microbatch(model)
        for micro in range(micro_batches):
            fp8_step(model, scope, make_batch(manifest, seed=10 * step + micro))
        optimizer.step()
        optimizer.zero_grad()
    for name, module in fp8_modules(model).items():
        history = module.fp8_meta.forward.amax_history
        assert (history[:, WEIGHT] > 0).sum() == steps, name
        assert (history[:, INPUT] > 0).sum() == steps * micro_batches, name

    # Reusing the FP8 weight after the optimizer changed it would train on stale values.
    with pytest.raises(RuntimeError, match="mark_first_microbatch"):
        fp8_step(model, scope, make_batch(manifest))


def test_a_scope_with_another_recipe_is_refused(model, manifest):
    other = Fp8Scope(DelayedScalingRecipe(amax_history_len=8))
    with pytest.raises(ValueError, match="same recipe"), other():
        loss_of(model, make_batch(manifest))


@pytest.mark.slow
def test_fp8_state_travels_in_extra_state(model, scope, manifest, recipe):
    fp8_step(model, scope, make_batch(manifest))
    state = model.state_dict()
    extra = state["decoder.layers.0.mlp.linear_fc1._extra_state"]
    assert set(extra) == {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"}

    restored = build_gpt(manifest, recipe)
    restored.load_state_dict(state)
    for name, module in fp8_modules(restored).items():
        saved = fp8_modules(model)[name].fp8_meta.state_dict()
        for key, value in module.fp8_meta.state_dict().items():
            assert torch.equal(value, saved[key]), f"{name} {key}"
    build_gpt(manifest, None).load_state_dict(state)  # Megatron's own layers ignore it


# -- CPU shims -------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
def test_cpu_shims_are_idempotent_and_cover_what_megatron_needs(model, manifest):
    tracker = megatron_random.get_cuda_rng_tracker()
    apply_cpu_shims()
    apply_cpu_shims()
    assert megatron_random.get_cuda_rng_tracker() is tracker  # seeds kept
    assert torch.cuda.current_device() == "cpu"
    # Tied embeddings' last-stage copy stays on the CPU only inside Megatron's setup call.
    setup = language_module.LanguageModule.setup_embeddings_and_output_layer
    assert setup.cpu_shim and "cuda" not in torch.Tensor.__dict__
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.zeros(1).cuda()
    # The checkpoint writer's host copy no longer waits on CUDA.
    assert filesystem_async.FileSystemWriterAsync.preload_tensors([], non_blocking=True) == []
    # No mask given: the shimmed default causal mask equals an explicit one.
    s = manifest.model.seq_length
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)  # True = masked out
    batch = make_batch(manifest)
    with torch.no_grad():
        assert torch.equal(loss_of(model, batch), loss_of(model, batch, attention_mask=causal))


@pytest.mark.parametrize(
    "layer_cls, config_changes, layer_kwargs, message",
    [
        (
            Fp8RowParallelLinear,
            {"recompute_granularity": "selective"},
            {"input_is_parallel": True},
            "activation recomputation",
        ),
        (Fp8ColumnParallelLinear, {}, {"disable_grad_reduce": True}, "disable_grad_reduce"),
    ],
)
@pytest.mark.filterwarnings("ignore:If you are using transformer_engine:UserWarning")
def test_unsupported_megatron_settings_fail_at_build_time(
    layer_cls, config_changes, layer_kwargs, message
):
    import dataclasses

    from fp8ops.megatron.config import transformer_config

    config = dataclasses.replace(transformer_config(load_manifest(TINY)), **config_changes)
    with pytest.raises(NotImplementedError, match=message):
        layer_cls(
            64,
            64,
            recipe=DelayedScalingRecipe(amax_history_len=16),
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=True,
            skip_bias_add=False,
            **layer_kwargs,
        )


def test_vocabulary_padding_does_not_depend_on_tensor_parallel_size():
    from fp8ops.megatron.config import padded_vocab_size

    assert {padded_vocab_size(256, tp) for tp in (1, 2, 4, 8)} == {256}
    assert {padded_vocab_size(50257, tp) for tp in (1, 2, 4, 8)} == {50304}
    assert {padded_vocab_size(128256, tp) for tp in (1, 2, 4, 8)} == {128256}
    # Only where TP does not divide the 128-padded size does it pad further, as Megatron-LM does.
    assert padded_vocab_size(100, 3) == 384


def test_megatron_imports_on_the_cpu_with_its_jit_fuser_off():
    """Megatron's fused functions stay plain (its own switch): no ``torch.compile`` at import,
    so inductor is never loaded, and the import hook is gone afterwards."""
    probe = (
        "import sys, types, fp8ops.megatron\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_geglu\n"
        "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
        "assert isinstance(fused_bias_geglu.geglu, types.FunctionType)\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "assert not any(type(f).__name__ == '_JitFuserOff' for f in sys.meta_path)\n"
    )
    if torch.cuda.is_available():
        pytest.skip("a GPU machine imports Megatron as it is")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
