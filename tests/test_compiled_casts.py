"""The compiled FP8 casts (fp8ops/precision/compiled.py), exercised on the CPU.

On a GPU they compile to Triton kernels; here ``FP8OPS_COMPILED_CASTS=all`` compiles them with
Inductor's C++ backend, which runs the same verification and dispatch code. Each test compares
against the eager functions, so a compiled cast that rounds, saturates or counts differently
fails here. The tests that compile (seconds each, and a minute for Inductor's first) are marked
slow: the fast tier keeps the modes, the fallbacks and the probes.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

from fp8ops.precision import E4M3, E5M2, DelayedScalingRecipe, Fp8Linear, Fp8Scope
from fp8ops.precision.compiled import (
    Compiled,
    cast_probes,
    probe_tensor,
    same_bits,
    set_compiled_casts,
)
from fp8ops.precision.quantize import amax_of, cast, cast_and_amax, quantize

# The package exports the function quantize under the module's name, hence import_module.
quantize_module = importlib.import_module("fp8ops.precision.quantize")
linear_module = importlib.import_module("fp8ops.precision.linear")


@pytest.fixture
def compile_everywhere():
    old = set_compiled_casts("all")
    yield
    set_compiled_casts(old)


def sample(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(257, 33, generator=generator) * torch.exp2(
        torch.randint(-24, 24, (257, 33), generator=generator).float()
    )
    x[0, :6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-42])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.slow
def test_the_compiled_cast_and_amax_equal_the_eager_ones(compile_everywhere, dtype, fp8):
    # Exact: element-wise IEEE operations and a max, whose results do not depend on the order
    # or the vector width a kernel computes them in.
    x = sample(dtype)
    for scale in (1.0, 0.37, 2.0**-12, 1e4):
        scale = torch.tensor(scale)
        quantized, amax = cast_and_amax(x, scale, fp8)
        eager = cast(x, scale, fp8)
        assert same_bits(quantized.data, eager.data)  # a NaN's FP8 byte may differ
        assert torch.equal(quantized.scale_inv, eager.scale_inv)
        assert same_bits(amax, amax_of(x))
    key = ("cpu", str(dtype).removeprefix("torch."), str(fp8.torch_dtype).removeprefix("torch."))
    assert quantize_module._CAST_AND_AMAX.statuses(*key, "False") == {"compiled"}


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.slow
def test_a_cast_with_its_transposed_copy_equals_the_eager_one(compile_everywhere, fp8):
    x, scale = sample(torch.bfloat16), torch.tensor(0.37)
    quantized, amax = cast_and_amax(x, scale, fp8, transposed=True)
    _, stats_quantized = None, quantize(x, scale, fp8, transposed=True)[0]
    eager = cast(x, scale, fp8).data
    for q in (quantized, stats_quantized):
        assert same_bits(q.data, eager) and same_bits(q.data_t, eager.t().contiguous())
        assert q.data_t.is_contiguous() and same_bits(q.transposed().data, q.data_t)
    assert same_bits(amax, amax_of(x))
    key = ("cpu", "bfloat16", str(fp8.torch_dtype).removeprefix("torch."), "True")
    assert quantize_module._CAST_AND_AMAX.statuses(*key) == {"compiled"}
    assert quantize_module._CAST_WITH_STATS.statuses(*key) == {"compiled"}


@pytest.mark.slow
def test_the_transposed_copy_of_a_3d_tensor_is_that_of_its_rows(compile_everywhere):
    x = sample(torch.float32)[:256].reshape(16, 16, 33)  # [s, b, h]
    quantized, _ = cast_and_amax(x, torch.tensor(1.0), E4M3, transposed=True)
    assert quantized.data.shape == x.shape
    assert same_bits(quantized.data_t, quantized.data.reshape(256, 33).t().contiguous())


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.slow
def test_the_compiled_statistics_equal_the_eager_ones(compile_everywhere, fp8):
    x = sample(torch.bfloat16)
    scale = torch.tensor(fp8.max / 3.0)  # saturates the large entries, underflows the tiny ones
    compiled_q, compiled_stats = quantize(x, scale, fp8)
    set_compiled_casts("off")
    eager_q, eager_stats = quantize(x, scale, fp8)
    assert same_bits(compiled_q.data, eager_q.data)
    assert compiled_stats.as_dict() == eager_stats.as_dict()
    counts = eager_stats.as_dict()
    assert counts["saturated"] > 0 and counts["underflow"] > 0  # the case tests something
    assert counts["nan"] == 1 and counts["inf"] == 2


@pytest.mark.slow
def test_a_compiled_cast_that_differs_is_not_used(compile_everywhere):
    def off_by_one_when_compiled(x, scale, fp8_max, dtype):
        data = (x.float() * scale).clamp(-fp8_max, fp8_max)
        if torch.compiler.is_compiling():  # what a miscompilation would look like
            data = data * 2
        return (data.to(dtype),)

    cast_fn = Compiled(off_by_one_when_compiled, probes=cast_probes)
    x, scale = sample(torch.float32), torch.tensor(1.0)
    with pytest.warns(UserWarning, match="differs from the eager result"):
        (data,) = cast_fn(x, scale, E4M3.max, E4M3.torch_dtype)
    (eager,) = off_by_one_when_compiled(x, scale, E4M3.max, E4M3.torch_dtype)
    assert same_bits(data, eager)
    (status,) = cast_fn.statuses("cpu", "float32", "float8_e4m3fn")
    assert "output 0 differs" in status


def test_a_cast_that_does_not_compile_runs_eager(compile_everywhere):
    def with_a_graph_break(x, scale, fp8_max, dtype):
        torch._dynamo.graph_break()  # fullgraph=True refuses it
        return ((x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype),)

    cast_fn = Compiled(with_a_graph_break)
    x = sample(torch.float32)
    with pytest.warns(UserWarning, match="compilation failed"):
        (data,) = cast_fn(x, torch.tensor(2.0), E5M2.max, E5M2.torch_dtype)
    assert same_bits(data, cast(x, torch.tensor(2.0), E5M2).data)
    (status,) = cast_fn.statuses("cpu", "float32", "float8_e5m2")
    assert status.startswith("compilation failed")


def test_on_the_cpu_auto_and_off_never_compile():
    calls = []

    def counted(x, scale, fp8_max, dtype):
        calls.append(torch.compiler.is_compiling())
        return ((x.float() * scale).to(dtype),)

    cast_fn = Compiled(counted)
    for mode in ("auto", "off"):
        old = set_compiled_casts(mode)
        try:
            cast_fn(sample(torch.float32), torch.tensor(1.0), E4M3.max, E4M3.torch_dtype)
        finally:
            set_compiled_casts(old)
    assert calls == [False, False] and cast_fn.status == {}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="use one of"):
        set_compiled_casts("sometimes")
    env = dict(os.environ, FP8OPS_COMPILED_CASTS="sometimes")
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import fp8ops.precision.compiled"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "FP8OPS_COMPILED_CASTS='sometimes'" in result.stderr


def test_the_probe_covers_every_bfloat16_value_and_the_special_ones():
    probe = probe_tensor(torch.bfloat16, torch.device("cpu"))
    patterns = probe.view(torch.int16).unique()
    assert patterns.numel() == 2**16  # the specials are bfloat16 values too
    assert torch.isnan(probe).any() and torch.isinf(probe).any() and (probe == 0).any()
    floats = probe_tensor(torch.float32, torch.device("cpu"))
    assert floats.numel() > 2**16 and torch.isnan(floats).any()


def test_same_bits_tells_nan_apart_from_numbers_and_signed_zeros():
    assert same_bits(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([float("nan")]), torch.tensor([0.0]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.slow
def test_an_fp8_linear_trains_bit_identically_with_compiled_casts():
    def run(mode: str):
        old = set_compiled_casts(mode)
        try:
            torch.manual_seed(0)
            recipe = DelayedScalingRecipe(amax_history_len=4)
            layer = Fp8Linear(48, 32, recipe, dtype=torch.bfloat16)
            scope = Fp8Scope(recipe)
            outputs = []
            for step in range(3):
                layer.track_stats = step == 1  # one telemetry step: the statistics cast too
                x = torch.randn(20, 48, dtype=torch.bfloat16, requires_grad=True)
                with scope():
                    y = layer(x)
                y.float().square().sum().backward()
                stats = {k: v.as_dict() for k, v in (layer.last_cast_stats or {}).items()}
                outputs.append((y.detach(), x.grad, layer.weight.grad.clone(), stats))
                layer.weight.grad = None
            return outputs, layer.fp8_meta.state_dict()
        finally:
            set_compiled_casts(old)

    (compiled_out, compiled_state), (eager_out, eager_state) = run("all"), run("off")
    for got, want in zip(compiled_out, eager_out, strict=True):
        for g, w in zip(got[:3], want[:3], strict=True):
            assert same_bits(g, w)
        assert got[3] == want[3]
    assert compiled_out[1][3]  # the telemetry step produced statistics
    for key in eager_state:
        assert same_bits(compiled_state[key], eager_state[key]), key
    # Every cast of the ordinary steps, with the transposed copies the backward takes, ran
    # compiled: input (slot 0) and weight (slot 1) in E4M3, the gradient (slot 0) in E5M2.
    # So did the telemetry step's, which count what they did in the same call.
    for versions in (linear_module._CAST_AND_RECORD, linear_module._CAST_RECORD_AND_COUNT):
        record = versions["inductor"]
        for slot, fp8 in (("0", "float8_e4m3fn"), ("1", "float8_e4m3fn"), ("0", "float8_e5m2")):
            statuses = record.statuses("cpu", "bfloat16", slot, fp8, "True")
            assert statuses == {"compiled"}, (record.fn.__name__, slot, fp8)


@pytest.mark.parametrize(
    "mode", [pytest.param("all", marks=pytest.mark.slow), "off"]
)  # all: compiles
@pytest.mark.parametrize("transposed", [True, False])
def test_a_measuring_steps_cast_matches_quantize_and_records_its_amax(mode, transposed):
    """``cast_and_record`` with ``track``, compiled or eager, gives what ``quantize`` gives
    (bytes, transposed copy, amax, the four counts) and folds the amax into row 0 as
    ``ScalingState.record_amax`` does."""
    from fp8ops.precision.state import ScalingState

    x = sample(torch.bfloat16) * 300  # saturates at scale 1
    x[5, :3] = torch.tensor([1e-30, -1e-30, 2.0])  # underflow
    states = [ScalingState.fresh(4, 3, E4M3) for _ in range(2)]
    for state in states:
        state.amax_history[0] = torch.tensor([1.0, float("nan"), 0.0])
    old = set_compiled_casts(mode)
    try:
        track = {}
        got = linear_module.cast_and_record(x, states[0], 1, track, "input", transposed=transposed)
    finally:
        set_compiled_casts(old)
    want, want_stats = quantize(x, states[1].scale[1], E4M3, transposed=transposed)
    states[1].record_amax(1, want_stats.amax)
    assert same_bits(got.data, want.data)
    assert (got.data_t is None) != transposed
    if transposed:
        assert same_bits(got.data_t, want.data_t)
    stats = track["input"]
    assert same_bits(stats.amax, want_stats.amax) and math.isinf(stats.amax)
    assert torch.equal(stats.counts, want_stats.counts) and stats.numel == x.numel()
    assert (stats.counts > 0).all(), stats.counts  # each of the four occurs
    assert same_bits(states[0].amax_history, states[1].amax_history)
    if mode == "all":
        record = linear_module._CAST_RECORD_AND_COUNT["inductor"]
        assert record.statuses("cpu", "bfloat16", "1", str(transposed)) == {"compiled"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_casts_compile_by_default_and_equal_the_cpus():
    old = set_compiled_casts("auto")
    try:
        x, scale = sample(torch.bfloat16), torch.tensor(0.37)
        for fp8 in (E4M3, E5M2):
            quantized, amax = cast_and_amax(x.cuda(), scale.cuda(), fp8)
            assert same_bits(quantized.data.cpu(), cast(x, scale, fp8).data)
            assert same_bits(amax.cpu(), amax_of(x))
            key = (str(x.cuda().device), "bfloat16", str(fp8.torch_dtype).removeprefix("torch."))
            assert quantize_module._CAST_AND_AMAX.statuses(*key, "False") == {"compiled"}
    finally:
        set_compiled_casts(old)


@pytest.mark.slow
def test_more_variants_than_dynamos_default_limit_all_compile(compile_everywhere):
    """Input dtype x FP8 format x transposed copy: 12 specialisations of one function, past
    Dynamo's default recompile limit of 8."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fp8 in (E4M3, E5M2):
            for transposed in (False, True):
                x = sample(torch.float32).clamp(-6e4, 6e4).to(dtype)
                cast_and_amax(x, torch.tensor(0.5), fp8, transposed=transposed)
                key = (
                    "cpu",
                    str(dtype).removeprefix("torch."),
                    str(fp8.torch_dtype).removeprefix("torch."),
                    str(transposed),
                )
                assert quantize_module._CAST_AND_AMAX.statuses(*key) == {"compiled"}, key


