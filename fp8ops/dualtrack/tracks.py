"""The three tracks of a dual-track evaluation, as manifests derived from one source manifest.

::

    bf16          the control: precision.enabled false, every module in the base dtype
    fp8           the candidate: the source manifest as it is
    fp8-fallback  the candidate with its high-risk modules in the base dtype (precision.overrides)

Only precision differs between them, so they read the same data in the same order, see the same
tokens at every step and evaluate at the same steps. The third track's modules are chosen from
the candidate's own run (its layers.json and alerts.jsonl) after the candidate has trained, by
the manifest's ``dualtrack`` section; its manifest is then written once and never rewritten, so
a later invocation resumes the same run.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive
from fp8ops.manifest.schema import Manifest

CONTROL, CANDIDATE, FALLBACK = "bf16", "fp8", "fp8-fallback"
LABELS = (CONTROL, CANDIDATE, FALLBACK)
PLAN = "dualtrack.json"  # in the dual-track directory: the tracks, their status and time

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Track:
    """One track: its label, role, locked manifest file and run directory."""

    label: str
    role: str  # "control" or "candidate"
    manifest_file: Path
    run_dir: Path
    fallback_modules: dict[str, str] = field(default_factory=dict)  # module -> why

    def record(self, root: Path) -> dict:
        """This track's entry in dualtrack.json (paths relative to the dual-track directory)."""
        entry = {
            "label": self.label,
            "role": self.role,
            "run_dir": str(self.run_dir.relative_to(root)),
            "manifest_file": str(self.manifest_file.relative_to(root)),
        }
        if self.label == FALLBACK:
            entry["fallback_modules"] = self.fallback_modules
        return entry


def control_manifest(source: Manifest) -> Manifest:
    """The BF16 control: the source with FP8 switched off (the recipe stays recorded)."""
    if not source.precision.enabled:
        raise ManifestError(
            "precision.enabled: the manifest already trains without FP8, so it has no FP8 "
            "candidate to compare; give the FP8 manifest to fp8ops dualtrack"
        )
    return derive(source, {"precision.enabled": False}, "dual-track: BF16 control")


def fallback_modules(source: Manifest, candidate_run: Path) -> dict[str, str]:
    """The candidate's high-risk modules, each with why, from its layers.json and alerts.

    Modules already in the base dtype in the candidate (excluded, overridden, too small) are not
    listed: only modules that ran FP8 can fall back.
    """
    from fp8ops.alerts.files import read_alerts

    rule = source.dualtrack
    fp8 = candidate_fp8_modules(source, candidate_run)
    chosen: dict[str, str] = {}
    if rule.fallback_first_last:
        layers = source.model.num_layers
        for name in fp8:
            match = _LAYER.match(name)
            if match and int(match.group(1)) == 0:
                chosen.setdefault(name, "dual-track: first transformer layer")
            elif match and int(match.group(1)) == layers - 1:
                chosen.setdefault(name, "dual-track: last transformer layer")
    if rule.fallback_alerted:
        for alert in read_alerts(candidate_run):
            if alert.level in ("degrade", "stop") and alert.module in fp8:
                chosen.setdefault(
                    alert.module,
                    f"dual-track: {alert.level} alert {alert.rule} at step {alert.step} in the "
                    "FP8 candidate",
                )
    for glob in rule.fallback_modules:
        matched = fnmatch.filter(fp8, glob)
        if not matched:
            raise ManifestError(
                f"dualtrack.fallback_modules: {glob!r} matches none of the candidate's "
                f"{len(fp8)} FP8 modules (see {candidate_run / 'layers.json'}); fix the glob"
            )
        for name in matched:
            chosen.setdefault(name, f"dual-track: dualtrack.fallback_modules {glob!r}")
    return dict(sorted(chosen.items(), key=lambda item: fp8.index(item[0])))


