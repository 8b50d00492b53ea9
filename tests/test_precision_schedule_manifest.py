"""``precision.schedule`` in the manifest: phases by step or by fraction of
``schedule.train_steps``, their steps resolved as the docs say, their bad inputs refused naming
the field, and a manifest without a schedule hashing as it did before the field existed."""

from __future__ import annotations

import pytest
from support.example_manifests import TINY

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest, manifest_hash
from fp8ops.manifest.precision_schedule import fraction_step, resolve

LAYERS = "decoder.layers.*.self_attention.linear_qkv"


def with_schedule(*phases, **changes):
    entries = [{"modules": [LAYERS], "reason": "r", **p} for p in phases]
    return derive(load_manifest(TINY), {"precision.schedule": entries, **changes}, "test")


def test_phases_resolve_to_the_steps_they_cover():
    manifest = with_schedule(
        {"start": 10, "end": 20},
        {"start_fraction": 0.9, "gemms": ["fprop"]},
        {"start_fraction": 0.5, "end_fraction": 0.6, "gemms": ["wgrad"]},
    )
    steps = manifest.schedule.train_steps
    assert steps == 300
    phases = resolve(manifest.precision.schedule, steps)
    # The last 10% of 300 steps: 271 to 300; 0.5 to 0.6: the steps after 150 up to 180.
    assert [(p.first, p.last) for p in phases] == [(10, 20), (271, 300), (151, 180)]
    assert phases[0].covers(10) and phases[0].covers(20) and not phases[0].covers(21)
    assert manifest.precision.schedule[1].gemms == ("fprop",)


def test_a_fraction_is_taken_as_the_decimal_written():
    # 0.29 * 100 is 28.999999999999996 in floats; the written decimal is 29/100.
    assert 0.29 * 100 < 29
    assert fraction_step(0.29, 100) == 29
    assert fraction_step(0.9, 7) == 6  # floor(6.3)


def test_no_schedule_hashes_as_before_the_field():
    plain = load_manifest(TINY)
    assert plain.precision.schedule == ()
    # An empty schedule is left out of the canonical form: the same manifest, the same hash
    # (tests/test_manifest_hashes.py pins the shipped manifests' hashes).
    with pytest.raises(ManifestError, match="leave the manifest as it was"):
        derive(plain, {"precision.schedule": []}, "test")
    assert manifest_hash(with_schedule({"start": 10})) != manifest_hash(plain)


@pytest.mark.parametrize(
    "phases, where, words",
    [
        ([{"start": 301}], r"schedule\[0\]\.start", "past schedule.train_steps \\(300\\)"),
        ([{"start": 10, "end": 301}], r"schedule\[0\]\.end", "past schedule.train_steps"),
        ([{"start": 20, "end": 10}], r"schedule\[0\]\.end", "before its first step 20"),
        ([{"end": 10}], r"schedule\[0\]\.start", "give one of start and start_fraction"),
        (
            [{"start": 1, "start_fraction": 0.5}],
            r"schedule\[0\]\.start",
            "give one of start and start_fraction",
        ),
        ([{"start_fraction": 1.0}], r"schedule\[0\]\.start_fraction", "between 0 and 1"),
        ([{"start": 0}], r"schedule\[0\]\.start", ">= 1"),
        ([{"start": 1, "gemms": ["wgard"]}], r"schedule\[0\]\.gemms", "'wgard' is not a GEMM"),
        ([{"start": 1, "to": "fp16"}], r"schedule\[0\]\.to", "'bf16'"),
        (
            [{"start": 1, "modules": []}],
            r"schedule\[0\]\.modules",
            "must list at least one module glob",
        ),
        (
            [{"start": 10, "end": 50}, {"start": 40, "gemms": ["fprop"]}],
            r"schedule\[1\]\.modules",
            r"precision\.schedule\[0\] switches the same modules' fprop in overlapping steps "
            r"\(40 to 50\)",
        ),
    ],
)
def test_bad_phases_are_refused_naming_the_field(phases, where, words):
    with pytest.raises(ManifestError, match=rf"precision\.{where}: .*{words}"):
        with_schedule(*phases)


def test_phases_that_follow_each_other_or_switch_other_gemms_may_share_modules():
    manifest = with_schedule(
        {"start": 10, "end": 50},
        {"start": 51},
        {"start": 40, "gemms": ["fprop"]} | {"modules": ["*.linear_qkv"]},
    )
    assert len(manifest.precision.schedule) == 3
    manifest = with_schedule({"start": 10, "gemms": ["wgrad"]}, {"start": 10, "gemms": ["fprop"]})
    assert len(manifest.precision.schedule) == 2


def test_a_phase_to_a_recipe_takes_what_module_recipes_takes():
    manifest = with_schedule({"start": 10, "end": 20, "to": "current"}, {"start": 21, "to": "bf16"})
    assert [p.recipe for p in manifest.precision.schedule] == ["current", None]
    # A changed target is a changed manifest: drift at resume, as any precision change.
    targets = ("bf16", "current", "block")
    assert len({manifest_hash(with_schedule({"start": 10, "to": to})) for to in targets}) == 3


@pytest.mark.parametrize(
    "phase, changes, where, words",
    [
        ({"to": "fp32"}, {}, r"\.to", "'bf16', 'current', 'block' or 'mxfp8'"),
        ({"to": "delayed"}, {}, r"\.to", "delayed scaling is never a per-module recipe"),
        (
            {"to": "current"},
            {"precision.scaling": "current", "precision.amax_history_len": 1024},
            r"\.to",
            "'current' is the run's own recipe \\(precision.scaling\\)",
        ),
        ({"to": "current"}, {"precision.backend": "te"}, r"\.to", "not wired to Transformer"),
        ({"to": "mxfp8"}, {"precision.backend": "scaled_mm"}, r"\.to", "MXFP8 on precision"),
        ({"to": "block", "gemms": ["fprop"]}, {}, r"\.gemms", "moves whole modules"),
    ],
)
def test_a_phase_to_a_recipe_module_recipes_would_refuse_is_refused(phase, changes, where, words):
    with pytest.raises(ManifestError, match=rf"precision\.schedule\[0\]{where}: .*{words}"):
        with_schedule({"start": 10, **phase}, **changes)


def test_a_schedule_without_fp8_or_per_gemm_on_te_is_refused():
    with pytest.raises(ManifestError, match=r"precision\.schedule: .*enabled is false"):
        with_schedule({"start": 10}, **{"precision.enabled": False})
    with pytest.raises(ManifestError, match=r"precision\.schedule\[0\]\.gemms: .*Transformer"):
        with_schedule({"start": 10, "gemms": ["fprop"]}, **{"precision.backend": "te"})