@pytest.mark.slow
def test_a_compiled_function_that_writes_its_input_differently_is_not_used(compile_everywhere):
    def record(x, history, scale, fp8_max, dtype):
        amax = x.float().abs().amax()
        if torch.compiler.is_compiling():
            amax = amax * 2  # the output is right, the write into the history is not
        history[0] = torch.fmax(history[0], amax)
        return ((x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype),)

    record_fn = Compiled(record)
    x, history = sample(torch.float32).nan_to_num(0.0, 1.0, -1.0), torch.zeros(4)
    with pytest.warns(UserWarning, match="an input it writes differs"):
        record_fn(x, history, torch.tensor(1.0), E4M3.max, E4M3.torch_dtype)
    assert history[0] == x.abs().amax()  # the eager write, once


@pytest.mark.slow
def test_a_call_with_a_dimension_of_size_one_is_verified_on_its_own(compile_everywhere):
    """Dynamo compiles size-1 dimensions as constants, another graph: it gets its own key,
    verified with a probe of that shape, not run unverified under the first key's status."""
    x = sample(torch.bfloat16)
    cast_and_amax(x, torch.tensor(1.0), E4M3)
    for row in (x[:1], x[:, :1]):
        quantized, amax = cast_and_amax(row, torch.tensor(0.37), E4M3)
        assert same_bits(quantized.data, cast(row, torch.tensor(0.37), E4M3).data)
        assert same_bits(amax, amax_of(row))
    compiled = quantize_module._CAST_AND_AMAX
    for pattern in ("size1:nn", "size1:1n", "size1:n1"):
        assert compiled.statuses("cpu", "bfloat16", pattern, "float8_e4m3fn") == {"compiled"}


