"""Per-module recipes (``precision.module_recipes``) as Megatron-Core's per-module quantization
config: ``TransformerConfig.quant_recipe``, a ``RecipeConfig`` of glob matchers and configs.

Megatron's ``GPTModel`` resolves it itself once the model is built: it calls
``finish_init(quant_config)`` on every module that has one, with the config of the first matcher
whose glob matches the module's name (None where none does). fp8ops' FP8 linears take it there
(``layers.py``), so the manifest's entries reach a module through Megatron's own mechanism, in
Megatron's order, and not by fp8ops walking the model afterwards.

The configs are written in the payload Megatron's Transformer Engine layers parse
(``TEQuantizationParams``: ``fp8_quantization_recipe`` one of Megatron's ``Fp8Recipe`` values,
``fp8_format``), so the same ``RecipeConfig`` means the same to both: TE builds
``Float8CurrentScaling`` / ``Float8BlockScaling`` / ``MXFP8BlockScaling`` at their defaults with
that format, and fp8ops the same recipes (``StatelessRecipe``). Megatron refuses delayed scaling
there, and so does the manifest.
"""

from __future__ import annotations

from megatron.core.enums import Fp8Recipe
from megatron.core.quantization.quant_config import RecipeConfig

from fp8ops.precision import Fp8Format, StatelessRecipe

# precision.module_recipes[].scaling -> Megatron's Fp8Recipe, and back
MEGATRON_RECIPES = {
    "current": Fp8Recipe.tensorwise,
    "block": Fp8Recipe.blockwise,
    "mxfp8": Fp8Recipe.mxfp8,
}
_FP8OPS_RECIPES = {value: kind for kind, value in MEGATRON_RECIPES.items()}
_CONFIG_TYPE = ("transformer_engine_config_type", "TEQuantizationParams")


def quant_recipe(precision) -> RecipeConfig | None:
    """Megatron's ``RecipeConfig`` for a manifest's ``precision`` section: one config per
    ``module_recipes`` entry and one glob matcher per glob, in the manifest's order (the first
    match decides in both). None without entries."""
    if not precision.module_recipes:
        return None
    configs, matchers = {}, {}
    for i, entry in enumerate(precision.module_recipes):
        key = f"module_recipes[{i}]"
        configs[key] = {
            _CONFIG_TYPE[0]: _CONFIG_TYPE[1],
            "training_recipe": {
                "fp8_quantization_recipe": MEGATRON_RECIPES[entry.scaling].value,
                "fp8_format": precision.fp8_format,
            },
        }
        for j, glob in enumerate(entry.modules):
            matchers[f"{key}.modules[{j}]"] = {
                "type": "glob",
                "pattern": glob,
                "config": key,
                "enabled": True,
            }
    return RecipeConfig.from_config_dict({"configs": configs, "matchers": matchers})


def recipe_from_quant_config(quant_config) -> StatelessRecipe:
    """The recipe a module's ``QuantizationConfig`` names, at TE's defaults, as Megatron's TE
    layers build it. Refuses what fp8ops' layers cannot run (an FP4 or custom recipe, an
    evaluation recipe of its own), naming the config."""
    config = dict(quant_config.config)
    where = f"quant_recipe config {quant_config.config_key!r}"
    if config.get(_CONFIG_TYPE[0]) != _CONFIG_TYPE[1] or set(config) != {
        _CONFIG_TYPE[0],
        "training_recipe",
    }:
        raise ValueError(
            f"{where}: fp8ops' FP8 linears take a TEQuantizationParams config with a "
            f"training_recipe only, not {sorted(config)}"
        )
    training = dict(config["training_recipe"])
    unknown = set(training) - {"fp8_quantization_recipe", "fp8_format"}
    name = training.get("fp8_quantization_recipe")
    try:
        kind = _FP8OPS_RECIPES[Fp8Recipe(name)]
    except (ValueError, KeyError):
        kind = None
    if unknown or kind is None:
        raise ValueError(
            f"{where}: fp8ops' FP8 linears run fp8_quantization_recipe "
            f"{sorted(r.value for r in _FP8OPS_RECIPES)} with an fp8_format; got {training}"
        )
    fp8_format = Fp8Format.parse(training.get("fp8_format", "e4m3"))
    return stateless_recipe(kind, fp8_format)


def stateless_recipe(kind: str, fp8_format: Fp8Format) -> StatelessRecipe:
    """``kind`` at TE's defaults with ``fp8_format``: what a per-module entry runs."""
    if kind == "current":
        return StatelessRecipe.current(fp8_format)
    if kind == "block":
        return StatelessRecipe.block(fp8_format)
    return StatelessRecipe.mxfp8(fp8_format)