def candidate_fp8_modules(source: Manifest, candidate_run: Path) -> list[str]:
    """The modules that ran FP8 in the candidate, in layers.json order."""
    from fp8ops.run.records import read_layers_json

    # The candidate's layers.json is the latest resume's: a module an approved override moved to
    # BF16 during the run ran FP8 before that, and is exactly one to keep in BF16 here.
    inherited = {o.module for o in source.precision.overrides}
    return [
        row.fqn
        for row in read_layers_json(candidate_run).rows
        if row.fp8 or (row.reason.code == "override" and row.fqn not in inherited)
    ]


def check_fallback_globs(source: Manifest, control_run: Path) -> None:
    """Refuse a ``dualtrack.fallback_modules`` glob that names none of the modules the candidate
    will run in FP8, before it trains: found after, fixing the glob would change the source
    manifest and cost the tracks already trained. The control's layers.json, decided again under
    the candidate's precision section (``admitted_under``), says which those are."""
    from fp8ops.admission import admitted_under
    from fp8ops.run.records import read_layers_json

    names = admitted_under(read_layers_json(control_run).rows, source.precision)
    for glob in source.dualtrack.fallback_modules:
        if not fnmatch.filter(names, glob):
            raise ManifestError(
                f"dualtrack.fallback_modules: {glob!r} matches none of the {len(names)} modules "
                f"the candidate will run in FP8 (as {control_run / 'layers.json'} is admitted "
                "under its precision section); fix the glob"
            )


def fallback_manifest(source: Manifest, modules: dict[str, str]) -> Manifest:
    """The candidate with ``modules`` in the base dtype, as hand-written overrides (reviewed
    with the manifest, so ``approval`` is null)."""
    overrides = [o.model_dump(mode="json") for o in source.precision.overrides]
    overrides += [{"module": m, "reason": why, "approval": None} for m, why in modules.items()]
    reason = f"dual-track: FP8 with {len(modules)} high-risk modules in the base dtype"
    return derive(source, {"precision.overrides": overrides}, reason)


# -- recipe tracks: `fp8ops dualtrack MANIFEST --tracks bf16,delayed,current,...` ---------------

RECIPES = ("delayed", "current", "block", "mxfp8")
_RECIPE_FIELDS = (  # reset to their defaults in a track of another recipe (the schema refuses
    "amax_history_len",  # a field of one recipe set under another)
    "amax_compute_algo",
    "margin",
    "power_2_scale",
    "amax_epsilon",
    "x_block_scaling_dim",
    "w_block_scaling_dim",
    "grad_block_scaling_dim",
)


def parse_tracks(text: str) -> tuple[str, ...]:
    """``--tracks``: the BF16 control and one or more recipes, comma-separated, each once."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n != CONTROL and n not in RECIPES]
    if unknown:
        raise ManifestError(
            f"--tracks: unknown track {unknown[0]!r}; use {CONTROL} and any of {', '.join(RECIPES)}"
        )
    if len(set(names)) != len(names):
        raise ManifestError(f"--tracks {text}: a track is named twice")
    if CONTROL not in names or len(names) < 2:
        raise ManifestError(
            f"--tracks {text}: name the {CONTROL} control and at least one recipe, e.g. "
            f"{CONTROL},delayed,current"
        )
    return (CONTROL, *(n for n in names if n != CONTROL))


def recipe_manifest(source: Manifest, recipe: str) -> Manifest:
    """The candidate of one recipe: the source with ``precision.scaling`` set to it and every
    recipe field it does not own back at its default (the source's own recipe keeps its
    fields)."""
    if recipe == source.precision.scaling:
        return source
    defaults = type(source.precision).model_fields
    changes: dict = {"precision.scaling": recipe}
    for name in _RECIPE_FIELDS:
        if getattr(source.precision, name) != defaults[name].default:
            changes[f"precision.{name}"] = defaults[name].default
    return derive(source, changes, f"dual-track: {recipe} scaling")
