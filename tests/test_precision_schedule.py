"""The precision schedule in admission, on a two-layer model: the table for a step takes the GEMMs
of the phases that cover it to the base dtype, and says why; a schedule that does not fit the
model is refused naming the field; a phase to another recipe runs its modules under it, as a
``module_recipes`` entry would; and a module a phase held in BF16 or under a stateless recipe
comes back to delayed scaling from the state the phase froze."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron") is None:  # not importorskip: fp8ops.megatron imports it
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from test_admission import MANIFEST, projections

from fp8ops.admission import AdmissionError, apply_admission, decide_admission
from fp8ops.manifest import derive, parse_manifest
from fp8ops.manifest.precision_schedule import resolve
from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_modules
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

FC2 = "decoder.layers.1.mlp.linear_fc2"
FC1 = "decoder.layers.1.mlp.linear_fc1"
QKV0 = "decoder.layers.0.self_attention.linear_qkv"


@pytest.fixture(scope="module", autouse=True)
def _megatron_tp1(megatron_tp1):
    """Every test here runs on a one-rank TP=1 Megatron (tests/conftest.py)."""


@pytest.fixture(scope="module")
def manifest():
    return parse_manifest(MANIFEST, "schedule-test")  # 10 steps


@pytest.fixture(scope="module")
def recipe(manifest):
    return DelayedScalingRecipe.from_precision(manifest.precision)


@pytest.fixture(scope="module")
def model(manifest, recipe):
    return build_gpt(manifest, recipe)


def scheduled(manifest, *phases, **precision_changes):
    entries = [{"reason": "test", **p} for p in phases]
    changes = {f"precision.{k}": v for k, v in precision_changes.items()}
    return derive(manifest, {"precision.schedule": entries, **changes}, "schedule test")


def table_at(model, m, step):
    phases = resolve(m.precision.schedule, m.schedule.train_steps)
    return decide_admission(model, m.precision, tensor_parallel=1, phases=phases, step=step)


def test_the_table_for_a_step_takes_the_covering_phases_gemms_to_bf16(model, manifest):
    m = scheduled(
        manifest,
        {"start": 4, "end": 6, "modules": ["*.linear_fc2"]},
        {"start_fraction": 0.8, "modules": ["decoder.layers.*"], "gemms": ["fprop"]},
    )
    before, during, between, last = (table_at(model, m, s) for s in (3, 4, 7, 9))
    assert all(row.fp8_gemms == ("fprop", "dgrad", "wgrad") for row in before.rows if row.fp8)
    assert before.rows == between.rows  # no phase covers steps 3 and 7
    row = during.row(FC2)
    assert (row.precision, row.reason.code, row.fp8_gemms) == ("bf16", "schedule", ())
    assert row.reason.text == (
        "precision.schedule[0], steps 4 to 6: bf16 (test); no GEMM left in FP8"
    )
    assert during.row(QKV0).fp8_gemms == ("fprop", "dgrad", "wgrad")
    # 0.8 of 10 steps: the phase covers steps 9 and 10, fprop only.
    for fqn in projections():
        assert last.row(fqn).fp8_gemms == ("dgrad", "wgrad"), fqn
        assert last.row(fqn).gemms.fprop.reason.code == "schedule"
    assert last.row("output_layer").reason.code == "lm_head"  # a glob's never-FP8 modules stay


def test_an_override_keeps_its_reason_under_a_phase(model, manifest):
    m = scheduled(
        manifest,
        {"start": 2, "modules": [FC2], "gemms": ["fprop"]},
        overrides=[{"module": FC2, "reason": "saturates", "gemms": ["dgrad", "wgrad"]}],
    )
    row = table_at(model, m, 2).row(FC2)
    assert (row.precision, row.reason.code) == ("bf16", "override")
    assert row.gemms.fprop.reason.code == "schedule"
    assert table_at(model, m, 1).row(FC2).fp8_gemms == ("fprop",)


def test_a_schedule_that_does_not_fit_the_model_is_refused_naming_the_field(model, manifest):
    m = scheduled(
        manifest,
        {"start": 2, "end": 5, "modules": ["*.linear_fc3", "*.mlp.*"]},
        {"start": 3, "modules": ["output_layer"]},
        {"start": 5, "modules": ["decoder.layers.1.*"], "gemms": ["wgrad"]},
    )
    with pytest.raises(AdmissionError) as found:
        table_at(model, m, 1)  # any step: the schedule is checked whole
    message = str(found.value)
    assert "precision.schedule[0].modules[0] '*.linear_fc3': matches no module" in message
    assert "precision.schedule[1].modules[0] 'output_layer': matches only modules that never " in (
        message
    )
    assert "(the LM head)" in message
    # Two globs, one module: only the model shows the overlap (step 5, wgrad of layer 1's MLP).
    assert (
        "precision.schedule[2].modules: switches wgrad of decoder.layers.1.mlp.linear_fc1, "
        "decoder.layers.1.mlp.linear_fc2 in steps precision.schedule[0] covers too (5 to 5)"
    ) in message
    assert "schedule[0].modules[1]" not in message


def test_the_summary_counts_the_modules_a_phase_holds_in_the_base_dtype(model, manifest):
    m = scheduled(manifest, {"start": 2, "modules": ["*.linear_fc2"], "reason": "tail"})
    before, during = table_at(model, m, 1), table_at(model, m, 2)
    assert before.summary() == "8 of 16 modules FP8; 8 in bf16: 2 embedding, 1 LM head, 5 norm"
    assert during.summary() == (
        "6 of 16 modules FP8; 10 in bf16: 2 schedule phase, 2 embedding, 1 LM head, 5 norm"
    )


def test_a_phase_to_a_recipe_runs_its_modules_under_it_with_reason_schedule(model, manifest):
    m = scheduled(manifest, {"start": 4, "end": 6, "modules": ["*.linear_fc2"], "to": "current"})
    before, during, after = (table_at(model, m, s) for s in (3, 4, 7))
    row = during.row(FC2)
    assert (row.precision, row.scaling, row.reason.code) == ("fp8", "current", "schedule")
    assert row.fp8_gemms == ("fprop", "dgrad", "wgrad")
    assert row.reason.text.endswith("; precision.schedule[0], steps 4 to 6: current scaling (test)")
    assert {gemm.reason.code for _, gemm in row.gemms.items()} == {"schedule"}
    assert (during.row(QKV0).scaling, during.row(QKV0).reason.code) == (None, "fp8")
    assert before.rows == after.rows and before.row(FC2).scaling is None
    assert during.summary().startswith("8 of ")  # still FP8, under another recipe
    # Applied, the module runs the phase's recipe, then its own again; nothing else changes.
    modules = fp8_modules(model)
    apply_admission(during, model)
    assert modules[FC2].phase_recipe.kind == "current" and modules[QKV0].phase_recipe is None
    apply_admission(after, model)
    assert modules[FC2].phase_recipe is None


def test_a_phase_to_a_recipe_that_clashes_is_refused_naming_the_field(model, manifest):
    m = scheduled(
        manifest,
        {"start": 2, "end": 5, "modules": ["decoder.layers.0.*"], "to": "current"},
        {"start": 5, "modules": ["*.linear_fc2"], "gemms": ["wgrad"]},  # layer 0's at step 5
        {"start": 8, "modules": ["decoder.layers.1.mlp.*"], "to": "block"},
        module_recipes=[{"modules": [FC1], "scaling": "current", "reason": "test"}],
    )
    with pytest.raises(AdmissionError) as found:
        table_at(model, m, 1)
    message = str(found.value)
    assert (
        "precision.schedule[1].modules: switches wgrad of decoder.layers.0.mlp.linear_fc2 in "
        "steps precision.schedule[0] covers too (5 to 5)"
    ) in message
    assert (
        f"precision.schedule[2].to 'block': {FC1} (precision.module_recipes[0]) run their own "
        "recipe by module_recipes already"
    ) in message


def test_a_phase_to_mxfp8_is_refused_on_modules_its_blocks_do_not_fit(manifest, recipe):
    narrow = derive(manifest, {"model.hidden_size": 48}, "schedule test")  # K or N 48 at TP=1
    m = scheduled(narrow, {"start": 2, "modules": ["*.linear_proj"], "to": "mxfp8"})
    with pytest.raises(AdmissionError) as found:
        table_at(build_gpt(narrow, recipe), m, 1)
    assert (
        "precision.schedule[0].to 'mxfp8': its GEMMs need K in multiples of 32 and N in "
        "multiples of 32 per rank"
    ) in str(found.value)
    assert "decoder.layers.0.self_attention.linear_proj (K x N = 48 x 48 per rank)" in str(
        found.value
    )


def test_a_phase_to_a_recipe_runs_as_a_module_recipes_entry_would(manifest, recipe):
    """From step 1, a phase to current scaling and a module_recipes entry give the module the
    same recipe: the same operations, so the losses and the other modules' states are equal
    bit for bit; and not those of the run without either."""
    entry = {"modules": [FC2], "scaling": "current", "reason": "test"}
    runs = {
        "phase": scheduled(manifest, {"start": 1, "end": 2, "modules": [FC2], "to": "current"}),
        "entry": derive(manifest, {"precision.module_recipes": [entry]}, "schedule test"),
        "neither": manifest,
    }
    states, losses = {}, {}
    for name, m in runs.items():
        losses[name] = []
        states[name] = run_steps(
            build_gpt(m, recipe), m, recipe, (1, 2), torch.Generator().manual_seed(0), losses[name]
        )
    assert all(map(torch.equal, losses["phase"], losses["entry"]))
    assert not torch.equal(losses["phase"][0], losses["neither"][0])
    for fqn, state in states["entry"][2].items():
        assert all(torch.equal(state[k], states["phase"][2][fqn][k]) for k in state), fqn
    # The phase's module kept its delayed-scaling state, untouched: as built (scales 1).
    frozen = states["phase"][2][FC2]
    assert (frozen["scale_fwd"] == 1).all() and (frozen["amax_history_fwd"] == 0).all()


def run_steps(model, m, recipe, steps, generator, losses=None):
    """Train-free steps: each step's table applied before it, forward, backward, the scope's
    amax update; the FP8 state of every delayed-scaling module after each step. ``losses``: a
    list to append each step's loss to."""
    modules = fp8_modules(model)
    scope = Fp8Scope(recipe, group=amax_reduction_group(m.topology))
    b, s = m.schedule.micro_batch_size, m.model.seq_length
    states = {}
    for step in steps:
        apply_admission(table_at(model, m, step), model)
        tokens = torch.randint(0, 256, (b, s + 1), generator=generator)
        with scope():
            loss = model(tokens[:, :-1], torch.arange(s).expand(b, s), None, labels=tokens[:, 1:])
        loss.mean().backward()
        if losses is not None:
            losses.append(loss.detach().clone())
        states[step] = {
            fqn: module.fp8_meta.state_dict()
            for fqn, module in modules.items()
            if module.fp8_meta is not None
        }
    return states


