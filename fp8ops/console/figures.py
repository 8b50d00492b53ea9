"""The console's plotly figures, and how they reach the page.

Each figure is a plain ``go.Figure`` built once with its traces in a fixed order; each
``show_*`` function fills them from the data classes of ``data.py`` and ``whatif.py`` and
publishes the figure. A :class:`FigureView` shows a figure in an ``ipywidgets.Output`` as
Jupyter's plotly mimetype (rendered by the ``jupyterlab-plotly`` extension that plotly
installs), not as a ``go.FigureWidget``. Measured in Voila on this machine (2 busy cores), a page
of three small plots appeared after 11.4 s as FigureWidgets and after 4.0 s as mimetype plots
(3.2 s without plots): every FigureWidget ships plotly's 5 MB widget bundle through the kernel's
websocket, and the kernel first imports plotly's widget machinery (1.3 s). An update re-sends
the figure (0.15 MB for a module view, 3.4 MB for a 256 x 1000 heatmap; ``ci/bench_console.py``),
which the browser draws anew.
"""

from __future__ import annotations

import html
import json

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from fp8ops.console.data import MAX_POINTS, Heatmap, Series, bin_size, pool
from fp8ops.run.switches import Switch
from fp8ops.telemetry.catalogue import applies

FONT = {"size": 11}
MARKERS_UP_TO = 200  # points; beyond, a line alone (each marker is an SVG element to draw)
MIMETYPE = "application/vnd.plotly.v1+json"


class FigureView:
    """A figure and the widget that shows it: ``widget`` holds an Output for the plot and a
    style rule giving the plot its height.

    Why the rule: the renderer resizes a plot whose layout has a height but no width to fit its
    container (plotly.js ``Plots.resize`` drops the height), and an output area is as tall as
    its content, so a plot could collapse to nothing. With the container as tall as the
    figure, the plot keeps its height and takes the page's width.
    """

    def __init__(self, figure: go.Figure, css_class: str):
        self.figure, self.css_class = figure, css_class
        self.output = W.Output(layout=W.Layout(width="100%"))
        self.style = W.HTML()
        self.widget = W.VBox([self.style, self.output], layout=W.Layout(width="100%"))
        self.widget.add_class(css_class)

    def clear(self) -> None:
        self.output.outputs, self.style.value = (), ""

    def publish(self) -> None:
        """Show the figure as it is now. Setting ``outputs`` (rather than displaying into the
        widget) works from any thread and before the page exists: it is the widget's state."""
        spec = json.loads(pio.to_json(self.figure, validate=False))  # numpy as typed arrays
        spec["config"] = {"displaylogo": False, "responsive": True}
        height = int(self.figure.layout.height or 450)
        self.style.value = (
            f"<style>.{self.css_class} .js-plotly-plot {{height: {height}px}}</style>"
        )
        self.output.outputs = (
            {
                "output_type": "display_data",
                "metadata": {},
                "data": {MIMETYPE: spec, "text/plain": self.figure.layout.title.text or "figure"},
            },
        )


# --------------------------------------------------------------------------------------
# Modules x steps heatmap
# --------------------------------------------------------------------------------------


def heatmap_figure() -> go.Figure:
    return go.Figure(
        go.Heatmap(
            z=[[]],
            colorscale="Viridis",
            hoverongaps=False,
            name="",
            hovertemplate="%{y}<br>steps from %{x}<br>%{customdata:.4g}<extra></extra>",
        ),
        layout=go.Layout(
            height=420,
            margin={"l": 10, "r": 10, "t": 40, "b": 40},
            font=FONT,
            xaxis={"title": {"text": "step"}},
            yaxis={"autorange": "reversed"},
            title={"text": "", "x": 0.01},
        ),
    )


def show_heatmap(view: FigureView, hm: Heatmap, *, log: bool, title: str) -> None:
    """Fill the heatmap: colours on a log10 scale if ``log`` (zeros and negatives blank), the
    raw value in the hover text either way."""
    z = hm.z  # float32: half the bytes of float64 to the browser
    shown, colorbar = z, {"title": {"text": ""}}
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            shown = np.where(z > 0, np.log10(z), np.nan).astype(np.float32)
        finite = shown[np.isfinite(shown)]
        if finite.size:
            ticks = np.arange(np.floor(finite.min()), np.ceil(finite.max()) + 1)
            colorbar = {
                "title": {"text": "log10"},
                "tickvals": ticks,
                "ticktext": [f"1e{int(t)}" for t in ticks],
            }
    many = len(hm.modules) > 48  # beyond that, names overlap: hover tells the module
    fig = view.figure
    with fig.batch_update():
        trace = fig.data[0]
        trace.z, trace.customdata = shown, z
        trace.x, trace.y = hm.starts, list(hm.modules)
        trace.colorbar = colorbar
        fig.layout.title.text = title
        fig.layout.yaxis.showticklabels = not many
        fig.layout.height = 420 if many else max(260, 60 + 22 * len(hm.modules))
        fig.layout.margin.l = 10 if many else 280
    view.publish()


