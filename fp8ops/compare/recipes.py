"""Recipes side by side: candidates that differ in ``precision.scaling`` (``fp8ops dualtrack
--tracks``), ranked by the release gates, beside each recipe's published GEMM speedup.

The speedups are Transformer Engine's own (``docs/features/low_precision_training/
speedups.rst`` and ``gemm_profiling.rst``): GEMM time per layer of a 5B-class model (hidden
4096, FFN 16384, M = 15872 tokens) in autocast mode, so quantization included, over BF16.
They are published figures, not measured here, and say nothing of a model other than theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8ops.alerts import Alert
from fp8ops.compare.gates import CandidateVerdict

# GPU -> recipe -> GEMM speedup over BF16 (TE's tables); a recipe a GPU does not run natively,
# or TE did not measure there, is absent.
PUBLISHED_SPEEDUP = {
    "H200": {"delayed": 1.69, "current": 1.58, "block": 1.40},
    "B300": {"delayed": 1.64, "current": 1.39, "mxfp8": 1.42},
}


GPUS = tuple(PUBLISHED_SPEEDUP)


@dataclass(frozen=True)
class RecipeRow:
    rank: int
    label: str
    scaling: str
    passed: bool
    failed_gates: tuple[str, ...]
    alerts: dict[str, int]  # level -> alerts the candidate raised ("stop", "degrade", "observe")
    loss_gap: float | None  # the final matched evaluation's gap to the reference
    published: dict[str, float | None]  # GPU -> speedup (the target GPU only, when one is given)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "label": self.label,
            "scaling": self.scaling,
            "verdict": "pass" if self.passed else "fail",
            "failed_gates": list(self.failed_gates),
            "alerts": self.alerts,
            "loss_gap": self.loss_gap,
            "published_gemm_speedup": self.published,
            "published_speedup_source": "Transformer Engine's docs (not measured)",
        }


def rank_recipes(
    candidates: list[CandidateVerdict],
    scalings: dict[str, str],
    alerts: dict[str, list[Alert]] | None = None,
    gpu: str | None = None,
) -> list[RecipeRow]:
    """The candidates ranked by the gates: those that pass every gate first, then fewer failed
    gates, then fewer Stop and then Degrade alerts in the run, then the lower loss gap
    (candidate minus reference; a missing gap last). ``scalings``: label -> precision.scaling;
    ``alerts``: label -> the run's alerts; ``gpu``: the target GPU whose published speedups
    are shown (default: every GPU's). Empty unless at least two candidates run different
    recipes."""
    if len({scalings[c.label] for c in candidates}) < 2:
        return []
    if gpu is not None and gpu not in PUBLISHED_SPEEDUP:
        raise ValueError(f"no published speedups for GPU {gpu!r}; known: {', '.join(GPUS)}")
    alerts = alerts or {}

    def gap(c: CandidateVerdict) -> float | None:
        found = [g.value for g in c.gates if g.name == "loss_gap" and g.value is not None]
        return float(found[0]) if found else None

    def counts(c: CandidateVerdict) -> dict[str, int]:
        levels = [a.level for a in alerts.get(c.label, [])]
        return {level: levels.count(level) for level in ("stop", "degrade", "observe")}

    def order(c: CandidateVerdict):
        failed = sum(not g.passed for g in c.gates)
        raised, value = counts(c), gap(c)
        # the gap is the candidate's loss minus the reference's: lower is better, below 0 too
        return (
            not c.passed,
            failed,
            raised["stop"],
            raised["degrade"],
            value is None,
            value if value is not None else 0.0,
        )

    tables = PUBLISHED_SPEEDUP if gpu is None else {gpu: PUBLISHED_SPEEDUP[gpu]}
    rows = []
    for rank, c in enumerate(sorted(candidates, key=order), start=1):
        scaling = scalings[c.label]
        rows.append(
            RecipeRow(
                rank=rank,
                label=c.label,
                scaling=scaling,
                passed=c.passed,
                failed_gates=tuple(g.name for g in c.gates if not g.passed),
                alerts=counts(c),
                loss_gap=gap(c),
                published={name: table.get(scaling) for name, table in tables.items()},
            )
        )
    return rows
