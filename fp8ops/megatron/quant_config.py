"""Per-module recipes (``precision.module_recipes``) as Megatron-Core's per-module quantization
config: ``TransformerConfig.quant_recipe``, a ``RecipeConfig`` of glob matchers and configs.

Megatron's ``GPTModel`` resolves it itself once the model is built: it calls
``finish_init(quant_config)`` on every module that has one, with the config of the first matcher
whose glob matches the module's name (None where none does). fp8ops' FP8 linears take it there
(``layers.py``), so the manifest's entries reach a module through Megatron's own mechanism, in
Megatron's order, and not by fp8ops walking the model afterwards.

Megatron matches a module by its name on its own pipeline stage, where a stage's layers count
from 0; the manifest names layers globally. Each glob is therefore matched by a
:class:`StageGlob`, Megatron's ``Matcher`` extension point, against the name with the stage's
layer offset added: the same module gets the same recipe at any ``pipeline_parallel``.

The configs are written in the payload Megatron's Transformer Engine layers parse
(``TEQuantizationParams``: ``fp8_quantization_recipe`` one of Megatron's ``Fp8Recipe`` values,
``fp8_format``), so the same ``RecipeConfig`` means the same to both: TE builds
``Float8CurrentScaling`` / ``Float8BlockScaling`` / ``MXFP8BlockScaling`` at their defaults with
that format, and fp8ops the same recipes (``StatelessRecipe``). Megatron refuses delayed scaling
there, and so does the manifest.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from megatron.core.enums import Fp8Recipe
from megatron.core.quantization.quant_config import MatchContext, Matcher, RecipeConfig

from fp8ops.precision import Fp8Format, StatelessRecipe

# precision.module_recipes[].scaling -> Megatron's Fp8Recipe, and back
MEGATRON_RECIPES = {
    "current": Fp8Recipe.tensorwise,
    "block": Fp8Recipe.blockwise,
    "mxfp8": Fp8Recipe.mxfp8,
}
_FP8OPS_RECIPES = {value: kind for kind, value in MEGATRON_RECIPES.items()}
_CONFIG_TYPE = ("transformer_engine_config_type", "TEQuantizationParams")


class StageGlob(Matcher):
    """A manifest glob matched against a module's global name: its stage's local
    ``decoder.layers.{i}`` renumbered ``i + layer_offset`` (the admission table's and
    checkpoints' names), then ``fnmatchcase`` as admission matches it."""

    def __init__(self, pattern: str, config_key: str, layer_offset: int):
        self.pattern, self.config_key, self.layer_offset = pattern, config_key, layer_offset

    def match(self, context: MatchContext) -> str | None:
        name = global_name(context.module_path, self.layer_offset)
        return self.config_key if fnmatchcase(name, self.pattern) else None

    def __repr__(self) -> str:
        return f"StageGlob({self.pattern!r}, {self.config_key!r}, offset {self.layer_offset})"


def global_name(local: str, layer_offset: int) -> str:
    """``decoder.layers.{i}.rest`` on a stage whose first layer is ``layer_offset``, named as
    in the whole model; any other name as it is."""
    prefix = "decoder.layers."
    if layer_offset == 0 or not local.startswith(prefix):
        return local
    number, dot, rest = local[len(prefix) :].partition(".")
    if not number.isdigit():
        return local
    return f"{prefix}{int(number) + layer_offset}{dot}{rest}"


def quant_recipe(precision, layer_offset: int = 0) -> RecipeConfig | None:
    """Megatron's ``RecipeConfig`` for a manifest's ``precision`` section on the pipeline stage
    whose first layer is ``layer_offset``: one config per ``module_recipes`` entry and one
    matcher per glob, in the manifest's order (the first match decides in both). None without
    entries."""
    if not precision.module_recipes:
        return None
    configs, matchers = {}, []
    for i, entry in enumerate(precision.module_recipes):
        key = f"module_recipes[{i}]"
        configs[key] = {
            _CONFIG_TYPE[0]: _CONFIG_TYPE[1],
            "training_recipe": {
                "fp8_quantization_recipe": MEGATRON_RECIPES[entry.scaling].value,
                "fp8_format": precision.fp8_format,
            },
        }
        matchers += [StageGlob(glob, key, layer_offset) for glob in entry.modules]
    return RecipeConfig(matchers, configs)


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