# --------------------------------------------------------------------------------------
# One module over steps
# --------------------------------------------------------------------------------------

# (trace name, row, on the secondary y axis) in the order the traces are added.
DETAIL_TRACES = (
    ("amax", 1, False),
    ("window max", 1, False),
    ("scale", 1, True),
    ("saturation", 2, False),
    ("underflow", 2, False),
    ("blocks at floor", 2, False),
    ("grad norm", 3, False),
    ("FP8 vs BF16 error", 4, False),
)


def detail_figure() -> go.Figure:
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        row_heights=[0.4, 0.2, 0.2, 0.2],
        specs=[[{"secondary_y": True}], [{}], [{}], [{}]],
        subplot_titles=(
            "amax, its window max, and the scale (right)",
            "saturated / underflowed fraction of the casts",
            "gradient norm (this rank's shard)",
            "FP8 vs BF16 output error",
        ),
    )
    dashes = {"window max": "dot", "scale": "dash"}
    for name, row, secondary in DETAIL_TRACES:
        mode = "lines" if row == 1 else "lines+markers"
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                name=name,
                mode=mode,
                marker={"size": 4},
                line={"dash": dashes.get(name, "solid"), "width": 1.5},
            ),
            row=row,
            col=1,
            secondary_y=secondary,
        )
    fig.update_yaxes(type="log", row=1, col=1, secondary_y=False, title_text="|value|")
    fig.update_yaxes(type="log", row=1, col=1, secondary_y=True, title_text="scale")
    fig.update_xaxes(title_text="step", row=4, col=1)
    fig.update_layout(
        height=720,
        margin={"l": 10, "r": 10, "t": 60, "b": 40},
        font=FONT,
        title={"text": "", "x": 0.01},
        legend={"orientation": "h", "y": -0.08},
    )
    return fig


def show_detail(
    view: FigureView, lines: dict[str, Series], slot: str, title: str, scaling: str | None = None
) -> None:
    """Fill the module view from ``data.module_history``'s lines. ``scaling``, the module's
    recipe, marks the lines it has no values for as not applicable (window max and scale
    changes are delayed scaling's, a per-tensor scale is not a block recipe's, blocks at the
    floor are block scaling's and MXFP8's)."""
    by_trace = {
        "amax": f"{slot}.amax",
        "window max": f"{slot}.window_max",
        "scale": f"{slot}.scale",
        "saturation": f"{slot}.saturation",
        "underflow": f"{slot}.underflow",
        "blocks at floor": f"{slot}.blocks_at_floor",
        "grad norm": "grad_norm",
        "FP8 vs BF16 error": "fp8_rel_error",
    }
    fig = view.figure
    with fig.batch_update():
        for trace, (name, _, _) in zip(fig.data, DETAIL_TRACES, strict=True):
            metric = by_trace[name]
            line = lines[metric]
            trace.x, trace.y = line.steps, line.values
            if name not in ("amax", "window max", "scale"):  # SVG markers cost: few points only
                trace.mode = "lines+markers" if len(line.steps) <= MARKERS_UP_TO else "lines"
            label = f"{slot} {name}" if name in ("amax", "window max", "scale") else name
            if scaling is not None and not applies(metric, scaling):
                label += f" (n/a: {scaling} scaling)"
            trace.name = label
        fig.layout.title.text = title
    view.publish()


# --------------------------------------------------------------------------------------
# Precision switches
# --------------------------------------------------------------------------------------

# One trace (a row of markers) per source of switches, in this order.
SWITCH_SOURCES = ("schedule", "auto-degrade")
HOVER_MODULES = 12  # modules listed in a marker's hover text; the table below lists them all


def timeline_figure() -> go.Figure:
    fig = go.Figure(
        [
            go.Scatter(
                x=[],
                y=[],
                name=source,
                mode="markers",
                marker={"size": 11, "symbol": symbol},
                hovertemplate="%{hovertext}<extra></extra>",
            )
            for source, symbol in zip(SWITCH_SOURCES, ("diamond", "x"), strict=True)
        ],
        layout=go.Layout(
            height=200,
            margin={"l": 10, "r": 10, "t": 40, "b": 40},
            font=FONT,
            xaxis={"title": {"text": "first step under the new precision"}},
            yaxis={
                "type": "category",
                "categoryorder": "array",
                "categoryarray": SWITCH_SOURCES,
            },
            title={"text": "", "x": 0.01},
            showlegend=False,
        ),
    )
    return fig


