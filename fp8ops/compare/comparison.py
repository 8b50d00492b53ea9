"""``compare``: load the runs, judge every candidate against the reference, write
``OUT/verdict.json`` and ``OUT/report.html`` (and ``OUT/png/``).

::

    result = compare([Path("runs/bf16"), Path("runs/fp8")])      # or [Path("runs/dual")]
    result.verdict.verdict                                       # "pass" | "fail"

``fp8ops compare`` prints the result; ``fp8ops dualtrack`` calls this after its three tracks.
What ``verdict.json`` holds is ``verdict.py``'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from fp8ops.compare.gates import judge, one_bar
from fp8ops.compare.recipes import rank_recipes
from fp8ops.compare.runs import check_comparable, default_out, load_run, resolve_tracks
from fp8ops.compare.verdict import VERDICT, Verdict, reference_record, write_verdict
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import Gates, load_manifest

REPORT = "report.html"
PNG_DIR = "png"


@dataclass
class Comparison:
    """What :func:`compare` produced, and where."""

    verdict: Verdict
    out: Path
    verdict_path: Path
    report_path: Path
    pngs: list[Path] = field(default_factory=list)
    png_error: str | None = None  # PNG export failed; the JSON and HTML are written


def compare(
    inputs: list[Path],
    out: Path | None = None,
    *,
    png: bool = True,
    gates: Path | None = None,
    gpu: str | None = None,
) -> Comparison:
    """Judge the runs in ``inputs`` (run directories, the reference first, or one dual-track
    directory) and write the verdict and the report into ``out``. The thresholds are the runs'
    own gates, which must agree, or those of the manifest file ``gates``. ``gpu``: the target
    GPU whose published speedups a ranking of recipes shows (default: every GPU's).

    Bad input raises :class:`Fp8opsError` before anything is written. A PNG export that fails
    (no kaleido, no browser) leaves verdict.json and report.html written and is reported in
    :attr:`Comparison.png_error`, for the caller to decide.
    """
    try:
        from fp8ops.compare.report import build_figures, export_pngs, write_report
    except ImportError as exc:  # plotly comes with the console extra
        raise Fp8opsError(
            f"fp8ops compare draws its report with plotly, which cannot be imported ({exc}); "
            "install it with: pip install 'fp8ops[console]'"
        ) from None

    tracks, dualtrack = resolve_tracks(inputs)
    runs = [load_run(track) for track in tracks]
    reference, candidates = runs[0], runs[1:]
    check_comparable(reference, candidates)
    if gates is None:
        bar, source = one_bar(runs), {"source": "the runs' manifests"}
    else:
        bar, source = _gates_from(Path(gates))
    verdict = Verdict(
        reference=reference_record(reference),
        candidates=[judge(reference, candidate, bar) for candidate in candidates],
        created=datetime.now().astimezone().isoformat(timespec="seconds"),
        gates={**source, **bar.model_dump()},
    )
    verdict.recipes = rank_recipes(
        verdict.candidates,
        {run.label: run.manifest.precision.scaling for run in candidates},
        alerts={run.label: run.alerts for run in candidates},
        gpu=gpu,
    )
    verdict.target_gpu = gpu

    out = Path(out) if out is not None else default_out(tracks, dualtrack)
    result = Comparison(verdict, out, out / VERDICT, out / REPORT)
    write_verdict(result.verdict_path, verdict)
    figures = build_figures(runs)
    write_report(result.report_path, runs, verdict, figures)
    for stale in (out / PNG_DIR).glob("*.png"):  # an earlier comparison's plots
        stale.unlink()
    if png:
        try:
            result.pngs = export_pngs(figures, out / PNG_DIR)
        except Fp8opsError as exc:
            result.png_error = str(exc)
    return result


def _gates_from(path: Path) -> tuple[Gates, dict[str, str]]:
    """The gates section of the manifest file ``path``, which must write one (a manifest
    without it would judge by fp8ops' defaults, which nobody chose), and where it came from."""
    manifest = load_manifest(path)
    if "gates" not in manifest.model_fields_set:
        raise Fp8opsError(
            f"{path}: --gates: the manifest writes no gates section, so fp8ops' defaults would "
            "judge; write the gates you accept into it"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return manifest.gates, {"source": str(path), "file_sha256": digest}
