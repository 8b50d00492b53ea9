"""Transformer Engine's own ``DelayedScaling`` recipe, built from ours.

On a GPU machine TE imports normally. On a CPU machine only its pure-Python recipe module can
import, and only with ``NVTE_PROJECT_BUILDING=1``, which skips the package's load of CUDA
libraries (reference §8); ``transformer_engine.pytorch`` never imports there. Without TE at
all, :func:`load_te_recipe_module` returns None and callers skip.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from types import ModuleType

import torch

from fp8ops.precision.formats import Fp8Format
from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.scaling import AmaxAlgo, window_amax
from fp8ops.precision.stateless import StatelessRecipe


def load_te_recipe_module() -> ModuleType | None:
    """``transformer_engine.common.recipe``, or None when Transformer Engine is not installed."""
    try:
        import transformer_engine.common.recipe as te_recipe
    except ImportError:
        return None
    except RuntimeError:
        if torch.cuda.is_available():
            raise  # a broken GPU install must not be hidden
        with _cpu_recipe_only(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "torch extension not found"
            import transformer_engine.common.recipe as te_recipe
    return te_recipe


@contextlib.contextmanager
def _cpu_recipe_only():
    previous = os.environ.get("NVTE_PROJECT_BUILDING")
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["NVTE_PROJECT_BUILDING"]
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = previous


class WindowStatistic:
    """A window-statistic algorithm as the callable TE's ``amax_compute_algo`` accepts.

    TE calls it with the whole ``[L, n]`` history on its unfused path; fp8ops' emulation of
    that path (``scaling._callable_path_update``) calls the same statistic.
    """

    def __init__(self, algo: AmaxAlgo):
        self.algo = algo

    def __call__(self, amax_history: torch.Tensor) -> torch.Tensor:
        return window_amax(self.algo, amax_history)

    def __repr__(self) -> str:  # for logs and messages (TE keys nothing on it)
        return f"WindowStatistic({self.algo.name})"


def to_te_recipe(
    recipe: DelayedScalingRecipe | StatelessRecipe, te_recipe: ModuleType | None = None
):
    """A real ``transformer_engine.common.recipe`` object with our recipe's fields:
    ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling`` or
    ``MXFP8BlockScaling``."""
    te_recipe = te_recipe or load_te_recipe_module()
    if te_recipe is None:
        raise ImportError(
            "Transformer Engine is not installed; on a CPU machine "
            "`pip install --no-deps transformer-engine==2.20.2` provides its recipe module"
        )
    formats = {Fp8Format.HYBRID: te_recipe.Format.HYBRID, Fp8Format.E4M3: te_recipe.Format.E4M3}
    if isinstance(recipe, StatelessRecipe):
        return _stateless_te_recipe(recipe, te_recipe, formats[recipe.fp8_format])
    algo = recipe.amax_compute_algo
    # TE >= 2.15 defaults backward_override to $NVTE_BACKWARD_OVERRIDE, which DelayedScaling
    # refuses unless None: say None, so the recipe does not depend on the environment.
    fields = getattr(te_recipe.DelayedScaling, "__dataclass_fields__", {})
    no_override = {"backward_override": None} if "backward_override" in fields else {}
    return te_recipe.DelayedScaling(
        margin=recipe.margin,
        fp8_format=formats[recipe.fp8_format],
        amax_history_len=recipe.amax_history_len,
        amax_compute_algo=algo.name if algo.fused else WindowStatistic(algo),
        reduce_amax=recipe.reduce_amax,
        **no_override,
    )


def _stateless_te_recipe(recipe: StatelessRecipe, te_recipe: ModuleType, fp8_format):
    fields = getattr(te_recipe.Float8CurrentScaling, "__dataclass_fields__", {})
    no_override = {"backward_override": None} if "backward_override" in fields else {}
    if recipe.kind == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=fp8_format, **no_override)
    if recipe.kind == "current":
        te = te_recipe.Float8CurrentScaling(fp8_format=fp8_format, **no_override)
    else:
        te = te_recipe.Float8BlockScaling(
            fp8_format=fp8_format,
            x_block_scaling_dim=recipe.x_block_scaling_dim,
            w_block_scaling_dim=recipe.w_block_scaling_dim,
            grad_block_scaling_dim=recipe.grad_block_scaling_dim,
            **no_override,
        )
    # TE reads the power-of-2 choice from an environment variable when its module is imported
    # (a class attribute, not a field): set on the instance, so it does not depend on that.
    params = te_recipe.QParams(power_2_scale=recipe.power_2_scale, amax_epsilon=recipe.amax_epsilon)
    te.fp8_quant_fwd_inp = te.fp8_quant_fwd_weight = te.fp8_quant_bwd_grad = params
    return te