@pytest.mark.slow
def test_an_error_that_is_not_the_compilers_is_raised_and_keeps_the_compiled_kernel(
    compile_everywhere,
):
    """Running out of memory in a verified kernel is the caller's problem, not a reason to run
    eager for the rest of the job. (The failure is injected where the compiled kernel runs.)"""

    def scaled(x, scale, fp8_max, dtype):
        return ((x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype),)

    cast_fn = Compiled(scaled, probes=cast_probes)
    x = sample(torch.float32).nan_to_num(0.0, 1.0, -1.0)
    cast_fn(x, torch.tensor(1.0), E4M3.max, E4M3.torch_dtype)  # verified, compiled

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    cast_fn._compiled = out_of_memory
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        cast_fn(x, torch.tensor(1.0), E4M3.max, E4M3.torch_dtype)
    assert cast_fn.statuses("cpu", "float32") == {"compiled"}


@pytest.mark.slow
def test_an_amax_history_of_one_entry_is_verified_on_its_own(compile_everywhere):
    """The history is an argument with a size-1 dimension when amax_history_len is 1: Dynamo
    compiles that as another graph, so it gets its own key and verification."""
    from fp8ops.precision.state import Fp8Meta

    x = sample(torch.bfloat16)
    for length in (16, 1):
        state = Fp8Meta.fresh(DelayedScalingRecipe(amax_history_len=length)).forward
        quantized = linear_module.cast_and_record(x, state, 0, None, "input")
        assert same_bits(quantized.data, cast(x, torch.tensor(1.0), E4M3).data)
        assert same_bits(state.amax_history[0, 0], amax_of(x))
    record = linear_module._CAST_AND_RECORD["inductor"]
    for pattern in ("arg0:nn", "arg0:1n"):
        assert record.statuses("cpu", "bfloat16", pattern) == {"compiled"}, pattern


