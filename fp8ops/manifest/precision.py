"""The ``precision`` section: which modules run FP8 and with which of Transformer Engine's
recipes. Its fields are in ``precision_fields.py``, what it says about single modules in
``module_precision.py``; here are the rules between the fields, and the recipe in one line.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from fp8ops.manifest.base import raise_problems
from fp8ops.manifest.module_precision import module_recipe_backend_problem, mxfp8_on_scaled_mm
from fp8ops.manifest.precision_fields import PrecisionFields


class PrecisionPolicy(PrecisionFields):
    """Which modules run FP8 and how their scales are kept: one of TE's FP8 recipes."""

    @model_validator(mode="after")
    def _consistent(self) -> PrecisionPolicy:
        problems = _duplicate_globs("include_modules", self.include_modules)
        problems += _duplicate_globs("exclude_modules", self.exclude_modules)
        problems += _duplicate_globs("overrides", tuple(o.module for o in self.overrides))
        problems += self._recipe_fields()
        problems += self._module_recipe_rules()
        problems += self._gemm_rules()
        algo = self.amax_algo
        if algo.kind == "trimmed_max" and algo.k >= self.amax_history_len:
            problems.append(
                (
                    ("amax_compute_algo",),
                    self.amax_compute_algo,
                    f"trimmed_max:K needs K < amax_history_len ({self.amax_history_len})",
                )
            )
        raise_problems("PrecisionPolicy", problems)
        return self

    def _recipe_fields(self) -> list:
        """A field of another recipe than ``scaling``, set away from its default, is refused:
        it would be ignored, and a run must not look as if it honoured it."""
        owners = {
            "amax_history_len": ("delayed",),
            "amax_compute_algo": ("delayed",),
            "margin": ("delayed",),
            "reduce_amax": ("delayed",),
            "power_2_scale": ("current", "block"),
            "amax_epsilon": ("current", "block"),
            "x_block_scaling_dim": ("block",),
            "w_block_scaling_dim": ("block",),
            "grad_block_scaling_dim": ("block",),
        }
        problems = []
        for name, recipes in owners.items():
            value = getattr(self, name)
            if self.scaling not in recipes and value != type(self).model_fields[name].default:
                problems.append(
                    (
                        (name,),
                        value,
                        f"a setting of {' and '.join(recipes)} scaling, not of scaling "
                        f"'{self.scaling}': remove it (or choose scaling {recipes[0]!r})",
                    )
                )
        if self.scaling != "delayed" and self.backend == "te":
            problems.append(
                (
                    ("backend",),
                    self.backend,
                    f"scaling '{self.scaling}' is not wired to Transformer Engine's layers in "
                    "fp8ops yet (TE runs delayed scaling here); use backend 'emulated'",
                )
            )
        if self.scaling == "mxfp8" and self.backend == "scaled_mm":
            way_out = "use precision.backend 'emulated'"
            problems.append((("backend",), self.backend, mxfp8_on_scaled_mm(way_out)))
        if self.scaling == "block":
            dims = [self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim]
            if dims.count(2) > 1:
                problems.append(
                    (
                        ("w_block_scaling_dim",),
                        self.w_block_scaling_dim,
                        "only one of x/w/grad_block_scaling_dim may be 2: TE's block GEMM "
                        "multiplies a 128x128-blocked operand only by a 1x128-blocked one",
                    )
                )
        return problems

    def _module_recipe_rules(self) -> list:
        """What ``module_recipes`` may not ask for: a module's recipe the backend cannot run,
        or the run's own recipe again (nothing would change)."""
        problems = []
        seen: set[str] = set()
        for i, entry in enumerate(self.module_recipes):
            where = ("module_recipes", i, "scaling")
            # The ledger's entries go first on purpose: a written glob they repeat still
            # decides the modules they leave to it.
            for glob in entry.modules if entry.approval is None else ():
                if glob in seen:
                    problems.append(
                        (
                            ("module_recipes", i, "modules"),
                            glob,
                            f"{glob!r} is in an earlier entry already; the first matching entry "
                            "decides, so this one would never apply",
                        )
                    )
                seen.add(glob)
            later = self.module_recipes[i + 1 :]
            own = entry.scaling == self.scaling and entry.approval is None
            differing = self._stateless_fields_set() if own else []
            # With some of their GEMMs only, the run's own recipe changes the others to base_dtype.
            if own and not entry.some_gemms and all(e.scaling == self.scaling for e in later):
                # Before an entry of another recipe, it keeps modules from that entry's globs
                # (the first match decides); admission checks that it keeps some.
                problems.append(
                    (
                        where,
                        entry.scaling,
                        f"'{entry.scaling}' is the run's own recipe (precision.scaling) and no "
                        "later entry gives another: these modules run it without the entry; "
                        "remove it",
                    )
                )
            elif differing:
                problems.append(
                    (
                        where,
                        entry.scaling,
                        f"an entry runs '{entry.scaling}' at Transformer Engine's defaults (as "
                        "Megatron builds a module's recipe), not with this run's "
                        f"{', '.join(differing)}: these modules would not "
                        "run the run's recipe. Narrow the later entry's globs instead",
                    )
                )
            elif problem := module_recipe_backend_problem(
                entry.scaling, self.backend, "give these modules 'block' or 'current' instead"
            ):
                problems.append((where, entry.scaling, problem))
        return problems

    def _gemm_rules(self) -> list:
        """Per-GEMM precision (``gemms``) runs on fp8ops' own layers: Transformer Engine's take
        a whole module in or out of FP8 here (its debug API's DisableQuantizationGEMM is what
        ``fp8ops overrides export-te`` writes for a TE run)."""
        if self.backend != "te":
            return []
        return [
            (
                ("overrides", i, "gemms"),
                list(o.gemms),
                "per-GEMM overrides are not wired to Transformer Engine's layers in fp8ops yet "
                "(TE runs a module's GEMMs all in FP8 or all in BF16 here); remove gemms (the "
                "whole module) or use backend 'emulated'",
            )
            for i, o in enumerate(self.overrides)
            if o.some_gemms
        ]

    def _stateless_fields_set(self) -> list[str]:
        """The run's current/block fields that differ from TE's defaults for its recipe."""
        defaults = {
            "power_2_scale": self.scaling == "block",
            "amax_epsilon": 0.0,
            "x_block_scaling_dim": 1,
            "w_block_scaling_dim": 2,
            "grad_block_scaling_dim": 1,
        }
        if self.power_2_scale is None:
            defaults.pop("power_2_scale")
        return [name for name, value in defaults.items() if getattr(self, name) != value]

    @property
    def recipe_summary(self) -> str:
        """The recipe in one line, with the fields that apply to it, and the modules that run
        another one."""
        text = recipe_line(self)
        for entry in self.module_recipes:
            text += f"; {entry.scaling} for {', '.join(entry.modules)}"
            if entry.some_gemms:
                text += f" ({', '.join(entry.gemms)} only)"
        return text


