"""The telemetry collector on a real Megatron GPT (TP=1): what one step's row holds."""

import importlib.util
import math

import numpy as np
import pytest
import torch
from support.example_manifests import TINY

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.schema import Telemetry
from fp8ops.megatron import build_gpt, fp8_modules, mark_first_microbatch
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES
from fp8ops.telemetry.collector import TelemetryCollector
from fp8ops.telemetry.probe import Probe

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]
MICRO_BATCHES = 2
# On a GPU machine the model is built on the GPU, as the trainer builds it there: Megatron's
# local attention makes its default causal mask on the current CUDA device, so a CPU model on
# a machine with CUDA cannot run (the CPU shims only apply where there is none).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module", autouse=True)
def _megatron_tp1(megatron_tp1):
    """Every test here runs on a one-rank TP=1 Megatron (tests/conftest.py)."""


@pytest.fixture
def setup():
    return make_setup()


def make_setup(**changes):
    manifest = derive(
        load_manifest(TINY),
        {
            "model.num_layers": 2,
            "model.hidden_size": 64,
            "model.ffn_hidden_size": 256,
            "model.seq_length": 32,
            "model.init_checkpoint": None,
            "telemetry.every_steps": 2,
            "telemetry.error_sample_every": 2,
            **changes,
        },
        "collector test",
    )
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    model = build_gpt(manifest, recipe, device=DEVICE)
    modules = fp8_modules(model)
    modules["decoder.layers.0.mlp.linear_fc1"].fp8_enabled = False  # held in bf16
    collector = TelemetryCollector(modules, manifest.telemetry)
    return manifest, model, Fp8Scope(recipe), collector


def run_step(model, scope, collector, step, seed):
    """One step of two micro-batches; its telemetry row, finished at once."""
    row = start_step(model, scope, collector, step, seed).result()
    model.zero_grad()
    return row


def start_step(model, scope, collector, step, seed):
    """One step of two micro-batches; its telemetry row still pending (gradients kept)."""
    forward_backward(model, scope, collector, step, seed)
    return collector.end_step()


def forward_backward(model, scope, collector, step, seed):
    """One step of two micro-batches, its telemetry begun, its row not asked for."""
    mark_first_microbatch(model)
    collector.begin_step(step)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, 256, (2, 33), generator=generator).to(DEVICE)
        positions = torch.arange(32, device=DEVICE).expand(2, 32)
        with scope():
            loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()


def value(row, collector, module, metric):
    return row[collector.names.index(module), COLUMN[metric]]


def test_a_measured_step_reports_state_casts_norms_and_error(setup):
    _, model, scope, collector = setup
    run_step(model, scope, collector, 1, seed=0)  # step 1: state only (every_steps 2)
    row = run_step(model, scope, collector, 2, seed=1)
    assert row.shape == (len(collector.names), len(MODULE_METRIC_NAMES))
    assert row.dtype == np.float32
    qkv = "decoder.layers.1.self_attention.linear_qkv"
    module = collector.modules[qkv]
    forward = module.fp8_meta.forward
    # The state metrics are the module's own FP8 state, read after this step's updates.
    assert value(row, collector, qkv, "input.scale") == forward.scale[0].item()
    assert value(row, collector, qkv, "weight.amax") == forward.amax_history[-1, 1].item()
    assert value(row, collector, qkv, "input.window_max") == forward.amax_history[1:, 0].max()
    assert value(row, collector, qkv, "input.scale_change") >= 1.0
    # Every cast of the step was counted: no NaN/Inf in a healthy step, fractions in [0, 1].
    for slot in ("input", "weight", "grad_output"):
        assert value(row, collector, qkv, f"{slot}.nan") == 0
        assert 0 <= value(row, collector, qkv, f"{slot}.saturation") <= 1
        assert 0 <= value(row, collector, qkv, f"{slot}.underflow") <= 1
    # fprop + dgrad + wgrad per micro-batch, all in FP8.
    assert value(row, collector, qkv, "fp8_gemms") == 3 * MICRO_BATCHES
    assert value(row, collector, qkv, "fallback_gemms") == 0
    assert value(row, collector, qkv, "weight_norm") == pytest.approx(
        module.weight.float().norm().item(), rel=1e-6
    )
    assert value(row, collector, qkv, "grad_norm") > 0
    error = value(row, collector, qkv, "fp8_rel_error")
    assert 0 < error < 0.2  # E4M3 operands: a few percent