def test_the_cast_path_a_run_records_follows_both_switches():
    old_mode = set_compiled_casts("auto")
    old_kernel = linear_module.set_cast_kernel("inductor")
    try:
        assert linear_module.cast_path("cpu") == "eager"  # auto compiles CUDA tensors only
        set_compiled_casts("all")
        assert linear_module.cast_path("cpu") == "compiled: inductor"
        linear_module.set_cast_kernel("triton")
        assert linear_module.cast_path("cpu") == "compiled: triton"
        set_compiled_casts("off")
        assert linear_module.cast_path("cuda") == "eager"
        set_compiled_casts("all")
        linear_module.set_cast_kernel("auto")  # Triton's kernel needs a GPU; Inductor's not
        assert linear_module.cast_path("cuda:0") == "compiled: triton"
        assert linear_module.cast_path("cpu") == "compiled: inductor"
    finally:
        set_compiled_casts(old_mode)
        linear_module.set_cast_kernel(old_kernel)


@pytest.mark.slow
def test_under_auto_a_cpu_tensor_is_cast_by_inductors_kernel(compile_everywhere, monkeypatch):
    """``auto`` picks per tensor, not per process: on the CPU the cast goes to the Inductor
    version, never to the Triton kernel's (which needs a GPU)."""
    from fp8ops.precision.state import Fp8Meta

    called = []
    versions = {
        name: lambda *args, name=name, version=version: called.append(name) or version(*args)
        for name, version in linear_module._CAST_AND_RECORD.items()
    }
    monkeypatch.setattr(linear_module, "_CAST_AND_RECORD", versions)
    old_kernel = linear_module.set_cast_kernel("auto")
    try:
        x = sample(torch.bfloat16)[:64].reshape(32, -1)
        state = Fp8Meta.fresh(DelayedScalingRecipe(amax_history_len=4)).forward
        quantized = linear_module.cast_and_record(x, state, 0, None, "input", transposed=True)
    finally:
        linear_module.set_cast_kernel(old_kernel)
    assert called == ["inductor"]
    assert same_bits(quantized.data, cast(x, torch.tensor(1.0), E4M3).data)


@pytest.mark.parametrize(
    ("variable", "module", "attribute", "default", "choices"),
    [
        ("FP8OPS_COMPILED_CASTS", "compiled", "_mode", "auto", "['all', 'auto', 'off']"),
        ("FP8OPS_CAST_KERNEL", "linear", "_cast_kernel", "auto", "['auto', 'inductor', 'triton']"),
    ],
)
@pytest.mark.slow
def test_an_unknown_choice_in_the_environment_falls_back_with_a_warning(
    variable, module, attribute, default, choices
):
    code = f"import fp8ops.precision.{module} as m; print(m.{attribute})"
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, variable: "Cutlass"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == default
    assert f"{variable}='cutlass' is not one of {choices}; using '{default}'" in result.stderr
