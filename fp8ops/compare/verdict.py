"""``verdict.json``: what a comparison decided, for every candidate and the reference.

:class:`Verdict` is the record (``to_json``: the file's content), :func:`write_verdict` writes
it; :func:`~fp8ops.compare.comparison.compare` makes one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8ops.compare.gates import CandidateVerdict, reference_problems
from fp8ops.compare.recipes import RecipeRow
from fp8ops.compare.runs import RunRecords
from fp8ops.files import atomic_write_text

VERDICT = "verdict.json"


@dataclass
class Verdict:
    reference: dict[str, Any]  # label, run_dir, manifest, fp8_modules, status, step, clean,
    # problems
    candidates: list[CandidateVerdict]
    created: str
    gates: dict[str, Any]  # the thresholds every candidate was judged by, and their source
    recipes: list[RecipeRow] = field(default_factory=list)  # candidates of different recipes
    target_gpu: str | None = None  # whose published speedups the ranking shows (None: all)

    @property
    def verdict(self) -> str:
        return "pass" if all(c.passed for c in self.candidates) else "fail"

    def to_json(self) -> dict[str, Any]:
        """verdict.json's content (non-finite numbers as "nan"/"inf": JSON has none)."""
        candidates = []
        for c in self.candidates:
            candidates.append(
                {
                    "label": c.label,
                    "run_dir": c.run_dir,
                    "manifest": c.manifest,
                    "fp8_modules": c.fp8_modules,
                    "verdict": "pass" if c.passed else "fail",
                    "cause": c.cause,
                    "gates": [asdict(gate) for gate in c.gates],
                    "worst_bucket": c.worst_bucket,
                    "worst_layer": c.worst_layer,
                    "evaluations": c.evaluations,
                    "capability": c.capability,
                    "fallback_modules": c.fallback_modules,
                }
            )
        document = {
            "verdict": self.verdict,
            "reference": self.reference,
            "candidates": candidates,
            "gates": self.gates,
            "created": self.created,
        }
        if self.recipes:
            document["recipes"] = [row.to_json() for row in self.recipes]
            document["target_gpu"] = self.target_gpu
        return _json_safe(document)


def write_verdict(path: Path, verdict: Verdict) -> None:
    """Write ``verdict``'s JSON to ``path`` atomically (readers see the old file or the new)."""
    text = json.dumps(verdict.to_json(), indent=2, allow_nan=False) + "\n"
    atomic_write_text(path, text)


def reference_record(run: RunRecords) -> dict[str, Any]:
    """The reference run as :attr:`Verdict.reference` records it."""
    problems = reference_problems(run)
    return {
        "label": run.label,
        "run_dir": str(run.path),
        "manifest": run.manifest_sha256,
        "fp8_modules": len(run.layers.table.fp8_fqns),
        "status": run.state,
        "step": run.last_step,
        "clean": not problems,
        "problems": problems,
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value