def test_the_amax_is_what_each_slot_fed_this_step_even_with_a_history_of_one():
    """With amax_history_len 1 (Megatron's default) the update keeps no past amax, yet each
    slot's amax is reported, and is its window. A step whose casts of a slot were all NaN fed
    no amax (TE's kernel skips it, and leaves that history as it was): NaN, not the amax of the
    step before, while the weight, cast as usual, still reports its own."""
    _, model, scope, collector = make_setup(**{"precision.amax_history_len": 1})
    qkv = "decoder.layers.1.self_attention.linear_qkv"
    row = run_step(model, scope, collector, 1, seed=0)
    weight = collector.modules[qkv].weight
    assert value(row, collector, qkv, "weight.amax") == weight.detach().abs().max().float().item()
    for slot in ("input", "weight", "grad_output"):
        amax = value(row, collector, qkv, f"{slot}.amax")
        assert np.isfinite(amax) and amax > 0, slot
        assert value(row, collector, qkv, f"{slot}.window_max") == amax, slot

    _, model, scope, collector = make_setup()
    run_step(model, scope, collector, 1, seed=0)
    input_history = collector.modules[qkv].fp8_meta.forward.amax_history[:, 0].clone()
    with torch.no_grad():
        model.embedding.word_embeddings.weight.fill_(math.nan)
    row = run_step(model, scope, collector, 2, seed=1)
    assert np.isnan(value(row, collector, qkv, "input.amax"))
    assert value(row, collector, qkv, "input.nan") > 0  # what the cast statistics say
    assert torch.equal(collector.modules[qkv].fp8_meta.forward.amax_history[:, 0], input_history)
    assert value(row, collector, qkv, "weight.amax") > 0


