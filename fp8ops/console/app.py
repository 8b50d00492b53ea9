"""The ops console: one ipywidgets application over a directory of runs.

::

    from fp8ops.console import ConsoleApp
    app = ConsoleApp("runs", user="ana")   # notebooks/console.ipynb does this, Voila serves it
    app                                    # displays it

Everything the page does goes through this object, so tests drive it without a browser: set a
widget's value or ``click()`` a button, then read the figures' data and the files on disk.

Sections, top to bottom: run picker and operator; the run's header; a modules x steps heatmap
of one metric; the precision switches (the schedule's and the auto-degrade policy's: a marker
per switch over the run's steps, and a table); one module's history; the alerts; the overrides
(stage, approve, reject, revoke, the ledger's state per module, what the next resume would
apply); the window what-if.

Keeping the kernel responsive: reads that can take a while (a run to show, pooling a long run's
whole history, a what-if replay, the follower's poll) run in a worker thread, and only the
widget updates happen on the kernel's event loop. Widget callbacks that read little (a module's
history: tens of milliseconds) and the ledger actions run directly. Without a running event
loop (tests, scripts) the same work runs synchronously, so a test sees its result at once.
"""

from __future__ import annotations

import asyncio
import html
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ipywidgets as W

from fp8ops.admission import module_recipe
from fp8ops.alerts import Alert, read_alerts, select_alerts
from fp8ops.alerts.records import format_value
from fp8ops.console import figures
from fp8ops.console.data import Heatmap, Overview, Series, module_history, window_heatmap
from fp8ops.console.ledger_state import ModuleState, fp8_modules, module_states, open_overrides
from fp8ops.console.resume_preview import ResumePreview, preview_resume
from fp8ops.console.runs import RunHeader, find_runs, open_telemetry, read_header
from fp8ops.errors import Fp8opsError
from fp8ops.gemm_roles import GEMMS
from fp8ops.manifest import Manifest, load_manifest
from fp8ops.overrides import Ledger, Override, default_user
from fp8ops.overrides.signing import KEY_ENV
from fp8ops.run import RunLayout
from fp8ops.run.layout import ALERTS, CHECKPOINTS, EVENTS, LAYERS, MANIFEST, OVERRIDES, STATUS
from fp8ops.run.switches import Switch, read_switches
from fp8ops.telemetry import MODULE_METRIC_NAMES, TelemetryRun
from fp8ops.telemetry.catalogue import SLOTS, applies

RUNS_ENV, USER_ENV = "FP8OPS_CONSOLE_RUNS", "FP8OPS_USER"

# The heatmap's first choices (the list); every other module metric follows.
HEATMAP_METRICS = [
    f"{s}.{m}"
    for m in ("saturation", "underflow", "amax", "scale_change", "blocks_at_floor")
    for s in SLOTS
] + ["fp8_rel_error"]
DEFAULT_METRIC = "input.amax"
METRIC_CHOICES = HEATMAP_METRICS + [m for m in MODULE_METRIC_NAMES if m not in HEATMAP_METRICS]
CATALOGUE = frozenset(MODULE_METRIC_NAMES)
WINDOWS = [
    ("last 1,000 steps", 1_000),
    ("last 10,000 steps", 10_000),
    ("last 100,000 steps", 100_000),
    ("whole run", 0),
]
HOTTEST = 10  # modules listed under the heatmap, worst first
DEFAULT_WINDOW = 10_000  # read in < 0.5 s at 256 modules; "whole run" pools in the background
FOLLOW_EVERY_S = 2.0
_STALE = object()  # what background work queued for a run no longer on screen returns
# Files whose change means a view must be redrawn (size and mtime are compared).
WATCHED = (STATUS, MANIFEST, ALERTS, OVERRIDES, LAYERS, EVENTS, f"{CHECKPOINTS}/latest")


@dataclass
class LoadedRun:
    """The run on screen and what was read of it."""

    run_dir: Path
    telemetry: TelemetryRun | None
    manifest: Manifest | None
    alerts: list[Alert]
    header: RunHeader
    stamps: dict[str, Any]
    overviews: dict[str, Overview] = field(default_factory=dict)  # metric -> whole-run pool


@dataclass
class LedgerView:
    """The overrides section as read from the run directory."""

    states: list[ModuleState]
    stageable: list[str]  # the FP8 modules an operator may stage
    open: list[Override]
    preview: ResumePreview
    problem: str | None = None  # no layers.json yet, a damaged ledger
    unverified: list[str] = field(default_factory=list)  # records whose signer is not proven


def read_ledger(run_dir: Path) -> LedgerView:
    try:
        states, stageable, open_ = (
            module_states(run_dir),
            fp8_modules(run_dir),
            open_overrides(run_dir),
        )
        ledger = Ledger(run_dir)
        unverified = ledger.unverified() if ledger.path.exists() else []
    except Fp8opsError as exc:
        return LedgerView([], [], [], preview_resume(run_dir), problem=str(exc))
    return LedgerView(states, stageable, open_, preview_resume(run_dir), unverified=unverified)


@dataclass
class Timeline:
    """The precision switches section as read from the run directory."""

    switches: list[Switch]
    problem: str | None = None  # a damaged layers.json or events.jsonl


def read_timeline(run_dir: Path) -> Timeline:
    try:
        return Timeline(read_switches(run_dir))
    except Fp8opsError as exc:
        return Timeline([], problem=str(exc))


