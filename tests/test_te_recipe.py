"""Our recipe as Transformer Engine's real DelayedScaling (skipped where TE's recipe module
cannot import)."""

import os
import subprocess
import sys

import pytest
import torch

from fp8ops.precision import DelayedScalingRecipe, Fp8Format, parse_amax_algo
from fp8ops.precision.te_recipe import WindowStatistic, load_te_recipe_module, to_te_recipe

te_recipe = load_te_recipe_module()
needs_te = pytest.mark.skipif(te_recipe is None, reason="transformer-engine is not installed")


@needs_te
@pytest.mark.parametrize(
    "fmt, algo, length, margin, reduce",
    [
        (Fp8Format.HYBRID, "max", 16, 0, True),
        (Fp8Format.E4M3, "most_recent", 1, 3, False),
        (Fp8Format.HYBRID, "max", 1024, 1, True),
    ],
)
def test_fields_match(fmt, algo, length, margin, reduce):
    ours = DelayedScalingRecipe(
        fp8_format=fmt,
        amax_history_len=length,
        amax_compute_algo=parse_amax_algo(algo),
        margin=margin,
        reduce_amax=reduce,
    )
    theirs = to_te_recipe(ours, te_recipe)
    assert isinstance(theirs, te_recipe.DelayedScaling)
    assert theirs.fp8_format == getattr(te_recipe.Format, fmt.name)
    assert (theirs.amax_history_len, theirs.amax_compute_algo) == (length, algo)
    assert (theirs.margin, theirs.reduce_amax) == (margin, reduce)
    # TE's format maxima are the ones our formats use
    assert theirs.fp8_format.value.max_fwd == fmt.forward.max
    assert theirs.fp8_format.value.max_bwd == fmt.backward.max


@needs_te
def test_te_itself_refuses_pure_e5m2():
    with pytest.raises(Exception, match="E5M2"):
        te_recipe.DelayedScaling(fp8_format=te_recipe.Format.E5M2)


@needs_te
def test_window_statistic_becomes_a_callable():
    ours = DelayedScalingRecipe(
        amax_history_len=8, amax_compute_algo=parse_amax_algo("quantile:0.9")
    )
    theirs = to_te_recipe(ours, te_recipe)
    assert isinstance(theirs.amax_compute_algo, WindowStatistic)
    history = torch.arange(1.0, 21.0).reshape(20, 1)  # 1..20: the 0.9 quantile is not the max
    assert theirs.amax_compute_algo(history).tolist() == [19.0]


@needs_te
@pytest.mark.skipif(
    te_recipe is not None
    and "backward_override" not in te_recipe.DelayedScaling.__dataclass_fields__,
    reason="TE before 2.15 has no backward_override",
)
@pytest.mark.slow
def test_the_recipe_ignores_a_backward_override_in_the_environment(tmp_path):
    """TE reads NVTE_BACKWARD_OVERRIDE when it is imported, as the default of every recipe's
    backward_override, and DelayedScaling asserts it is None; so in a fresh process."""
    code = (
        "from fp8ops.precision import DelayedScalingRecipe\n"
        "from fp8ops.precision.te_recipe import load_te_recipe_module, to_te_recipe\n"
        "te = load_te_recipe_module()\n"
        "try:\n"
        "    te.DelayedScaling()\n"
        "except ValueError as exc:\n"  # pydantic's ValidationError of TE's assertion
        "    print('TE refused its default:', ' '.join(str(exc).split()))\n"
        "print('ours:', to_te_recipe(DelayedScalingRecipe(), te).backward_override)\n"
    )
    env = {**os.environ, "NVTE_BACKWARD_OVERRIDE": "dequantized"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    refused, ours = done.stdout.splitlines()
    assert "Delayed scaling only supports backward_override=None" in refused, done.stdout
    assert ours == "ours: None"


def test_missing_te_gives_an_install_hint(monkeypatch):
    import fp8ops.precision.te_recipe as module

    monkeypatch.setattr(module, "load_te_recipe_module", lambda: None)
    with pytest.raises(ImportError, match="pip install --no-deps transformer-engine"):
        module.to_te_recipe(DelayedScalingRecipe())


@needs_te
def test_production_manifest_becomes_te_recipe():
    from pathlib import Path

    from fp8ops.manifest import load_manifest

    manifest = load_manifest(Path(__file__).parents[1] / "manifests" / "llama3-8b-h100.yaml")
    theirs = to_te_recipe(DelayedScalingRecipe.from_precision(manifest.precision), te_recipe)
    precision = manifest.precision
    assert theirs.fp8_format == te_recipe.Format.HYBRID
    assert theirs.amax_history_len == precision.amax_history_len == 16
    assert theirs.amax_compute_algo == precision.amax_compute_algo == "max"
    assert theirs.margin == precision.margin == 0
    assert theirs.reduce_amax is precision.reduce_amax is True
