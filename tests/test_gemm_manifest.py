"""Per-GEMM precision in the manifest: ``gemms`` on ``precision.overrides`` and
``precision.module_recipes`` entries, their bad inputs refused naming the field, their order
and their absence (all three) meaning what a manifest without them meant."""

from __future__ import annotations

import pytest
from support.example_manifests import TINY

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest, manifest_hash

FC2 = "decoder.layers.3.mlp.linear_fc2"


def with_override(**fields):
    entry = {"module": FC2, "reason": "gradients saturate", **fields}
    return derive(load_manifest(TINY), {"precision.overrides": [entry]}, "test")


def with_recipe(scaling="current", **fields):
    entry = {"modules": ["decoder.layers.0.*"], "scaling": scaling, "reason": "r", **fields}
    changes = {"precision.module_recipes": [entry]}
    if scaling == "current":  # the run's own recipe
        changes |= {"precision.scaling": "current", "precision.amax_history_len": 1024}
    return derive(load_manifest(TINY), changes, "test")


@pytest.mark.parametrize(
    "gemms, words",
    [
        (["wgard"], "'wgard' is not a GEMM; a linear's are fprop, dgrad, wgrad"),
        ([], "empty; name at least one of fprop, dgrad, wgrad"),
        (["wgrad", "dgrad", "wgrad"], "'wgrad' is listed twice"),
        ("wgrad", "must be a list or null"),
    ],
)
def test_bad_gemms_are_refused_naming_the_field(gemms, words):
    with pytest.raises(ManifestError, match=rf"precision\.overrides\[0\]\.gemms: {words}"):
        with_override(gemms=gemms)
    with pytest.raises(ManifestError, match=rf"precision\.module_recipes\[0\]\.gemms: {words}"):
        with_recipe("block", gemms=gemms)


def test_gemms_are_kept_in_one_order_and_absent_means_what_it_meant():
    a, b = with_override(gemms=["wgrad", "dgrad"]), with_override(gemms=["dgrad", "wgrad"])
    assert a.precision.overrides[0].gemms == ("dgrad", "wgrad")
    assert manifest_hash(a) == manifest_hash(b)
    whole = with_override()
    assert whole.precision.overrides[0].gemms is None
    assert not whole.precision.overrides[0].some_gemms
    # An entry written before the field hashes as it did: the field is left out at its default.
    assert manifest_hash(whole) == manifest_hash(with_override(gemms=None))
    assert manifest_hash(whole) != manifest_hash(a)
    assert with_override(gemms=["fprop", "dgrad", "wgrad"]).precision.overrides[0].some_gemms is (
        False
    )


def test_the_runs_own_recipe_is_an_entry_only_for_some_gemms():
    with pytest.raises(ManifestError, match=r"module_recipes\[0\]\.scaling: 'current' is the run"):
        with_recipe("current")
    entry = with_recipe("current", gemms=["fprop", "dgrad"]).precision.module_recipes[0]
    assert entry.gemms == ("fprop", "dgrad") and entry.some_gemms
    summary = with_recipe("current", gemms=["fprop"]).precision.recipe_summary
    assert summary.endswith("; current for decoder.layers.0.* (fprop only)")


def test_per_gemm_overrides_are_refused_on_the_te_backend():
    base = load_manifest(TINY)
    entry = {"module": FC2, "reason": "r", "gemms": ["wgrad"]}
    with pytest.raises(
        ManifestError, match=r"precision\.overrides\[0\]\.gemms: per-GEMM overrides"
    ):
        derive(base, {"precision.backend": "te", "precision.overrides": [entry]}, "test")
    whole = {"module": FC2, "reason": "r"}
    derive(base, {"precision.backend": "te", "precision.overrides": [whole]}, "test")
