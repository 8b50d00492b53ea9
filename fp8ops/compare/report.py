"""``report.html``: the verdict and the plots behind it, one self-contained page (plotly.js is
embedded once, so the file opens offline), and PNGs of the main plots through kaleido.

Sections, in order: the verdict table; training and held-out loss against tokens; gradient-
and update-norm distributions; throughput and peak memory; capability accuracy per bucket;
per-layer telemetry (each FP8 run); loss around every resume.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from fp8ops.compare.gates import RESUME_WINDOW
from fp8ops.compare.runs import RunRecords, finite
from fp8ops.errors import Fp8opsError
from fp8ops.files import atomic_write_text

if TYPE_CHECKING:
    from fp8ops.compare.verdict import Verdict

PNG_FIGURES = ("loss", "buckets", "layers")  # the main plots, exported to OUT/png/<name>.png
MAX_POINTS = 2000  # per line; longer series are averaged in bins (the page stays light)
FONT = {"size": 12}
PALETTE = qualitative.Plotly


def build_figures(runs: list[RunRecords]) -> dict[str, go.Figure | None]:
    """Every plot of the report by section name; None where the runs have nothing to show."""
    colors = {run.label: PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}
    return {
        "loss": _loss_figure(runs, colors),
        "norms": _norms_figure(runs, colors),
        "throughput": _throughput_figure(runs, colors),
        "buckets": _buckets_figure(runs, colors),
        "layers": _layers_figure(runs, colors),
        "resumes": _resumes_figure(runs, colors),
    }


# --------------------------------------------------------------------------------------
# The figures
# --------------------------------------------------------------------------------------


def _loss_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure:
    figure = _figure("Training and held-out loss against training tokens", height=480)
    for run in runs:
        tokens = [run.tokens_through[m["step"]] for m in run.metrics]
        x, y = _thin(tokens, [_number(m["loss"]) for m in run.metrics])
        figure.add_scatter(
            x=x,
            y=y,
            mode="lines",
            name=f"{run.label} train",
            opacity=0.55,
            line={"color": colors[run.label], "width": 1},
        )
        evals = [e for e in run.evals if e["step"] in run.tokens_through]
        figure.add_scatter(
            x=[run.tokens_through[e["step"]] for e in evals],
            y=[_number(e["loss"]) for e in evals],
            customdata=[e["step"] for e in evals],
            hovertemplate="step %{customdata}<br>tokens %{x}<br>eval loss %{y:.4f}",
            mode="lines+markers",
            name=f"{run.label} eval",
            line={"color": colors[run.label], "width": 2.5, "dash": "dot"},
        )
    figure.update_xaxes(title_text="training tokens")
    figure.update_yaxes(title_text="loss (nats/token)")
    return figure


def _norms_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure:
    figure = make_subplots(rows=1, cols=2, subplot_titles=("gradient norm", "update norm"))
    _style(figure, "Gradient- and update-norm distributions over all steps", height=420)
    for col, key in ((1, "grad_norm"), (2, "update_norm")):
        for run in runs:
            values = np.array([m[key] for m in run.metrics if finite(m.get(key))], dtype=float)
            if values.size == 0:
                continue
            # Five numbers and the mean instead of every value: 100k steps stay a few bytes.
            q1, median, q3 = np.percentile(values, [25, 50, 75])
            figure.add_trace(
                go.Box(
                    x=[run.label],
                    q1=[q1],
                    median=[median],
                    q3=[q3],
                    mean=[values.mean()],
                    lowerfence=[values.min()],
                    upperfence=[values.max()],
                    name=run.label,
                    marker_color=colors[run.label],
                    showlegend=False,
                ),
                row=1,
                col=col,
            )
    figure.update_yaxes(type="log")
    return figure


def _throughput_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure:
    figure = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("tokens/s (median; bars: 10th-90th percentile)", "peak memory (MiB)"),
    )
    _style(figure, "Throughput and peak memory per run", height=380)
    for run in runs:
        rates = [m["tokens_per_s"] for m in run.metrics if finite(m.get("tokens_per_s"))]
        memory = [m["peak_memory_mib"] for m in run.metrics if finite(m.get("peak_memory_mib"))]
        color = colors[run.label]
        if rates:
            p10, median, p90 = np.percentile(rates, [10, 50, 90])
            figure.add_bar(
                x=[run.label],
                y=[median],
                marker_color=color,
                showlegend=False,
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [p90 - median],
                    "arrayminus": [median - p10],
                },
                row=1,
                col=1,
            )
        if memory:
            figure.add_bar(
                x=[run.label], y=[max(memory)], marker_color=color, showlegend=False, row=1, col=2
            )
    return figure


def _buckets_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure | None:
    """Accuracy per bucket at the last capability step every run reached with equal tokens
    (each run's last evaluation when they share none)."""
    with_records = [run for run in runs if run.capability]
    if not with_records:
        return None
    common = set.intersection(*({r["step"] for r in run.capability} for run in with_records))
    common = {
        step for step in common if len({run.tokens_through.get(step) for run in with_records}) == 1
    }
    step = max(common, default=None)
    title = (
        f"Capability accuracy per bucket at step {step}"
        if step
        else ("Capability accuracy per bucket at each run's last evaluation (no common step)")
    )
    figure = _figure(title, height=440)
    for run in with_records:
        record = next((r for r in run.capability if r["step"] == step), run.capability[-1])
        names = ["overall", *sorted(record["buckets"])]
        entries = [record, *(record["buckets"][name] for name in names[1:])]
        figure.add_bar(
            x=names,
            y=[_number(e.get("accuracy")) for e in entries],
            name=run.label,
            marker_color=colors[run.label],
            customdata=[[e.get("correct"), e.get("items")] for e in entries],
            hovertemplate="%{x}: %{y:.3f} (%{customdata[0]} of %{customdata[1]})",
        )
    figure.update_layout(barmode="group")
    figure.update_yaxes(title_text="accuracy (exact match)", range=[0, 1])
    return figure


def _layers_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure | None:
    fp8_runs = [
        run
        for run in runs
        if run.telemetry is not None and any(layer.fp8 for layer in run.telemetry.layers)
    ]
    if not fp8_runs:
        return None
    titles = (
        "max saturation (any FP8 slot)",
        "max underflow (any FP8 slot)",
        "mean FP8-vs-reference GEMM error (sampled)",
    )
    figure = make_subplots(
        rows=3, cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.08
    )
    windows = ", ".join(
        f"{run.label} steps {run.telemetry.window[0]}-{run.telemetry.window[1]}" for run in fp8_runs
    )
    modules = len({layer.module for run in fp8_runs for layer in run.telemetry.layers})
    _style(
        figure,
        f"Per-layer FP8 telemetry, last quarter of each run ({windows})",
        height=620 + 6 * modules,
    )
    for run in fp8_runs:
        layers = [layer for layer in run.telemetry.layers if layer.fp8]
        names = [layer.module for layer in layers]
        for row, values in enumerate(
            (
                [layer.max_saturation for layer in layers],
                [layer.max_underflow for layer in layers],
                [layer.fp8_error for layer in layers],
            ),
            start=1,
        ):
            figure.add_bar(
                x=names,
                y=values,
                name=run.label,
                legendgroup=run.label,
                showlegend=row == 1,
                marker_color=colors[run.label],
                row=row,
                col=1,
            )
    figure.update_layout(barmode="group")
    figure.update_xaxes(tickangle=-45, row=3, col=1)
    return figure


def _resumes_figure(runs: list[RunRecords], colors: dict[str, str]) -> go.Figure | None:
    """Training loss around every resume, the resume step marked, the windows gates.
    resume_loss_jump compares shaded."""
    resumes = [
        (run, step)
        for run in runs
        for step in sorted({r.step for r in run.resumes} | set(run.restarts))
    ]
    if not resumes:
        return None
    checkpoints = {(run.label, r.step): r.checkpoint for run in runs for r in run.resumes}
    titles = [
        f"{run.label}: resumed after step {step}"
        + (f" from {checkpoints[(run.label, step)]}" if checkpoints.get((run.label, step)) else "")
        for run, step in resumes
    ]
    figure = make_subplots(rows=len(resumes), cols=1, subplot_titles=titles)
    _style(figure, "Continuity around every resume", height=260 * len(resumes) + 80)
    for row, (run, step) in enumerate(resumes, start=1):
        span = [m for m in run.metrics if abs(m["step"] - step) <= 3 * RESUME_WINDOW]
        figure.add_scatter(
            x=[m["step"] for m in span],
            y=[_number(m["loss"]) for m in span],
            mode="lines+markers",
            marker={"size": 4},
            name=run.label,
            showlegend=False,
            line={"color": colors[run.label]},
            row=row,
            col=1,
        )
        figure.add_vrect(
            x0=step - RESUME_WINDOW + 0.5,
            x1=step + RESUME_WINDOW + 0.5,
            fillcolor="grey",
            opacity=0.12,
            line_width=0,
            row=row,
            col=1,
        )
        figure.add_vline(x=step + 0.5, line={"color": "crimson", "dash": "dash"}, row=row, col=1)
        figure.update_yaxes(title_text="train loss", row=row, col=1)
    figure.update_xaxes(title_text="step", row=len(resumes), col=1)
    return figure


def _figure(title: str, height: int) -> go.Figure:
    figure = go.Figure()
    _style(figure, title, height)
    return figure


def _style(figure: go.Figure, title: str, height: int) -> None:
    figure.update_layout(
        title={"text": title, "x": 0.01},
        height=height,
        font=FONT,
        template="plotly_white",
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
    )


def _number(value: Any) -> float | None:
    return float(value) if finite(value) else None  # a gap in the line, not a crash


def _thin(x: list[float], y: list[float | None]) -> tuple[list[float], list[float | None]]:
    """At most MAX_POINTS points: bin means of longer series (missing values left out)."""
    if len(x) <= MAX_POINTS:
        return x, y
    size = math.ceil(len(x) / MAX_POINTS)
    xs, ys = [], []
    for start in range(0, len(x), size):
        known = [v for v in y[start : start + size] if v is not None]
        xs.append(x[min(start + size, len(x)) - 1])
        ys.append(sum(known) / len(known) if known else None)
    return xs, ys


# --------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------

SECTIONS = (
    ("loss", "Training and held-out loss", "no losses recorded"),
    ("norms", "Gradient and update norms", "no norms recorded"),
    ("throughput", "Throughput and memory", "no throughput recorded"),
    ("buckets", "Capability accuracy per bucket", "no run has capability records"),
    ("layers", "Per-layer FP8 telemetry", "no FP8 run has telemetry"),
    ("resumes", "Continuity around resumes", "no run was resumed"),
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
.pass { color: #176a2c; font-weight: 600; } .fail { color: #b3261e; font-weight: 600; }
.cause { margin: 0.3em 0; } code { font-size: 0.95em; }
"""


def write_report(
    path: Path, runs: list[RunRecords], verdict: Verdict, figures: dict[str, go.Figure | None]
) -> None:
    """The page, written atomically; plotly.js inline once, every figure a div after it."""
    from plotly.offline import get_plotlyjs

    body = [
        f"<h1>fp8ops compare: {_verdict_word(verdict.verdict)}</h1>",
        '<section id="verdict"><h2>Verdict</h2>',
        _verdict_html(verdict),
        "</section>",
    ]
    for name, heading, empty in SECTIONS:
        figure = figures.get(name)
        content = (
            f"<p>{html.escape(empty)}</p>"
            if figure is None
            else pio.to_html(
                figure,
                full_html=False,
                include_plotlyjs=False,
                config={"displaylogo": False, "responsive": True},
            )
        )
        body.append(f'<section id="{name}"><h2>{html.escape(heading)}</h2>{content}</section>')
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>fp8ops compare: {verdict.verdict}</title><style>{STYLE}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
        f"<body>{''.join(body)}</body></html>\n"
    )
    atomic_write_text(path, page)


def _verdict_html(verdict: Verdict) -> str:
    ref = verdict.reference
    state = (
        ""
        if ref["clean"]
        else (f': <span class="fail">not clean</span>: {html.escape("; ".join(ref["problems"]))}')
    )
    reference = (
        f"<p>Reference <b>{html.escape(ref['label'])}</b> (<code>{html.escape(ref['run_dir'])}"
        f"</code>, status {html.escape(str(ref['status']))} at step {ref['step']}){state}. "
        f"Created {html.escape(verdict.created)}.</p>"
    )
    header = "".join(
        f"<th>{name}</th>"
        for name in ("candidate", "gate", "value", "threshold", "result", "detail")
    )
    rows = [reference, f"<table><tr>{header}</tr>"]
    for candidate in verdict.candidates:
        for gate in candidate.gates:
            result = "pass" if gate.passed else "fail"
            rows.append(
                f"<tr><td>{html.escape(candidate.label)}</td><td>{gate.name}</td>"
                f"<td>{html.escape(format_value(gate.value))}</td>"
                f"<td>{html.escape(format_value(gate.threshold))}</td>"
                f'<td class="{result}">{result}</td><td>{html.escape(gate.detail)}</td></tr>'
            )
    rows.append("</table>")
    for candidate in verdict.candidates:
        word = _verdict_word("pass" if candidate.passed else "fail")
        text = html.escape(candidate.cause or "every gate passed")
        rows.append(
            f'<p class="cause"><b>{html.escape(candidate.label)}</b> ({candidate.fp8_modules} '
            f"FP8 modules): {word} {text}</p>"
        )
        if candidate.worst_bucket:
            b = candidate.worst_bucket
            rows.append(
                f'<p class="cause">worst bucket {html.escape(b["bucket"])}: '
                f"{format_value(b['reference_accuracy'])} -> "
                f"{format_value(b['candidate_accuracy'])} ({b['lost']} lost, {b['gained']} "
                f"gained of {b['items']})</p>"
            )
        if candidate.fallback_modules:
            kept = ", ".join(f"{m} ({why})" for m, why in candidate.fallback_modules.items())
            rows.append(f'<p class="cause">kept in BF16: {html.escape(kept)}</p>')
    if verdict.recipes:
        rows.append(_recipes_html(verdict))
    return "\n".join(rows)


def _recipes_html(verdict: Verdict) -> str:
    """The ranking of recipes, beside Transformer Engine's published speedups."""
    gpus = list(verdict.recipes[0].published)
    names = ["rank", "candidate", "scaling", "gates", "alerts (stop/degrade/observe)"]
    names += ["loss gap", *(f"{g} GEMM speedup (published)" for g in gpus)]
    header = "".join(f"<th>{html.escape(name)}</th>" for name in names)
    rows = [
        "<h3>Recipes</h3><p>Ranked by the gates, then by Stop and Degrade alerts, then by the "
        "loss gap. The speedups are Transformer Engine's published GEMM times of a 5B-class "
        "layer over BF16, <b>not measured here</b>.</p>",
        f"<table><tr>{header}</tr>",
    ]
    for row in verdict.recipes:
        gates = "pass" if row.passed else "fail: " + ", ".join(row.failed_gates)
        alerts = "/".join(str(row.alerts[level]) for level in ("stop", "degrade", "observe"))
        speedups = "".join(
            f"<td>{row.published[g]:.2f}x</td>" if row.published[g] else "<td>not published</td>"
            for g in gpus
        )
        rows.append(
            f"<tr><td>{row.rank}</td><td>{html.escape(row.label)}</td>"
            f"<td>{html.escape(row.scaling)}</td>"
            f'<td class="{"pass" if row.passed else "fail"}">{html.escape(gates)}</td>'
            f"<td>{alerts}</td><td>{html.escape(format_value(row.loss_gap))}</td>{speedups}</tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)


def _verdict_word(word: str) -> str:
    return f'<span class="{word}">{word.upper()}</span>'


def format_value(value: Any) -> str:
    """A gate's value or threshold for a table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "allowed" if value else "not allowed"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


# --------------------------------------------------------------------------------------
# PNG export
# --------------------------------------------------------------------------------------


def export_pngs(figures: dict[str, go.Figure | None], directory: Path) -> list[Path]:
    """The main plots as ``directory/<name>.png``, all through one browser session (kaleido
    1.x drives a local Chromium; one start costs 2-4 s, each image after it well under 1 s)."""
    import importlib.util

    if importlib.util.find_spec("kaleido") is None:
        raise Fp8opsError(
            "PNG export needs kaleido (pip install 'kaleido>=1', the console extra) and a "
            "Chromium; report.html and verdict.json are written. Pass --no-png to skip PNGs"
        )
    chosen = {name: figures[name] for name in PNG_FIGURES if figures.get(name) is not None}
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.png" for name in chosen]
    try:
        pio.write_images(
            list(chosen.values()),
            paths,
            width=1100,
            height=[int(f.layout.height or 500) for f in chosen.values()],
        )
    except Exception as exc:  # noqa: BLE001 - kaleido, choreographer and the browser raise many kinds
        raise Fp8opsError(
            f"PNG export failed ({type(exc).__name__}: {_first_line(exc)}); kaleido needs a "
            "Chromium or Chrome (Debian: apt-get install chromium; or set BROWSER_PATH). "
            "report.html and verdict.json are written. Pass --no-png to skip PNGs"
        ) from None
    return paths


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