def test_the_error_sample_compares_every_kth_position_up_to_the_limit():
    """``error_sample_tokens``: at most that many tokens, those of every sequence at every k-th
    position of ``[s, b, h]``; the other tokens do not enter the error."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3, 16, generator=generator)  # [s, b, h]: 30 tokens
    weight, bias = torch.randn(8, 16, generator=generator), torch.randn(8, generator=generator)
    exact = torch.nn.functional.linear(x, weight, bias)
    out = exact.clone()
    # A limit of 8 takes 2 positions of 3 tokens: every 5th, 0 and 5. Damage the others.
    out[1:5] += 1.0
    out[6:] += 1.0

    def error(limit):
        probe = Probe(sample_error=True, error_tokens=limit)
        probe.fp8_call(x, out, weight, bias)
        return probe.rel_error.item()

    def expected(rows):
        return ((out[rows] - exact[rows]).norm() / exact[rows].norm()).item()

    # Undamaged tokens differ by float32 rounding at most: the probe recomputes the sampled
    # tokens' GEMM on their rows alone, another shape, which a BLAS may sum in another order
    # (measured: the same bits). Two float32 sums of the same 17 terms (16 products, the bias)
    # in any orders differ by at most 2 * 17 * 2**-24 times the sum of the terms' magnitudes;
    # relative to the tokens' values, by at most the worst token's ratio of the two (9e-6).
    magnitude = torch.nn.functional.linear(x.abs(), weight.abs(), bias.abs())
    rounding = 2 * 17 * 2.0**-24 * (magnitude.norm(dim=-1) / exact.norm(dim=-1)).max().item()
    assert error(None) == pytest.approx(expected(slice(None)), rel=1e-5)
    assert error(None) > 0.1
    assert error(30) == pytest.approx(expected(slice(None)), rel=1e-5)  # every token
    assert error(8) <= rounding  # only undamaged tokens compared
    out[5, 1] += 1.0  # a sampled token, of the second sequence
    assert error(8) == pytest.approx(expected(slice(None, None, 5)), rel=1e-5)
    assert error(8) > 0.01
    # Under b: one position (undamaged).
    assert error(2) == pytest.approx(expected(slice(0, 1)), abs=rounding)


def test_the_collector_gives_its_probes_the_manifests_token_limit(monkeypatch):
    from fp8ops.telemetry import probe

    compared = []

    def spy(x, out, limit):
        rows = sample(x, out, limit)
        compared.append(rows[0].shape[0])
        return rows

    sample = probe._token_sample
    monkeypatch.setattr(probe, "_token_sample", spy)
    manifest, model, scope, _ = make_setup()
    telemetry = manifest.telemetry.model_copy(update={"error_sample_tokens": 16})
    collector = TelemetryCollector(fp8_modules(model), telemetry)
    run_step(model, scope, collector, 1, seed=0)
    row = run_step(model, scope, collector, 2, seed=1)
    # Step 2 samples: each FP8 module compared 16 of each micro-batch's 2 x 32 tokens.
    assert compared and set(compared) == {16}
    error = value(row, collector, "decoder.layers.1.self_attention.linear_qkv", "fp8_rel_error")
    assert 0 < error < 0.2


def test_an_unmeasured_step_reports_only_the_state(setup):
    _, model, scope, collector = setup
    row = run_step(model, scope, collector, 1, seed=0)
    qkv = "decoder.layers.1.self_attention.linear_qkv"
    assert math.isfinite(value(row, collector, qkv, "input.scale"))
    for metric in (
        "input.saturation",
        "grad_output.nan",
        "input_norm",
        "grad_norm",
        "fp8_rel_error",
    ):
        assert math.isnan(value(row, collector, qkv, metric)), metric
    assert value(row, collector, qkv, "fp8_gemms") == 3 * MICRO_BATCHES  # counted every step


def test_a_bf16_module_appears_with_its_frozen_state_marked(setup):
    _, model, scope, collector = setup
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    fresh_scale = collector.modules[fc1].fp8_meta.forward.scale.clone()
    run_step(model, scope, collector, 1, seed=0)
    row = run_step(model, scope, collector, 2, seed=1)
    assert value(row, collector, fc1, "fp8_enabled") == 0
    assert value(row, collector, fc1, "input.scale") == fresh_scale[0].item()
    assert value(row, collector, fc1, "fp8_gemms") == 0
    assert value(row, collector, fc1, "fallback_gemms") == 3 * MICRO_BATCHES
    assert math.isnan(value(row, collector, fc1, "input.saturation"))
    assert math.isnan(value(row, collector, fc1, "fp8_rel_error"))  # nothing to compare


def test_slots_no_fp8_gemm_reads_are_not_applicable_and_the_gemms_are_counted_apart(setup):
    """fc2 with dgrad and wgrad in bf16 casts no gradient; proj with only fprop and dgrad in
    bf16 casts no weight. Those slots are NaN, every metric of them, while the state behind
    them stays as it was (frozen): not zero, not the frozen scale. The other slots are
    measured as before, and the GEMMs are counted in FP8 and in bf16 apart."""
    _, model, scope, collector = setup
    fc2, proj = "decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_proj"
    collector.modules[fc2].fp8_gemms = frozenset({"fprop"})
    collector.modules[proj].fp8_gemms = frozenset({"wgrad"})
    run_step(model, scope, collector, 1, seed=0)
    frozen = collector.modules[fc2].fp8_meta.backward.scale.clone()
    row = run_step(model, scope, collector, 2, seed=1)  # a measuring step
    assert torch.equal(collector.modules[fc2].fp8_meta.backward.scale, frozen)
    slot_metrics = [m for m in MODULE_METRIC_NAMES if m.startswith("grad_output.")]
    assert all(math.isnan(value(row, collector, fc2, m)) for m in slot_metrics)
    assert value(row, collector, fc2, "input.scale") > 0
    assert 0 <= value(row, collector, fc2, "weight.saturation") <= 1
    assert 0 < value(row, collector, fc2, "fp8_rel_error") < 0.2  # fprop runs FP8
    assert value(row, collector, fc2, "fp8_gemms") == MICRO_BATCHES
    assert value(row, collector, fc2, "fallback_gemms") == 2 * MICRO_BATCHES
    weight_metrics = [m for m in MODULE_METRIC_NAMES if m.startswith("weight.")]
    assert all(math.isnan(value(row, collector, proj, m)) for m in weight_metrics)
    assert 0 <= value(row, collector, proj, "grad_output.saturation") <= 1
    assert value(row, collector, proj, "input.amax") > 0
    assert math.isnan(value(row, collector, proj, "fp8_rel_error"))  # fprop is not FP8's
    assert value(row, collector, proj, "fp8_gemms") == MICRO_BATCHES
    assert value(row, collector, proj, "fp8_enabled") == 1


def test_saturation_is_measured_when_the_scale_is_stale(setup):
    _, model, scope, collector = setup
    run_step(model, scope, collector, 2, seed=0)
    fc2 = "decoder.layers.1.mlp.linear_fc2"
    with torch.no_grad():
        collector.modules[fc2].weight.mul_(64)  # amax jumps; this step's scale predates it
    row = run_step(model, scope, collector, 2, seed=1)
    assert value(row, collector, fc2, "weight.saturation") > 0.01
    other = "decoder.layers.1.self_attention.linear_proj"
    assert value(row, collector, other, "weight.saturation") == 0


def previous_quantile(ordered: np.ndarray, q: float) -> float:
    """The collector's scalar quantile before it was vectorised, verbatim."""
    position = q * (ordered.size - 1)
    low = int(position)
    high = min(low + 1, ordered.size - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def scalar_state_metrics(
    history: np.ndarray, fed: float, scale: float, previous: float | None
) -> dict:
    """One module slot's state metrics as the collector computed them before it was vectorised
    (its loop body, verbatim but for the names and the amax, now the one the slot fed this
    step: NaN where it fed none). ``history``: the float32 window, no row 0."""
    values = {
        "amax": fed if fed > 0 else np.nan,
        "scale": scale,
        "scale_inv": 1.0 / scale,
        "window_max": history.max(),
    }
    seen = np.sort(history[history > 0])
    if seen.size:
        values["window_p50"] = previous_quantile(seen, 0.5)
        values["window_p90"] = previous_quantile(seen, 0.9)
    if previous is not None:
        ratio = scale / previous
        values["scale_change"] = max(ratio, 1.0 / ratio)
    return values


def test_the_state_metrics_of_all_modules_equal_those_computed_one_by_one():
    from types import SimpleNamespace

    from fp8ops.precision import Fp8Meta
    from fp8ops.telemetry.collector import _SLOTS

    recipe = DelayedScalingRecipe(amax_history_len=8)
    rng = np.random.default_rng(5)
    metas = [Fp8Meta.fresh(recipe) for _ in range(6)]
    modules = {
        f"m{i}": SimpleNamespace(fp8_meta=m, fp8_enabled=True, probe=None)
        for i, m in enumerate(metas)
    }
    collector = TelemetryCollector(modules, Telemetry(every_steps=1, error_sample_every=1))
    previous = None
    for _ in range(3):
        for meta in metas:
            for state in (meta.forward, meta.backward):
                h = rng.lognormal(0, 3, state.amax_history.shape).astype(np.float32)
                special = rng.choice([0.0, np.nan, np.inf, 1e-42], size=h.shape)
                h = np.where(rng.random(h.shape) < 0.3, special, h).astype(np.float32)
                h[1:, 0] = 0.0 if rng.random() < 0.3 else h[1:, 0]  # a slot that never ran
                state.amax_history.copy_(torch.from_numpy(h))
                state.scale.copy_(torch.from_numpy(rng.lognormal(0, 4, state.scale.shape)))
                fed = rng.lognormal(0, 3, state.scale.shape).astype(np.float32)
                fed = np.where(rng.random(fed.shape) < 0.3, rng.choice(special.ravel()), fed)
                state.last_amax.copy_(torch.from_numpy(fed.astype(np.float32)))
        row = collector.end_step().result()
        current = {}
        for i, meta in enumerate(metas):
            for slot, forward, index in _SLOTS:
                state = meta.direction(forward)
                scale = float(state.scale[index])
                current[(i, slot)] = scale
                want = scalar_state_metrics(
                    state.amax_history[1:, index].numpy(),
                    float(state.last_amax[index]),
                    scale,
                    None if previous is None else previous[(i, slot)],
                )
                for metric in (
                    "amax",
                    "scale",
                    "scale_inv",
                    "window_max",
                    "window_p50",
                    "window_p90",
                    "scale_change",
                ):
                    got = row[i, COLUMN[f"{slot}.{metric}"]]
                    expected = np.float32(want.get(metric, np.nan))
                    assert got.tobytes() == expected.tobytes() or (
                        np.isnan(got) and np.isnan(expected)
                    ), (i, slot, metric, got, expected)
        previous = current


def same_row(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()  # NaN where nothing was measured: the same bits


@pytest.mark.slow
def test_a_row_finished_later_is_its_own_steps_row():
    """The row is copied at end_step: finishing it after later steps (which roll every history,
    change every scale and replace the gradients), and in another order, changes nothing."""
    finished_at_once, finished_later = [], []
    for late in (False, True):
        torch.manual_seed(0)
        _, model, scope, collector = make_setup()
        pending = []
        for step in range(1, 6):
            row = start_step(model, scope, collector, step, seed=step)
            with torch.no_grad():  # the optimizer's part: the weights move between steps
                for parameter in model.parameters():
                    parameter.add_(parameter.grad.sign(), alpha=1e-3)
            model.zero_grad()
            if late:
                pending.append(row)
            else:
                finished_at_once.append(row.result())
        finished_later = [row.result() for row in reversed(pending)][::-1]
    assert len(finished_later) == len(finished_at_once) == 5
    for step, (a, b) in enumerate(zip(finished_at_once, finished_later), start=1):
        assert same_row(a, b), f"step {step}"
    # The test compares something: the state moved from step to step and steps 2 and 4
    # measured (every_steps 2) what steps 1, 3 and 5 did not.
    assert not same_row(finished_at_once[0], finished_at_once[2])
    saturation = COLUMN["input.saturation"]
    assert np.isfinite(finished_at_once[1][:, saturation]).any()
    assert np.isnan(finished_at_once[2][:, saturation]).all()


def test_modules_of_different_history_lengths_are_refused():
    from types import SimpleNamespace

    from fp8ops.precision import Fp8Meta

    modules = {
        name: SimpleNamespace(fp8_meta=Fp8Meta.fresh(DelayedScalingRecipe(amax_history_len=n)))
        for name, n in (("a", 8), ("b", 16))
    }
    with pytest.raises(ValueError, match=r"amax histories of \[8, 16\] entries"):
        TelemetryCollector(modules, Telemetry(every_steps=1, error_sample_every=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_end_step_does_not_stop_the_host():
    """end_step queues its copies and returns while the GPU is still busy (torch's sync debug
    mode raises at any operation that waits for it); the row is the state as it was then."""
    from types import SimpleNamespace

    from fp8ops.precision import Fp8Meta
    from fp8ops.precision.quantize import quantize

    recipe = DelayedScalingRecipe(amax_history_len=8)
    modules = {
        f"m{i}": SimpleNamespace(
            fp8_meta=Fp8Meta.fresh(recipe), fp8_enabled=True, weight=torch.ones(4, 4, device="cuda")
        )
        for i in range(4)
    }
    for module in modules.values():
        for state in (module.fp8_meta.forward, module.fp8_meta.backward):
            state.amax_history = state.amax_history.cuda().uniform_()
            state.scale = state.scale.cuda() * 2
    collector = TelemetryCollector(modules, Telemetry(every_steps=1, error_sample_every=1))
    collector.begin_step(1)
    x = torch.tensor([[1.0, 1e6, float("nan"), 0.0]], device="cuda")
    _, stats = quantize(x, torch.tensor(1.0, device="cuda"), recipe.fp8_format.forward)
    modules["m0"].probe.measure = True
    modules["m0"].probe.cast_logs.append({"input": stats})
    history = modules["m3"].fp8_meta.backward.amax_history
    window_max = history[1:, 0].max().item()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keeps the GPU busy: the copies queue behind it
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = collector.end_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not pending.state._ready.query()  # returned before its copy ran
    history.fill_(1e9)  # the next step's in-place update, queued after the copy
    row = pending.result()
    assert row[0, COLUMN["input.scale"]] == 2.0
    assert row[3, COLUMN["grad_output.window_max"]] == np.float32(window_max)
    assert row[0, COLUMN["input.saturation"]] == 0.25  # 1e6 of 4: the int64 counts' copy
    assert row[0, COLUMN["input.nan"]] == 1


def test_a_history_of_one_entry_has_no_window_but_its_scale():
    """amax_history_len 1 (Megatron's default): the update keeps no past amax, so the window
    metrics are NaN; the scale is still reported."""
    from types import SimpleNamespace

    from fp8ops.precision import Fp8Meta

    meta = Fp8Meta.fresh(DelayedScalingRecipe(amax_history_len=1))
    meta.forward.scale[0] = 3.0
    modules = {"m": SimpleNamespace(fp8_meta=meta, fp8_enabled=True, weight=torch.ones(2, 2))}
    collector = TelemetryCollector(modules, Telemetry(every_steps=1, error_sample_every=1))
    collector.begin_step(1)
    row = collector.end_step().result()
    assert row[0, COLUMN["input.scale"]] == 3.0
    for metric in ("amax", "window_max", "window_p50", "window_p90"):
        assert np.isnan(row[0, COLUMN[f"input.{metric}"]]), metric


def test_a_replayed_step_is_reported_from_the_records_of_its_capture(setup):
    """A CUDA graph's replay runs no Python, so the probes see no GEMM: the row is built from
    the records taken after the capture, and a row built from the empty probes would report
    nothing ran. (Here the "capture" is an eager step whose records are kept.)"""
    _, model, scope, collector = setup
    forward_backward(model, scope, collector, 2, seed=0)  # a statistics step, as captured
    captured = collector.take_records()  # the probes are empty now, as a replay leaves them

    replayed = collector.end_step(records=captured).result()
    unrecorded = collector.end_step().result()
    fc2 = "decoder.layers.0.mlp.linear_fc2"
    assert value(replayed, collector, fc2, "fp8_gemms") == 3 * MICRO_BATCHES
    assert value(unrecorded, collector, fc2, "fp8_gemms") == 0
    assert np.isfinite(value(replayed, collector, fc2, "input.saturation"))
    assert np.isnan(value(unrecorded, collector, fc2, "input.saturation"))
    with pytest.raises(ValueError, match="1 records for"):
        collector.end_step(records=captured[:1])
