"""A run's precision switches during training, oldest first: what the console's timeline and
``fp8ops inspect --layers`` show.

Two things switch modules between two steps (``fp8ops.train``): a phase of
``precision.schedule`` starting or ending, and the auto-degrade policy acting on a Degrade
alert. Each is read from where the run records it:

* the schedule's from ``layers.json``'s ``history``, which a resume cuts at its first step, so
  it holds the switches of the run as it went on; each module's GEMMs come from the
  ``precision_phase`` event of the same step and modules in ``events.jsonl`` (the history names
  the modules only);
* the policy's from its ``auto_degraded`` events. A resume from a checkpoint before one meets
  the alert again and writes it anew, so the events a resume ran past are dropped: those switching
  after the first step of a later ``train_started``.

A switch's step is the first step run under the new table: a phase's own step; the step after
the alert's for the policy. Both may fall on one step: the policy switched first (after the
alert's step), then the schedule, from the policy's table (``fp8ops.train.phases``); in that
order here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fp8ops.gemm_roles import GEMMS, in_order
from fp8ops.run.layout import RunLayout
from fp8ops.run.records import (
    Event,
    RunRecordError,
    layers_history,
    read_events,
    read_layers_json,
)

Source = Literal["auto-degrade", "schedule"]


@dataclass(frozen=True)
class Switch:
    """One switch of the table: from ``step`` on, each module of ``modules`` runs as its value
    says ("bf16", "fp8", or each GEMM's: "dgrad, wgrad fp8; fprop bf16"; "changed" where the
    run recorded no more)."""

    step: int
    source: Source
    cause: str
    modules: dict[str, str]

    def grouped(self) -> list[tuple[str, list[str]]]:
        """Its modules by what they run from ``step`` on, in the order first met:
        ``[("bf16", [fc1, ...]), ...]``."""
        groups: dict[str, list[str]] = {}
        for module, now in self.modules.items():
            groups.setdefault(now, []).append(module)
        return list(groups.items())


def read_switches(run_dir: str | Path) -> list[Switch]:
    """Every switch of ``run_dir`` in the order it was made (none for a run that recorded
    none); :class:`RunRecordError` names the file and field of a damaged record."""
    events = read_events(run_dir)
    switches = _policy_switches(events, RunLayout(run_dir).events)
    switches += _schedule_switches(run_dir, events)
    # Stable: on one step the policy's before the schedule's, as the trainer made them.
    return sorted(switches, key=lambda s: (s.step, s.source != "auto-degrade"))


def _policy_switches(events: list[Event], file: Path) -> list[Switch]:
    switches: list[Switch] = []
    for number, event in enumerate(events, 1):
        fields = _Fields(event, file, number)
        if event.event == "train_started":  # a resume from step k: what switched after k+1 is
            after = fields.get("from_step", int) + 1  # rewound, and switched again if at all
            switches = [s for s in switches if s.step <= after]
        elif event.event == "auto_degraded":
            step, rules = fields.get("step", int), fields.get("rules", list)
            policy = fields.get("policy", str)
            gemms = fields.get("gemms", dict, default={})  # modules switched for some GEMMs
            rules = list(dict.fromkeys(map(str, rules)))  # one per module switched
            cause = (
                f"auto-degrade after step {step}'s {', '.join(rules)} "
                f"alert{'s' if len(rules) > 1 else ''}, by the policy of revision {policy[:12]}"
            )
            modules = {m: _words(gemms.get(m, GEMMS), "bf16") for m in fields.modules()}
            switches.append(Switch(step + 1, "auto-degrade", cause, modules))
    return switches


def _schedule_switches(run_dir: str | Path, events: list[Event]) -> list[Switch]:
    if not RunLayout(run_dir).layers.is_file():
        return []
    file = RunLayout(run_dir).events
    run_recipe = read_layers_json(run_dir).recipe.scaling
    recorded: dict[tuple[int, tuple[str, ...]], dict[str, str]] = {}
    for number, event in enumerate(events, 1):
        if event.event == "precision_phase":  # the latest of a step and its modules wins
            fields = _Fields(event, file, number)
            key = (fields.get("step", int), tuple(fields.modules()))
            recorded[key] = _phase_words(fields, run_recipe)
    switches = []
    for change in layers_history(run_dir):
        words = recorded.get((change.step, change.modules), {})
        modules = {m: words.get(m, "changed") for m in change.modules}
        switches.append(Switch(change.step, "schedule", change.cause, modules))
    return switches


def _phase_words(fields: _Fields, run_recipe: str) -> dict[str, str]:
    """Each module of a ``precision_phase`` event as it runs from the event's step on. Its ``to``
    is, since phases may name a recipe, per module: the recipe its FP8 GEMMs run, or the base
    dtype where none is FP8; before that, one string, the base dtype (every target was)."""
    base_gemms, to = fields.get("base_gemms", dict), fields.get("to", (dict, str))
    if isinstance(to, str):
        return {m: _words(gemms, to, "fp8") for m, gemms in base_gemms.items()}
    base_dtype = fields.get("base_dtype", str)
    words = {}
    for module, gemms in base_gemms.items():
        recipe = str(to.get(module, run_recipe))
        words[module] = _words(gemms, base_dtype, "fp8" if recipe == run_recipe else recipe)
    return words


def _words(base: list[str] | tuple[str, ...], to: str, fp8: str = "fp8") -> str:
    """A module's GEMMs once ``base`` of them run in ``to`` and the others in ``fp8`` (the run's
    recipe, or the one a phase moved the module to), as ``AdmissionRow.gemm_summary`` says them."""
    in_fp8 = [g for g in GEMMS if g not in base]
    if not base:
        return fp8
    if not in_fp8:
        return to
    return f"{', '.join(in_fp8)} {fp8}; {', '.join(in_order(base))} {to}"


class _Fields:
    """An event's fields, each checked: a wrong one names the file, the line and the field."""

    def __init__(self, event: Event, file: Path, number: int):
        self.values, self.event, self.where = event.model_dump(), event.event, (file, number)

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.values.get(name, default)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (int in kinds and isinstance(value, bool)):
            self._refuse(name, value, " or ".join(f"a {k.__name__}" for k in kinds))
        return value

    def modules(self) -> list[str]:
        modules = self.get("modules", list)
        if not all(isinstance(m, str) for m in modules):
            self._refuse("modules", modules, "a list of module names")
        return modules

    def _refuse(self, name: str, value: Any, what: str) -> None:
        file, number = self.where
        raise RunRecordError(
            f"{file}: record {number} ({self.event}): {name} is {value!r}, not {what}; the file "
            "is damaged or not fp8ops' own"
        )