@dataclass
class RunRead:
    """All a run's first drawing needs, read in one go: in the worker thread when an event loop
    runs. ``heatmap`` and ``detail`` are for the metric, window and slot on screen when the read
    began (None: nothing committed yet, the whole run, which is pooled afterwards, or
    ``problem``: they could not be read, and the rest of the run is shown all the same)."""

    run: LoadedRun
    ledger: LedgerView
    timeline: Timeline
    metric: str
    window: int
    slot: str
    heatmap: Heatmap | None
    detail: dict[str, Series] | None  # the first module's history
    problem: str | None = None


def read_run(run_dir: Path, metric: str, window: int, slot: str) -> RunRead:
    telemetry = open_telemetry(run_dir)
    try:
        manifest = load_manifest(RunLayout(run_dir).manifest)
    except Fp8opsError:
        manifest = None  # the header names the problem
    alerts = read_alerts(run_dir)
    header = read_header(run_dir, telemetry, alerts, manifest)
    run = LoadedRun(run_dir, telemetry, manifest, alerts, header, _stamps(run_dir, telemetry))
    heatmap = detail = problem = None
    if telemetry is not None and telemetry.modules:
        try:  # a damaged chunk, say: the header, alerts and ledger still help the operator
            if window and telemetry.last_step() is not None:
                heatmap = _window_heatmap(telemetry, metric, window)
            detail = module_history(telemetry, telemetry.modules[0], slot)
        except Exception as exc:  # noqa: BLE001 - shown on the message line
            problem = _describe(exc)
    return RunRead(
        run,
        read_ledger(run_dir),
        read_timeline(run_dir),
        metric,
        window,
        slot,
        heatmap,
        detail,
        problem,
    )


def _window_heatmap(telemetry: TelemetryRun, metric: str, window: int) -> Heatmap:
    """The last ``window`` committed steps of ``metric``."""
    last = telemetry.last_step()
    return window_heatmap(telemetry, metric, max(telemetry.first_step, last - window + 1), last + 1)


@dataclass(frozen=True)
class OnScreen:
    """What the page shows, taken on the event loop for a follower's poll in the worker thread."""

    run: LoadedRun | None
    picked: str | None
    metric: str
    window: int
    module: str | None
    slot: str


def _stamps(run_dir: Path, telemetry: TelemetryRun | None) -> dict[str, Any]:
    """What changes when a run writes something: watched files' size and mtime, and the
    telemetry's committed steps."""
    stamps: dict[str, Any] = {}
    for name in WATCHED:
        try:
            st = (run_dir / name).stat()
            stamps[name] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamps[name] = None
    stamps["telemetry"] = None if telemetry is None else dict(telemetry.committed_steps)
    stamps["store"] = RunLayout(run_dir).telemetry.exists()
    return stamps


