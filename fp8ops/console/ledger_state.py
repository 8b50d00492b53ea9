"""The override ledger as the console shows it: one row per FP8-capable module.

A module's row joins its ``layers.json`` decision (FP8, or the base dtype and why) with its
newest override in ``overrides.jsonl`` (``fp8ops.overrides.Ledger``): open (proposed, staged,
approved, applied); when none is open, a revoked one the next resume lifts; else the last
decided one. A module a phase of ``precision.schedule`` holds in the base dtype (all its GEMMs or
some) has a row too, saying so: it is no override, and an operator looking for why it left FP8
finds the phase. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ops.overrides import Ledger, Override
from fp8ops.run.records import AdmissionRow, read_layers_json


@dataclass(frozen=True)
class ModuleState:
    module: str
    precision: str  # from layers.json: fp8, the base dtype, or each GEMM's
    # layers.json's reason code (fp8, override, schedule, ...); for an FP8 module with some
    # GEMMs in the base dtype, theirs
    why: str
    override: Override | None  # its open override, else its newest one
    phase: str = ""  # the phase that holds it in the base dtype, in words (layers.json's)

    @property
    def ledger_status(self) -> str:
        if self.override is None:
            return ""
        o = self.override
        return "applied, revoked: lifted at the next resume" if o.to_lift else o.status


def module_states(run_dir: Path) -> list[ModuleState]:
    """Every module that can run FP8 (admitted, or held in the base dtype by an override or a
    phase of the schedule), in layers.json order."""
    overrides = Ledger(run_dir).overrides()
    newest: dict[str, Override] = {}
    for o in overrides.values():  # in ledger order: later ones replace earlier ones ...
        earlier = newest.get(o.module)
        if earlier is None or _weight(o) >= _weight(earlier):
            newest[o.module] = o  # ... unless the earlier one still has something to do
    rows = []
    for row in read_layers_json(run_dir).rows:
        if row.fp8 or row.reason.code in ("override", "schedule") or row.fqn in newest:
            # A module under a per-module recipe says which, "fp8 (current)"; one with some
            # GEMMs in the base dtype says which: "fprop fp8; dgrad, wgrad bf16".
            precision = row.gemm_summary()
            if row.scaling is not None:
                precision = precision.replace("fp8", f"fp8 ({row.scaling})", 1)
            why, phase = _why(row)
            rows.append(ModuleState(row.fqn, precision, why, newest.get(row.fqn), phase))
    return rows


def _why(row: AdmissionRow) -> tuple[str, str]:
    """The row's reason code, or for an FP8 module with some GEMMs in the base dtype those
    GEMMs' codes; and the words of the schedule's phase among them ("" if none)."""
    base = [g.reason for _, g in row.gemms.items() if g.precision != "fp8"] if row.gemms else []
    reasons = base if row.some_gemms else [row.reason, *base]
    codes = dict.fromkeys(r.code for r in reasons)  # in order, once each
    phase = next((r.text for r in (*base, row.reason) if r.code == "schedule"), "")
    return ", ".join(codes), phase


def _weight(o: Override) -> int:
    """Which override a module's row shows: an open one, else one whose lift is pending (the
    next resume acts on it), else the newest decided one."""
    return 2 if o.is_open else 1 if o.to_lift else 0


def fp8_modules(run_dir: Path) -> list[str]:
    """Modules an operator may stage: those running FP8 now (layers.json)."""
    return [row.fqn for row in read_layers_json(run_dir).rows if row.fp8]


def open_overrides(run_dir: Path) -> list[Override]:
    """Overrides an operator can still act on: open ones (approve/reject/revoke)."""
    return [o for o in Ledger(run_dir).overrides().values() if o.is_open]