def recipe_line(recipe: Any) -> str:
    """A recipe in one line, with the fields it has (a stateless recipe has no window), read by
    name from ``recipe``: the manifest's ``precision`` section and ``layers.json``'s recipe
    record alike. A ``power_2_scale`` of None is the recipe's default (on for block only)."""
    r, fmt = recipe, recipe.fp8_format
    if r.scaling == "delayed":
        return (
            f"{fmt}, amax_history_len {r.amax_history_len}, {r.amax_compute_algo}, "
            f"margin {r.margin}, reduce_amax {r.reduce_amax}"
        )
    if r.scaling == "mxfp8":
        return f"MXFP8 scaling, {fmt}, 1x32 blocks, E8M0 scales"
    pow2 = r.power_2_scale if r.power_2_scale is not None else r.scaling == "block"
    text = f"{r.scaling} scaling, {fmt}, power-of-2 scales {'on' if pow2 else 'off'}"
    if r.amax_epsilon:
        text += f", amax_epsilon {r.amax_epsilon}"
    if r.scaling == "block":
        edge = {1: "1x128", 2: "128x128"}
        dims = (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim)
        x, w, grad = (edge[d] for d in dims)
        text += f", blocks: input {x}, weight {w}, grad {grad}"
    return text


def _duplicate_globs(
    field: str, globs: tuple[str, ...]
) -> list[tuple[tuple[str | int, ...], Any, str]]:
    first_seen: dict[str, int] = {}
    problems = []
    for index, glob in enumerate(globs):
        if glob in first_seen:
            problems.append(((field, index), glob, f"duplicate of item [{first_seen[glob]}]"))
        first_seen.setdefault(glob, index)
    return problems
