"""The ledger's BF16 overrides as a Transformer Engine debug-API config (``nvdlfw_inspect``).

A run on real TE can take the same modules out of FP8 with TE's own switches: the per-layer
``DisableQuantizationLayer`` feature (``DisableFP8Layer`` in TE releases before the rename) for
an override of a whole module, and ``DisableQuantizationGEMM`` (``DisableFP8GEMM``) with its
``gemms`` list for an override of some GEMMs. TE's config puts a layer in one section only, and
a section gives its layers one feature, so each set of GEMMs gets its own section. Load the
YAML before the first TE module is built::

    import nvdlfw_inspect.api as debug_api
    debug_api.initialize(config_file="bf16_overrides.yaml",
                         feature_dirs=[".../transformer_engine/debug/features"])

The config selects layers by TE *layer name*: the ``name`` given to a TE module (its constructor's
``name=``, or ``debug_api.infer_and_assign_layer_names(model)``). Megatron-Core passes no
``name=`` to its TE modules, so the name is what the caller assigns. fp8ops' module names are
Megatron's module paths (``model.named_modules()``, the TE spec's names, as in layers.json), so
two namings are exported:

* ``fqn`` (default): the fp8ops names exactly, for a model whose TE modules were named by their
  path (``for fqn, m in model.named_modules(): m.name = fqn``).
* ``inferred``: what ``infer_and_assign_layer_names`` gives the same modules: a ``model.``
  prefix, and a decoder layer's 1-based ``layer_number`` in place of its 0-based index
  (``decoder.layers.0.mlp.linear_fc1`` is ``model.decoder.layers.1.mlp.linear_fc1``); valid at
  pipeline-parallel size 1, where the numbers have no stage offset.

A pattern that matches no layer name is a silent no-op in TE, so pick the naming the model uses.
The pattern matches exactly the exported names: each escaped, the alternation anchored at both
ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from fp8ops.overrides.ledger import Ledger, Override, OverrideError

Naming = Literal["fqn", "inferred"]
NAMINGS: tuple[Naming, ...] = ("fqn", "inferred")
SECTION = "fp8ops_bf16_overrides"  # any section name will do; a layer may be in only one


def exported_overrides(ledger: Ledger) -> list[Override]:
    """The BF16 overrides a TE run should honour: applied (active) and approved (pending
    resume). One staged in current scaling keeps its module in FP8, which TE's DisableFP8Layer
    cannot say: it is left out (on TE it would be a per-module recipe, Megatron's quant_recipe)."""
    return [
        o
        for o in ledger.overrides().values()
        if o.status in ("applied", "approved") and o.scaling is None
    ]


def te_layer_name(fqn: str, naming: Naming = "fqn") -> str:
    """The TE layer name of the module fp8ops calls ``fqn``."""
    if naming == "fqn":
        return fqn
    # Megatron's TransformerLayer.layer_number is 1-based; the ModuleList index is 0-based.
    numbered = re.sub(
        r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + 1}.", fqn
    )
    return f"model.{numbered}"


def layer_regex(names: Sequence[str]) -> str:
    """A Python regex matching exactly ``names``."""
    return "^(?:" + "|".join(re.escape(name) for name in sorted(set(names))) + ")$"


def te_debug_yaml(ledger: Ledger, naming: Naming = "fqn") -> str:
    """The YAML config disabling FP8 in every layer with an applied or approved override."""
    if naming not in NAMINGS:
        raise OverrideError(f"naming {naming!r}: choose {' or '.join(NAMINGS)}")
    overrides = exported_overrides(ledger)
    if not overrides:
        raise OverrideError(
            f"{ledger.path}: no applied or approved BF16 override; nothing to export"
        )
    by_gemms: dict[tuple[str, ...] | None, list[Override]] = {}
    for o in overrides:
        by_gemms.setdefault(o.gemms, []).append(o)
    # The whole-module section first, as the export wrote it before per-GEMM overrides.
    groups = sorted(by_gemms.items(), key=lambda item: (item[0] is not None, item[0] or ()))
    text = (
        f"# Transformer Engine debug-API config (nvdlfw_inspect): BF16 overrides from {ledger.path}\n"
        f"# (layer names: {naming}).\n"
    )
    for gemms, group in groups:
        text += _section(group, gemms, naming)
    return text


def _section(overrides: list[Override], gemms: tuple[str, ...] | None, naming: Naming) -> str:
    """One section: the layers of ``overrides``, all of whose GEMMs (``gemms`` None) or
    ``gemms`` run in high precision."""
    pattern = layer_regex([te_layer_name(o.module, naming) for o in overrides])
    listed = "\n".join(f"#   {o.id[:12]}  {o.status:<8}  {o.module}" for o in overrides)
    quoted = pattern.replace("'", "''")  # YAML single quotes: backslashes stay literal
    if gemms is None:
        said, name = "Every GEMM of these layers runs", SECTION
        feature = "    DisableQuantizationLayer:\n      enabled: True\n"
    else:
        said, name = f"{', '.join(gemms)} of these layers run", f"{SECTION}_{'_'.join(gemms)}"
        feature = (
            "    DisableQuantizationGEMM:\n"
            "      enabled: True\n"
            f"      gemms: [{', '.join(gemms)}]\n"
        )
    return (
        f"# {said} in high precision:\n"
        f"{listed}\n"
        f"{name}:\n"
        "  enabled: True\n"
        "  layers:\n"
        f"    layer_name_regex_pattern: '{quoted}'\n"
        "  transformer_engine:\n"
        f"{feature}"
    )