def show_timeline(view: FigureView, switches: list[Switch], train_steps: int | None) -> None:
    """A marker per switch at its step, in its source's row; the hover text says why and what
    the modules run from then on. The x axis spans the run's steps when ``train_steps`` is
    known, so a switch shows where in training it falls."""
    fig = view.figure
    with fig.batch_update():
        for trace, source in zip(fig.data, SWITCH_SOURCES, strict=True):
            mine = [s for s in switches if s.source == source]
            trace.x = [s.step for s in mine]
            trace.y = [source] * len(mine)
            trace.hovertext = [switch_hover(s) for s in mine]
        fig.layout.xaxis.range = [0, train_steps + 1] if train_steps else None
        fig.layout.title.text = f"precision switches: {len(switches)}"
    view.publish()


def switch_hover(switch: Switch) -> str:
    """A marker's hover text: step and cause, then up to HOVER_MODULES modules with what they
    run from then on."""
    lines = [f"step {switch.step}: {html.escape(switch.cause)}"]
    modules = list(switch.modules.items())
    lines += [f"{html.escape(m)}: {html.escape(now)}" for m, now in modules[:HOVER_MODULES]]
    if len(modules) > HOVER_MODULES:
        lines.append(f"... and {len(modules) - HOVER_MODULES} more (the table below)")
    return "<br>".join(lines)


# --------------------------------------------------------------------------------------
# Window what-if
# --------------------------------------------------------------------------------------

WHATIF_TRACES = (
    ("amax (recorded)", 1),
    ("largest value the run's scales held", 1),
    ("largest value the what-if's scales held", 1),
    ("what-if overflow", 1),
    ("headroom, run's settings", 2),
    ("headroom, what-if", 2),
)


def whatif_figure() -> go.Figure:
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        row_heights=[0.6, 0.4],
        subplot_titles=(
            "amax against fp8_max / scale (above the line: overflow)",
            "headroom: bits of FP8 range left unused (< 0: overflow)",
        ),
    )
    styles = [
        {"mode": "lines", "line": {"width": 1.5}},
        {"mode": "lines", "line": {"dash": "dot", "width": 1.5}},
        {"mode": "lines", "line": {"dash": "dash", "width": 1.5}},
        {"mode": "markers", "marker": {"symbol": "x", "size": 7, "color": "crimson"}},
        {"mode": "lines", "line": {"dash": "dot", "width": 1.5}},
        {"mode": "lines", "line": {"dash": "dash", "width": 1.5}},
    ]
    for (name, row), style in zip(WHATIF_TRACES, styles, strict=True):
        fig.add_trace(go.Scatter(x=[], y=[], name=name, **style), row=row, col=1)
    fig.update_yaxes(type="log", row=1, col=1, title_text="|value|")
    fig.update_yaxes(title_text="bits", row=2, col=1, zeroline=True, zerolinecolor="crimson")
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        height=520,
        margin={"l": 10, "r": 10, "t": 60, "b": 40},
        font=FONT,
        title={"text": "", "x": 0.01},
        legend={"orientation": "h", "y": -0.12},
    )
    return fig


def show_whatif(view: FigureView, what, title: str) -> None:
    """Fill the what-if view from a ``whatif.SlotWhatIf``, pooled to MAX_POINTS points (the
    largest amax, the smallest representable value and headroom of each bin)."""
    steps, size = what.steps, bin_size(len(what.steps), MAX_POINTS)
    x = steps[::size]
    amax = what.run.amax[:, 0]
    over = what.what_if.overflow[:, 0]
    columns = [
        pool(amax, size, "max"),
        pool(what.run.representable[:, 0], size, "min"),
        pool(what.what_if.representable[:, 0], size, "min"),
        None,
        pool(what.run.headroom_bits[:, 0], size, "min"),
        pool(what.what_if.headroom_bits[:, 0], size, "min"),
    ]
    fig = view.figure
    with fig.batch_update():
        for trace, values in zip(fig.data, columns, strict=True):
            if values is None:  # the overflowing steps themselves, at their amax
                trace.x, trace.y = steps[over][:MAX_POINTS], amax[over][:MAX_POINTS]
            else:
                trace.x, trace.y = x, values
        fig.layout.title.text = title
    view.publish()