@pytest.mark.parametrize("to", ["bf16", "current"])
def test_a_module_back_from_a_phase_resumes_the_delayed_scaling_state_it_left(manifest, recipe, to):
    m = scheduled(manifest, {"start": 3, "end": 4, "modules": [FC2], "to": to})
    model = build_gpt(m, recipe)
    states = run_steps(model, m, recipe, range(1, 6), torch.Generator().manual_seed(0))
    left, back = states[2][FC2], states[5][FC2]
    # Frozen while in BF16 or under current scaling, which keeps no state: exactly the tensors
    # step 2 left (nothing wrote them).
    for step in (3, 4):
        assert all(torch.equal(states[step][FC2][k], left[k]) for k in left), step
    # The others went on.
    other = "decoder.layers.1.mlp.linear_fc1"
    assert not torch.equal(
        states[4][other]["amax_history_fwd"], states[2][other]["amax_history_fwd"]
    )
    # Back in FP8 at step 5: one update on top of the frozen window, as if steps 3 and 4 had not
    # been ([0, h[2], ..., h[L-1], current], scaling.py), for the slots its GEMMs cast: input and
    # weight forward, the output's gradient backward.
    for key, slots in (("amax_history_fwd", [0, 1]), ("amax_history_bwd", [0])):
        assert torch.equal(back[key][1:-1, slots], left[key][2:, slots]), key
        assert (back[key][-1, slots] > 0).all(), key
    assert not torch.equal(back["scale_fwd"], left["scale_fwd"])