class ConsoleApp:
    """The console over ``runs_dir`` (a directory of run directories, or one run directory),
    acting in the ledger as ``user``."""

    def __init__(
        self,
        runs_dir: str | Path = "runs",
        *,
        user: str | None = None,
        follow: bool = True,
        follow_every_s: float = FOLLOW_EVERY_S,
    ):
        self.runs_dir = Path(runs_dir).expanduser().resolve()
        self.run: LoadedRun | None = None
        self._generation = 0  # bumped on every run switch: late background results are dropped
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8ops-console")
        self._follower: asyncio.Task | None = None
        self._reading = False  # a run's files are being read for select_run
        self._quiet = False
        self._build(user or default_user())
        self.refresh_runs()
        if follow:
            self.start_following(follow_every_s)

    @classmethod
    def from_environment(cls) -> ConsoleApp:
        """The app ``fp8ops console`` asks for: the runs directory in FP8OPS_CONSOLE_RUNS (else
        the nearest ``runs/`` from the working directory upwards: a notebook opened in
        ``notebooks/`` finds the repository's), the operator in FP8OPS_USER."""
        runs = os.environ.get(RUNS_ENV)
        if not runs:
            here = Path.cwd()
            runs = next(
                (d / "runs" for d in (here, *here.parents) if (d / "runs").is_dir()), here / "runs"
            )
        return cls(runs, user=os.environ.get(USER_ENV))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # ----------------------------------------------------------------------------------
    # Widgets
    # ----------------------------------------------------------------------------------

    def _build(self, user: str) -> None:
        wide = W.Layout(width="98%")
        self.picker = W.Dropdown(description="run", layout=W.Layout(width="60%"))
        self.user = W.Text(value=user, description="operator", layout=W.Layout(width="25%"))
        # Records are signed as on the command line (--key, $FP8OPS_SIGNING_KEY): ssh-keygen.
        self.signing_key = W.Text(
            value=os.environ.get(KEY_ENV, ""),
            description="SSH key",
            placeholder="signing key (a file, or a .pub in ssh-agent)",
            layout=W.Layout(width="40%"),
        )
        self.reload = W.Button(
            description="rescan", tooltip="look for new runs", layout=W.Layout(width="9%")
        )
        self.header = W.HTML()
        self.live = W.HTML()
        self.message = W.HTML()

        self.metric = W.Dropdown(options=METRIC_CHOICES, value=DEFAULT_METRIC, description="metric")
        self.window = W.Dropdown(options=WINDOWS, value=DEFAULT_WINDOW, description="steps")
        self.log_scale = W.Checkbox(value=True, description="log colour scale", indent=False)
        self.heatmap_note = W.HTML()
        self.heatmap_view = figures.FigureView(figures.heatmap_figure(), "fp8ops-heatmap-fig")
        self.heatmap_fig = self.heatmap_view.figure
        self.hottest = W.Select(options=[], value=None, rows=5, layout=wide, description="worst")

        self.switches_note = W.HTML()
        self.timeline_view = figures.FigureView(figures.timeline_figure(), "fp8ops-timeline-fig")
        self.timeline_fig = self.timeline_view.figure
        self.switches_table = W.HTML()

        self.module = W.Dropdown(description="module", layout=W.Layout(width="60%"))
        self.slot = W.ToggleButtons(options=list(SLOTS), value="input", description="slot")
        self.detail_view = figures.FigureView(figures.detail_figure(), "fp8ops-detail-fig")
        self.detail_fig = self.detail_view.figure

        self.alert_level = W.Dropdown(
            options=[("all levels", "observe"), ("degrade and stop", "degrade"), ("stop", "stop")],
            value="observe",
            description="alerts",
        )
        self.alerts_list = W.Select(options=[], value=None, rows=8, layout=wide)

        self.stage_modules = W.SelectMultiple(
            options=[], rows=6, description="modules", layout=W.Layout(width="60%")
        )
        self.stage_reason = W.Text(
            description="reason",
            layout=W.Layout(width="60%"),
            placeholder="why (required; kept in the ledger)",
        )
        self.stage_to = W.ToggleButtons(
            options=[("BF16", "bf16"), ("current scaling", "current")],
            value="bf16",
            description="to",
            tooltip="where the staged modules go: BF16, or FP8 under current scaling",
        )
        self.stage_gemms = W.SelectMultiple(
            options=[
                ("fprop: y = x W^T", "fprop"),
                ("dgrad: dx = dy W", "dgrad"),
                ("wgrad: dW = dy^T x", "wgrad"),
            ],
            value=GEMMS,
            rows=3,
            description="GEMMs",
            tooltip="which of each module's GEMMs go to BF16 (all three: the whole module); "
            "dgrad and wgrad for saturating gradients",
        )
        self.stage_button = W.Button(
            description="Stage",
            button_style="warning",
            tooltip="stage the selected modules (another operator approves)",
        )
        self.override_pick = W.Dropdown(description="override", layout=W.Layout(width="60%"))
        self.decision_reason = W.Text(
            description="reason",
            layout=W.Layout(width="60%"),
            placeholder="for reject and revoke (a note for approve)",
        )
        self.approve_button = W.Button(description="Approve", button_style="success")
        self.reject_button = W.Button(description="Reject")
        self.revoke_button = W.Button(description="Revoke", button_style="danger")
        self.ledger_table = W.HTML()
        self.resume_preview = W.HTML()

        self.whatif_recipe = W.Dropdown(
            options=[("delayed: another window", "delayed"), ("current scaling", "current")],
            value="delayed",
            description="what-if",
        )
        self.whatif_len = W.BoundedIntText(min=1, max=1 << 16, description="history")
        self.whatif_algo = W.Combobox(
            options=["max", "most_recent", "quantile:0.99", "trimmed_max:1"],
            value="max",
            description="algorithm",
            ensure_option=False,
        )
        self.whatif_margin = W.BoundedIntText(min=0, max=64, description="margin")
        self.whatif_steps = W.Dropdown(options=WINDOWS, value=DEFAULT_WINDOW, description="steps")
        self.whatif_button = W.Button(description="Replay", button_style="info")
        self.whatif_summary = W.HTML()
        self.whatif_view = figures.FigureView(figures.whatif_figure(), "fp8ops-whatif-fig")
        self.whatif_fig = self.whatif_view.figure

        self._on_change(self.picker, lambda: self.select_run(self.picker.value))
        self.reload.on_click(lambda _: self.refresh_runs())
        for control in (self.metric, self.window, self.log_scale):
            self._on_change(control, self.draw_heatmap)
        self._on_change(self.module, self._module_changed)
        self._on_change(self.slot, self.draw_detail)
        self._on_change(self.alert_level, self._show_alerts)
        self._on_change(self.alerts_list, self._alert_chosen)
        self._on_change(self.hottest, self._hottest_chosen)
        self.stage_button.on_click(lambda _: self._act(self._stage))
        self.approve_button.on_click(lambda _: self._act(self._approve))
        self.reject_button.on_click(lambda _: self._act(self._reject))
        self.revoke_button.on_click(lambda _: self._act(self._revoke))
        self.whatif_button.on_click(lambda _: self._guard(self.replay_whatif))

        def section(title: str) -> W.HTML:
            return W.HTML(f"<h3 style='margin:14px 0 4px'>{title}</h3>")

        self.widget = W.VBox(
            [
                W.HBox([self.picker, self.user, self.reload]),
                self.header,
                self.live,
                self.message,
                section("Modules x steps"),
                W.HBox([self.metric, self.window, self.log_scale]),
                self.heatmap_note,
                self.heatmap_view.widget,
                self.hottest,
                section("Precision switches"),
                self.switches_note,
                self.timeline_view.widget,
                self.switches_table,
                section("Module"),
                W.HBox([self.module, self.slot]),
                self.detail_view.widget,
                section("Alerts"),
                self.alert_level,
                self.alerts_list,
                section("Overrides"),
                self.signing_key,
                self.stage_modules,
                self.stage_reason,
                self.stage_to,
                self.stage_gemms,
                self.stage_button,
                self.ledger_table,
                self.override_pick,
                self.decision_reason,
                W.HBox([self.approve_button, self.reject_button, self.revoke_button]),
                section("Next resume"),
                self.resume_preview,
                section("What-if"),
                self.whatif_recipe,
                W.HBox([self.whatif_len, self.whatif_algo, self.whatif_margin]),
                W.HBox([self.whatif_steps, self.whatif_button]),
                self.whatif_summary,
                self.whatif_view.widget,
            ],
            layout=W.Layout(width="100%"),
        )
        self.widget.add_class("fp8ops-console")
        # Class names a browser test (or a stylesheet) finds the controls by.
        for name in (
            "picker",
            "user",
            "metric",
            "window",
            "hottest",
            "module",
            "slot",
            "alerts_list",
            "signing_key",
            "stage_modules",
            "stage_reason",
            "stage_to",
            "stage_gemms",
            "stage_button",
            "override_pick",
            "decision_reason",
            "approve_button",
            "reject_button",
            "revoke_button",
            "whatif_button",
        ):
            getattr(self, name).add_class("fp8ops-" + name.replace("_", "-"))

    # ----------------------------------------------------------------------------------
    # Runs
    # ----------------------------------------------------------------------------------

    def refresh_runs(self) -> None:
        """Look for runs again; keep the one on screen if it is still there."""
        try:
            runs = find_runs(self.runs_dir)
        except Fp8opsError as exc:
            self._say(str(exc), error=True)
            runs = []
        current, paths = self.picker.value, [str(p) for p in runs]
        with self._quietly():
            self.picker.options = [
                (str(p.relative_to(self.runs_dir)) if p != self.runs_dir else p.name, str(p))
                for p in runs
            ]
            self.picker.value = current if current in paths else (paths[0] if paths else None)
        if not runs:
            self._say(
                f"no runs in {self.runs_dir} yet (a run directory holds status.json, "
                "manifest.yaml or telemetry.zarr); rescan when one starts"
            )
        if self.picker.value != current or self.run is None:
            self.select_run(self.picker.value)

    def select_run(self, run_dir: str | Path | None) -> None:
        """Show ``run_dir``: header, heatmap, module, alerts, overrides, preview. Its files are
        read in the worker thread when an event loop runs (the page stays live meanwhile), else
        at once."""
        self._generation += 1
        self.run, self._reading = None, False
        self._clear()  # nothing of the previous run stays on screen under the new pick
        if run_dir is None:
            return
        with self._quietly():
            self.picker.value = str(run_dir)  # one of the picker's options
        self.header.value = f"<i>reading {html.escape(str(run_dir))} ...</i>"
        generation, path = self._generation, Path(run_dir)
        metric, window, slot = self.metric.value, self.window.value, self.slot.value
        self._reading = True

        def show(read: RunRead) -> None:
            if generation == self._generation:  # unless another run was picked meanwhile
                self._reading = False
                self._show_run(read)

        def failed(exc: Exception) -> None:  # no run on screen: the follower reads it again
            if generation == self._generation:
                self._reading = False
                self.header.value = ""
                self._say(_describe(exc), error=True)

        self._in_background(lambda: read_run(path, metric, window, slot), show, failed)

    def _clear(self) -> None:
        self.header.value = self.heatmap_note.value = self.whatif_summary.value = ""
        self.ledger_table.value = self.resume_preview.value = ""
        self.switches_note.value = self.switches_table.value = ""
        for view in (self.heatmap_view, self.timeline_view, self.detail_view, self.whatif_view):
            view.clear()
        with self._quietly():
            for choice in (self.hottest, self.module, self.alerts_list, self.override_pick):
                choice.options = []
            self.stage_modules.options = []

    def _show_run(self, read: RunRead) -> None:
        self.run = run = read.run
        self._say("")
        self._guard(self._show_header)
        modules = list(run.telemetry.modules) if run.telemetry is not None else []
        with self._quietly():
            self.module.options = modules
            self.module.value = modules[0] if modules else None
            # A store's own columns beyond the catalogue (an imported run's TE stats) too.
            own = [m for m in run.telemetry.metrics if m not in CATALOGUE] if modules else []
            chosen = self.metric.value
            self.metric.options = METRIC_CHOICES + own
            self.metric.value = chosen if chosen in self.metric.options else DEFAULT_METRIC
        if run.manifest is not None and run.manifest.precision.scaling == "delayed":
            p = run.manifest.precision
            self.whatif_len.value, self.whatif_margin.value = p.amax_history_len, p.margin
            self.whatif_algo.value = p.amax_compute_algo
        # What was read is for the choices on screen then; the operator may have changed them.
        on_screen = (self.metric.value, self.window.value)
        if read.heatmap is not None and (read.metric, read.window) == on_screen:
            self._guard(lambda: self._show_heatmap(read.heatmap))
        elif read.problem is None:
            self._guard(self.draw_heatmap)
        if read.detail is not None and read.slot == self.slot.value:
            self._guard(lambda: self._show_detail(self.module.value, read.slot, read.detail))
        elif read.problem is None:
            self._guard(self.draw_detail)
        self._guard(lambda: self._show_timeline(read.timeline))
        self._guard(self._show_alerts)
        self._guard(lambda: self._show_ledger_view(read.ledger))
        if read.problem is not None:
            self._say(read.problem, error=True)

    # ----------------------------------------------------------------------------------
    # Header
    # ----------------------------------------------------------------------------------

    def _show_header(self) -> None:
        h = self.run.header
        counts = ", ".join(f"{n} {level}" for level, n in h.alerts.items())
        manifest = (
            f"{h.manifest_hash[:12]} (revision {h.revision}"
            + (f": {html.escape(h.revision_reason)}" if h.revision_reason else "")
            + ")"
            if h.manifest_hash
            else "unreadable"
        )
        step = "none yet" if h.last_step is None else f"{h.last_step:,}"
        rows = [
            ("run", f"<b>{html.escape(h.name)}</b> &nbsp; {html.escape(str(h.run_dir))}"),
            (
                "state",
                f"<b class='fp8ops-state'>{html.escape(h.state)}</b>"
                + (f" at step {h.status_step}" if h.status_step is not None else "")
                + (f" (updated {html.escape(h.updated)})" if h.updated else ""),
            ),
            ("manifest", manifest),
            ("recipe", html.escape(h.recipe)),
            ("topology", html.escape(h.topology)),
            (
                "last committed step",
                f"<span class='fp8ops-last-step'>{step}</span>"
                + (f" ({h.ranks} ranks)" if h.ranks > 1 else ""),
            ),
            ("alerts", counts),
        ]
        rows += [
            ("problem", f"<span style='color:#b00'>{html.escape(p)}</span>") for p in h.problems
        ]
        self.header.value = _table(rows, header=False)

    # ----------------------------------------------------------------------------------
    # Heatmap
    # ----------------------------------------------------------------------------------

    def draw_heatmap(self) -> None:
        """The chosen metric over modules x steps: the last N steps read now, or the whole
        run pooled in the background (later: only the blocks committed since)."""
        run = self.run
        if run is None or run.telemetry is None or run.telemetry.last_step() is None:
            self.heatmap_note.value = "no telemetry committed yet"
            return
        metric, window = self.metric.value, self.window.value
        if window:
            self._show_heatmap(_window_heatmap(run.telemetry, metric, window))
            return
        overview = run.overviews.setdefault(metric, Overview(run.telemetry, metric))
        self.heatmap_note.value = f"pooling the whole run for {metric} ..."
        generation = self._generation

        def pooled() -> Heatmap:
            overview.update()
            return overview.heatmap()

        def show(hm: Heatmap) -> None:  # unless the operator moved on meanwhile
            if (generation, metric, 0) == (self._generation, self.metric.value, self.window.value):
                self._show_heatmap(hm)

        self._in_background(pooled, show)

    def _show_heatmap(self, hm: Heatmap) -> None:
        if hm.empty:
            scalings = self._run_scalings()
            if scalings and not any(applies(hm.metric, s) for s in scalings):
                under = " and ".join(sorted(scalings))
                self.heatmap_note.value = (
                    f"{hm.metric}: not applicable under {under} scaling (NaN in the store, "
                    "never measured)"
                )
            else:
                self.heatmap_note.value = f"{hm.metric}: nothing measured in these steps"
            return
        span = f"steps {hm.starts[0]:,}-{hm.ends[-1]:,}"
        per = (
            f"{hm.bin_steps:,} steps per column, the worst of each"
            if hm.bin_steps > 1
            else ("one column per step")
        )
        self.heatmap_note.value = f"{len(hm.modules)} modules, {span}; {per}"
        figures.show_heatmap(
            self.heatmap_view, hm, log=self.log_scale.value, title=f"{hm.metric}, {span}"
        )
        with self._quietly():
            self.hottest.options = [
                (f"{module}: {value:.4g}", module) for module, value in hm.worst(HOTTEST)
            ]
            self.hottest.value = None

    def _hottest_chosen(self) -> None:
        """A module of the heatmap's worst list leads to its history."""
        if self.hottest.value in self.module.options:
            self.module.value = self.hottest.value

    # ----------------------------------------------------------------------------------
    # Precision switches
    # ----------------------------------------------------------------------------------

    def _show_timeline(self, timeline: Timeline) -> None:
        switches = timeline.switches
        if timeline.problem is not None:
            note = f"<span style='color:#b00'>{html.escape(timeline.problem)}</span>"
        elif not switches:
            note = (
                "no precision switches in this run (a phase of precision.schedule starting or "
                "ending, the auto-degrade policy acting)"
            )
        else:
            note = (
                "each switch from the first step under the new precision, with what its modules "
                "run from then on"
            )
        self.switches_note.value = f"<div class='fp8ops-switches-note'>{note}</div>"
        self.switches_table.value = _switches_table(switches) if switches else ""
        if not switches:  # no empty plot to draw on the page
            self.timeline_view.clear()
            return
        manifest = self.run.manifest
        train_steps = manifest.schedule.train_steps if manifest is not None else None
        figures.show_timeline(self.timeline_view, switches, train_steps)

    # ----------------------------------------------------------------------------------
    # Module
    # ----------------------------------------------------------------------------------

    def _module_changed(self) -> None:
        self.draw_detail()
        module = self.module.value
        if module in self.stage_modules.options:  # what an operator most likely stages next
            self.stage_modules.value = (module,)
        self.whatif_summary.value = (
            f"press Replay for {html.escape(str(module))}" if self.whatif_summary.value else ""
        )

    def draw_detail(self) -> None:
        """The module's history: amax, window max and scale; saturation and underflow;
        gradient norm; FP8 error. One read of ``module_history``, pooled to 2000 points."""
        run, module, slot = self.run, self.module.value, self.slot.value
        if run is None or run.telemetry is None or module is None:
            return
        self._show_detail(module, slot, module_history(run.telemetry, module, slot))

    def _show_detail(self, module: str, slot: str, lines: dict[str, Series]) -> None:
        steps = lines[f"{slot}.amax"]
        scaling = self._module_scaling(module)
        what = f"{module} · {slot}" + (f" · {scaling} scaling" if scaling else "")
        what += f" · {steps.bin_steps} steps per point" if steps.bin_steps > 1 else ""
        figures.show_detail(self.detail_view, lines, slot, what, scaling)

    def _fp8_precision(self):
        """The run's precision section when it runs FP8; None without a readable manifest."""
        manifest = self.run.manifest if self.run is not None else None
        return manifest.precision if manifest and manifest.precision.enabled else None

    def _module_scaling(self, module: str) -> str | None:
        """The recipe ``module`` runs under (its module_recipes entry, else the run's)."""
        p = self._fp8_precision()
        if p is None:
            return None
        own = module_recipe(p, module)
        return own[1].scaling if own else p.scaling

    def _run_scalings(self) -> set[str]:
        """Every recipe some module of the run runs (empty: unknown, or no FP8)."""
        p = self._fp8_precision()
        return set() if p is None else {p.scaling, *(e.scaling for e in p.module_recipes)}

    # ----------------------------------------------------------------------------------
    # Alerts
    # ----------------------------------------------------------------------------------

    def _shown_alerts(self) -> list[Alert]:
        return select_alerts(self.run.alerts, self.alert_level.value) if self.run else []

    def _show_alerts(self) -> None:
        shown = self._shown_alerts()
        newest_first = list(reversed(list(enumerate(shown))))
        with self._quietly():
            self.alerts_list.options = [(_alert_line(a), i) for i, a in newest_first]
            self.alerts_list.value = None

    def _alert_chosen(self) -> None:
        """An alert row leads to its module (run-level alerts have none)."""
        if self.alerts_list.value is None:
            return
        alert = self._shown_alerts()[self.alerts_list.value]
        if alert.module in self.module.options:
            self.module.value = alert.module

    # ----------------------------------------------------------------------------------
    # Overrides
    # ----------------------------------------------------------------------------------

    def _ledger(self) -> Ledger:
        return Ledger(self.run.run_dir, key=self.signing_key.value.strip() or None)

    def _stage(self) -> str:
        modules = list(self.stage_modules.value)
        if not modules:
            raise Fp8opsError("choose the modules to stage (the list above the reason)")
        gemms = list(self.stage_gemms.value)
        staged = self._ledger().stage_many(
            modules,
            self.stage_reason.value,
            who=self._operator(),
            to=self.stage_to.value,
            gemms=None if set(gemms) == set(GEMMS) else gemms,
        )
        self.stage_reason.value = ""
        self.stage_gemms.value = GEMMS
        return "; ".join(
            f"staged {o.module} to {o.target} as {o.id[:12]} by {o.who} "
            f"({len(o.triggers)} trigger(s) attached)"
            for o in staged
        )

    def _approve(self) -> str:
        o = self._ledger().approve(
            self._picked(), who=self._operator(), note=self.decision_reason.value.strip() or None
        )
        return f"approved {o.id[:12]} ({o.module}) as {o.decided_by}: applied at the next resume"

    def _reject(self) -> str:
        o = self._ledger().reject(self._picked(), self.decision_reason.value, who=self._operator())
        return f"rejected {o.id[:12]} ({o.module})"

    def _revoke(self) -> str:
        o = self._ledger().revoke(self._picked(), self.decision_reason.value, who=self._operator())
        return f"revoked {o.id[:12]} ({o.module})"

    def _operator(self) -> str:
        # Never the login name by default here: the page acts for whoever typed the name.
        if not self.user.value.strip():
            raise Fp8opsError("enter the operator's name (it is recorded in the ledger)")
        return self.user.value.strip()

    def _picked(self) -> str:
        if not self.override_pick.value:
            raise Fp8opsError("choose an open override first")
        return self.override_pick.value

    def _act(self, action: Callable[[], str]) -> None:
        """Run a ledger action; a refusal (self-approval, a module already open, no reason)
        is shown, not raised. The ledger views are redrawn either way."""
        if self.run is None:
            self._say("choose a run first", error=True)
            return
        try:
            self._say(action())
            self.decision_reason.value = ""
        except Fp8opsError as exc:  # what was typed stays, to be corrected
            self._say(f"refused: {exc}", error=True)
        self._guard(self._show_ledger)

    def _show_ledger(self) -> None:
        self._show_ledger_view(read_ledger(self.run.run_dir))

    def _show_ledger_view(self, ledger: LedgerView) -> None:
        if ledger.problem is not None:
            self.ledger_table.value = (
                f"<span style='color:#b00'>{html.escape(ledger.problem)}</span>"
            )
        else:
            flagged = "".join(
                f"<div style='color:#b00'>unverified: {html.escape(line)}</div>"
                for line in ledger.unverified
            )
            self.ledger_table.value = flagged + _ledger_table(ledger.states)
        keep = [m for m in self.stage_modules.value if m in ledger.stageable]
        with self._quietly():
            self.stage_modules.options = ledger.stageable
            self.stage_modules.value = tuple(keep) or (
                (self.module.value,) if self.module.value in ledger.stageable else ()
            )
            self.override_pick.options = [(_override_line(o), o.id) for o in ledger.open]
            self.override_pick.value = ledger.open[-1].id if ledger.open else None
        self._show_preview(ledger.preview)

    def _show_preview(self, preview: ResumePreview) -> None:
        text = "\n".join(preview.lines())
        self.resume_preview.value = f"<pre class='fp8ops-resume'>{html.escape(text)}</pre>"

    # ----------------------------------------------------------------------------------
    # Window what-if
    # ----------------------------------------------------------------------------------

    def replay_whatif(self) -> None:
        """Replay the module's recorded amax (the slot on screen) under the run's own window
        and under the one entered, or under current scaling, in the background."""
        from fp8ops.console.whatif import (
            Summary,
            refuse_stateless,
            replay_slots,
            run_window,
            what_if_setting,
        )

        run, module, slot = self.run, self.module.value, self.slot.value
        if run is None or run.telemetry is None or module is None:
            raise Fp8opsError("choose a run with telemetry and a module first")
        if run.manifest is None or not run.manifest.precision.enabled:
            raise Fp8opsError("this run has no FP8 recipe to compare with")
        refuse_stateless(run.run_dir, run.manifest.precision, [module])
        own = run_window(run.telemetry, run.manifest.precision)
        if self.whatif_recipe.value == "current":
            other = what_if_setting(own, "current")
        else:
            other = what_if_setting(
                own,
                history_len=self.whatif_len.value,
                algo=self.whatif_algo.value.strip(),
                margin=self.whatif_margin.value,
            )
        last, steps = run.telemetry.last_step(), self.whatif_steps.value
        start = max(run.telemetry.first_step, last - steps + 1) if steps else None
        fp8_format = run.manifest.precision.fp8_format
        self.whatif_summary.value = f"replaying {html.escape(module)} · {slot} ..."
        generation = self._generation

        def work():
            return replay_slots(
                run.telemetry, [module], [slot], own, other, fp8_format, start=start
            )[0]

        def show(what) -> None:
            if generation != self._generation:
                return
            mine, theirs = Summary.of(what.run), Summary.of(what.what_if)
            rows = [("", f"run's settings: {own}", f"what-if: {other}")]
            rows += [
                ("steps that cast", mine.cast_steps, theirs.cast_steps),
                ("steps that overflowed", mine.overflow_steps, theirs.overflow_steps),
                ("first overflows", _steps(mine.first_overflows), _steps(theirs.first_overflows)),
                (
                    "median headroom (bits)",
                    f"{mine.headroom_median:.2f}",
                    f"{theirs.headroom_median:.2f}",
                ),
                (
                    "10th percentile headroom",
                    f"{mine.headroom_p10:.2f}",
                    f"{theirs.headroom_p10:.2f}",
                ),
                ("worst step (bits)", f"{mine.headroom_min:.2f}", f"{theirs.headroom_min:.2f}"),
            ]
            self.whatif_summary.value = _table(rows, header=True, cls="fp8ops-whatif")
            figures.show_whatif(self.whatif_view, what, f"{module} · {slot}: {other} against {own}")

        self._in_background(work, show)

    # ----------------------------------------------------------------------------------
    # Following a live run
    # ----------------------------------------------------------------------------------

    def start_following(self, every_s: float = FOLLOW_EVERY_S) -> bool:
        """Poll the run every ``every_s`` seconds on the kernel's event loop (the reads in the
        worker thread). False when there is no running loop (a script): call ``poll()``."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self.stop_following()
        self._follower = loop.create_task(self._follow(every_s))
        return True

    def stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None

    async def _follow(self, every_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            generation, screen = self._generation, self._on_screen()
            try:
                changes = await loop.run_in_executor(self._worker, self._look, screen)
                if generation == self._generation:
                    self._apply(changes)
            except Exception as exc:  # noqa: BLE001 - keep following; the next change reads anew
                self._say(f"following: {type(exc).__name__}: {exc}", error=True)

    def poll(self) -> bool:
        """Look for what the run wrote since and redraw what changed, now. True if anything did,
        or if the picked run, unreadable so far, was read again."""
        changes = self._look(self._on_screen())
        self._apply(changes)
        return bool(changes)

    def _on_screen(self) -> OnScreen:
        return OnScreen(
            self.run,
            self.picker.value,
            self.metric.value,
            self.window.value,
            self.module.value,
            self.slot.value,
        )

    @staticmethod
    def _look(screen: OnScreen) -> dict[str, Any]:
        """What changed on disk since ``screen`` was drawn, with the data to redraw it; runs in
        the worker thread, so it reads no widget (the event loop may be changing them)."""
        run = screen.run
        if run is None:
            # The picked run could not be read (a run starting, its store half made): try again.
            return {"retry": True} if screen.picked is not None else {}
        if run.telemetry is not None:
            run.telemetry.refresh()
        stamps = _stamps(run.run_dir, run.telemetry)
        if stamps == run.stamps:
            return {}
        # A read below that fails is tried again when its file next changes (a live run's do);
        # a damaged file of a finished run is reported once, not at every poll.
        before, run.stamps = run.stamps, stamps
        if stamps["store"] and run.telemetry is None:
            return {"reload": True}  # the store appeared: everything needs drawing
        changes: dict[str, Any] = {}
        if stamps[ALERTS] != before[ALERTS]:
            changes["alerts"] = read_alerts(run.run_dir)
        if stamps[MANIFEST] != before[MANIFEST]:
            try:
                changes["manifest"] = load_manifest(RunLayout(run.run_dir).manifest)
            except Fp8opsError:
                changes["manifest"] = None  # the header names the problem
        changes["header"] = read_header(
            run.run_dir,
            run.telemetry,
            changes.get("alerts", run.alerts),
            changes.get("manifest", run.manifest),
        )
        if stamps["telemetry"] != before["telemetry"] and run.telemetry is not None:
            if screen.window:
                changes["heatmap"] = _window_heatmap(run.telemetry, screen.metric, screen.window)
            elif screen.metric in run.overviews:
                run.overviews[screen.metric].update()
                changes["heatmap"] = run.overviews[screen.metric].heatmap()
            if screen.module is not None:
                changes["detail"] = (
                    screen.module,
                    screen.slot,
                    module_history(run.telemetry, screen.module, screen.slot),
                )
        if any(
            stamps[n] != before[n] for n in (OVERRIDES, LAYERS, f"{CHECKPOINTS}/latest", MANIFEST)
        ):
            changes["ledger"] = read_ledger(run.run_dir)
        if stamps[LAYERS] != before[LAYERS] or stamps[EVENTS] != before[EVENTS]:
            changes["timeline"] = read_timeline(run.run_dir)
        return changes

    def _apply(self, changes: dict[str, Any]) -> None:
        """Redraw what ``_look`` found changed (on the event loop)."""
        run = self.run
        if changes.get("retry"):
            # Not while a read is under way, nor when one came back since the poll began.
            if run is None and not self._reading:
                self.select_run(self.picker.value)
            return
        if not changes or run is None:
            return
        if changes.get("reload"):
            self.select_run(run.run_dir)  # a failed read leaves no run: the next poll retries
            return
        run.alerts = changes.get("alerts", run.alerts)
        run.manifest = changes.get("manifest", run.manifest)
        run.header = changes["header"]
        self._show_header()
        if "alerts" in changes:
            self._show_alerts()
        hm = changes.get("heatmap")
        if hm is not None and hm.metric == self.metric.value:
            self._show_heatmap(hm)
        detail = changes.get("detail")
        if detail is not None and detail[:2] == (self.module.value, self.slot.value):
            self._show_detail(*detail)
        if "timeline" in changes:
            self._guard(lambda: self._show_timeline(changes["timeline"]))
        if "ledger" in changes:
            self._guard(lambda: self._show_ledger_view(changes["ledger"]))
        self.live.value = (
            f"<span class='fp8ops-live'>followed: step "
            f"{run.header.last_step} at {datetime.now():%H:%M:%S}</span>"
        )

    # ----------------------------------------------------------------------------------
    # Plumbing
    # ----------------------------------------------------------------------------------

    def _on_change(self, widget: W.ValueWidget, show: Callable[[], Any]) -> None:
        """Call ``show`` when the operator changes ``widget`` (not while the app itself
        refills it: see ``_quietly``)."""
        widget.observe(lambda _: None if self._quiet else self._guard(show), names="value")

    @contextmanager
    def _quietly(self):
        """Refill widgets without their observers redrawing views at every step."""
        self._quiet, before = True, self._quiet
        try:
            yield
        finally:
            self._quiet = before

    def _in_background(
        self,
        work: Callable[[], Any],
        then: Callable[[Any], None],
        failed: Callable[[Exception], None] | None = None,
    ) -> None:
        """``work()`` in the worker thread, then ``then(result)`` on the event loop; both at
        once when no loop runs (tests, scripts). An error in ``work`` goes to ``failed`` (by
        default, the message line). Work still queued when another run is picked is skipped:
        the new pick should not wait behind it."""
        failed = failed or (lambda exc: self._say(_describe(exc), error=True))

        def finish(result_of: Callable[[], Any]) -> None:
            try:
                result = result_of()
            except Exception as exc:  # noqa: BLE001 - shown on the page, as _guard does
                failed(exc)
                return
            if result is not _STALE:
                self._guard(lambda: then(result))

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            finish(work)
            return
        generation = self._generation

        def unless_stale() -> Any:
            return _STALE if generation != self._generation else work()

        def done(future) -> None:
            if not future.cancelled():  # close() dropped it
                finish(future.result)

        loop.run_in_executor(self._worker, unless_stale).add_done_callback(done)

    def _guard(self, show: Callable[[], Any]) -> None:
        """Run a view update; an error becomes the message line instead of a dead console."""
        try:
            show()
        except Exception as exc:  # noqa: BLE001 - a dead console helps nobody; say what broke
            self._say(_describe(exc), error=True)

    def _say(self, text: str, *, error: bool = False) -> None:
        color = "#b00" if error else "#060"
        self.message.value = (
            f"<div class='fp8ops-message' style='color:{color}'>{html.escape(text)}</div>"
            if text
            else ""
        )

    def close(self) -> None:
        """Stop following and release the worker thread."""
        self.stop_following()
        self._worker.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------


def _describe(exc: Exception) -> str:
    if isinstance(exc, Fp8opsError):
        return str(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _table(rows: list[tuple], *, header: bool, cls: str = "") -> str:
    cells = []
    for n, row in enumerate(rows):
        tag = "th" if header and n == 0 else "td"
        cells.append(
            "<tr>"
            + "".join(
                f"<{tag} style='padding:1px 10px 1px 0;text-align:left'>{c}</{tag}>" for c in row
            )
            + "</tr>"
        )
    return f"<table class='{cls}'>{''.join(cells)}</table>"


def _alert_line(a: Alert) -> str:
    value = f" = {format_value(a.value)}" if a.value is not None else ""
    limit = f" (level {format_value(a.threshold)})" if a.threshold is not None else ""
    return f"step {a.step} · {a.level} · {a.module or '(run)'} · {a.metric or a.rule}{value}{limit}"


def _override_line(o: Override) -> str:
    return f"{o.id[:12]} · {o.module} · {o.status} · {o.origin} by {o.who}"


def _steps(steps: tuple[int, ...]) -> str:
    return ", ".join(str(s) for s in steps) or "none"


def _switches_table(switches: list[Switch]) -> str:
    rows = [("from step", "by", "why", "modules")]
    for s in switches:
        modules = "<br>".join(
            f"<b>{html.escape(now)}</b>: {html.escape(', '.join(names))}"
            for now, names in s.grouped()
        )
        rows.append((str(s.step), s.source, html.escape(s.cause), modules))
    return _table(rows, header=True, cls="fp8ops-switches")


def _ledger_table(states: list[ModuleState]) -> str:
    rows = [("module", "precision", "ledger", "id", "by", "decided by", "reason", "triggers")]
    for s in states:
        o = s.override
        triggers = (
            ""
            if o is None
            else "; ".join(
                f"{t.metric} {format_value(t.value)} ({t.level}, step {t.step})" for t in o.triggers
            )
        )
        rows.append(
            tuple(
                html.escape(str(c))
                for c in (
                    s.module,
                    f"{s.precision} ({s.why})",
                    s.ledger_status,
                    o.id[:12] if o else "",
                    o.who if o else "",
                    (o.decided_by or "") if o else "",
                    # A module a phase of the schedule holds: the phase, as layers.json says it.
                    "; ".join(filter(None, (o.reason if o else "", s.phase))),
                    triggers,
                )
            )
        )
    return _table(rows, header=True, cls="fp8ops-ledger")
