"""The rehearsals: the manifest trained for real, shortened to K steps, in a scratch directory.

Items 4 (FP8 state survives a stop and resume), 5 (the BF16 control reproduces), 8 (a BF16
fallback through the ledger) and 9 (restores at another tensor- and pipeline-parallel size)
share two runs of the shortened manifest, trained when an item first needs them: ``straight``
(K steps) and ``paused`` (stopped at K/2 with a checkpoint, never resumed itself; each resume
works on a copy).

A one-rank manifest trains in this process (``run_training``/``resume_training``, exactly what
``fp8ops train``/``resume`` run); a manifest whose topology needs more ranks, and the restores at
another TP or PP size, run ``fp8ops`` under ``python -m torch.distributed.run`` with that many
processes (gloo on a CPU, NCCL on GPUs), their output kept in ``WORK_DIR/logs/``.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import derive, write_manifest
from fp8ops.manifest.canonical import content_dict
from fp8ops.manifest.schema import Manifest
from fp8ops.preflight.results import Evidence
from fp8ops.run import RunLayout, find_status, read_events, read_fallbacks, read_metrics

OPERATOR, REVIEWER = "preflight-operator", "preflight-reviewer"  # who stages, who approves
# Another TP size sums in another order (and a torchrun process computes on one thread where this
# one may use several): the CPU default's first resumed losses differ by 1e-4
# to 1e-3 (tests/test_resume.py allows 2% too). The comparison catches a gross restore (other
# weights, another data position, a fresh optimizer); the FP8 state is checked exactly, by the
# load's digests.
TP_LOSS_TOLERANCE = 2e-2
TP_LOSS_STEPS = 2  # resumed steps compared with the straight run
RUN_TIMEOUT_S = 1800  # one torchrun rehearsal; a hung collective must not hang preflight


class RehearsalError(Exception):
    """A rehearsal run that failed; the message names the command and says why."""


def fitted_changes(manifest: Manifest, steps: int) -> dict[str, Any]:
    """The manifest shortened to ``steps``: one evaluation and no periodic checkpoint (the last
    step has both anyway), a short evaluation, no generation, telemetry every step, and no metric
    sink or webhook (a rehearsal's numbers and alerts are not the run's: they must not reach the
    team's W&B project or page anyone). A run's fallbacks stay, as hand-written overrides: their
    approvals are in the run's ledger, and a resume refuses approvals its own ledger does not
    hold."""
    schedule = manifest.schedule
    overrides = [
        {**o.model_dump(mode="json"), "approval": None} for o in manifest.precision.overrides
    ]
    return {
        "precision.overrides": overrides,
        "schedule.train_steps": steps,
        "schedule.warmup_steps": min(schedule.warmup_steps, steps),
        "schedule.eval_interval": steps,
        "schedule.eval_iters": min(schedule.eval_iters or 2, 2),
        "schedule.checkpoint_interval": steps,
        "capability.enabled": False,
        "telemetry.every_steps": 1,
        "telemetry.error_sample_every": min(manifest.telemetry.error_sample_every, steps),
        "logging.tensorboard": None,
        "logging.wandb": None,
        "logging.mlflow": None,
        "notifications.webhooks": [],
    }


def derived(manifest: Manifest, changes: dict[str, Any], reason: str) -> Manifest:
    """``manifest`` with the ``changes`` it does not already have, as a revision (or itself)."""
    current = content_dict(manifest)

    def value(path: str) -> Any:
        node: Any = current
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    needed = {path: v for path, v in changes.items() if value(path) != v}
    return (
        derive(manifest, needed, reason, source="the preflight rehearsal") if needed else manifest
    )


class Rehearsal:
    """The rehearsal runs of one manifest in ``work_dir``; ``say`` reports what runs now."""

    def __init__(self, manifest: Manifest, work_dir: Path, steps: int, say: Callable[[str], None]):
        self.work_dir, self.steps, self.half, self.say = Path(work_dir), steps, steps // 2, say
        self.manifest = derived(
            manifest, fitted_changes(manifest, steps), f"preflight rehearsal: {steps} steps"
        )
        self.file = write_manifest(self.manifest, self.work_dir / "rehearsal.yaml")
        self.world_size = self.manifest.topology.world_size
        self._trained: dict[str, Path | RehearsalError] = {}

    @property
    def fp8(self) -> bool:
        return self.manifest.precision.enabled

    # -- the shared runs -------------------------------------------------------------------

    def straight(self) -> Path:
        """K steps without a stop."""
        return self._once("straight", f"{self.steps} steps straight", stop_at=None)

    def paused(self) -> Path:
        """Stopped at K/2 with a checkpoint (status paused); resumes work on copies of it."""
        return self._once(
            "paused", f"{self.steps} steps, stopped at {self.half}", stop_at=self.half
        )

    def copy_of_paused(self, name: str) -> Path:
        copy = self.work_dir / name
        shutil.copytree(self.paused(), copy)
        return copy

    def _once(self, name: str, what: str, stop_at: int | None) -> Path:
        if name not in self._trained:  # a failure is kept too: every item that needs it says so
            try:
                self._trained[name] = self.train(self.file, self.work_dir / name, stop_at, what)
            except RehearsalError as exc:
                self._trained[name] = exc
        found = self._trained[name]
        if isinstance(found, RehearsalError):
            raise found
        return found

    # -- training, in this process or under torchrun ----------------------------------------

    def train(self, file: Path, run_dir: Path, stop_at: int | None = None, what: str = "") -> Path:
        from fp8ops.manifest import load_manifest
        from fp8ops.train import run_training

        args = ["train", str(file), "--run-dir", str(run_dir)]
        args += ["--stop-at", str(stop_at)] if stop_at is not None else []
        self.say(f"training {run_dir.name}: {what}")
        world = load_manifest(file).topology.world_size
        self._fp8ops(
            args,
            world,
            f"{run_dir.name}-train",
            lambda: run_training(file, run_dir, progress=False, stop_at=stop_at),
        )
        return run_dir

    def resume(
        self,
        run_dir: Path,
        assignments: dict[str, Any] | None = None,
        accept_drift: str | None = None,
        world_size: int | None = None,
    ) -> None:
        from fp8ops.train import resume_training

        args = ["resume", str(run_dir)]
        for path, value in (assignments or {}).items():
            args += ["--set", f"{path}={value}"]
        args += ["--accept-drift", accept_drift] if accept_drift else []
        self.say(f"resuming {run_dir.name}" + (f" at {assignments}" if assignments else ""))
        self._fp8ops(
            args,
            world_size or self.world_size,
            f"{run_dir.name}-resume",
            lambda: resume_training(
                run_dir, assignments=assignments, accept_drift=accept_drift, progress=False
            ),
        )

    def _fp8ops(
        self, args: list[str], world: int, log: str, in_process: Callable[[], object]
    ) -> None:
        command = shlex.join(["fp8ops", *args])
        if world == 1:
            try:
                in_process()
            except Exception as exc:  # the item reports it; preflight goes on
                why = str(exc) if isinstance(exc, Fp8opsError) else f"{type(exc).__name__}: {exc}"
                raise RehearsalError(f"`{command}` failed: {why}") from exc
            return
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "fp8ops",
            *args,
            "--no-progress",
        ]
        log_file = self.work_dir / "logs" / f"{log}.log"
        log_file.parent.mkdir(exist_ok=True)
        try:
            done = subprocess.run(
                launcher, capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise RehearsalError(
                f"`torchrun --nproc-per-node {world} {command}` did not finish in {RUN_TIMEOUT_S} s"
            ) from None
        log_file.write_text(f"$ {shlex.join(launcher)}\n{done.stdout}{done.stderr}")
        if done.returncode:
            raise RehearsalError(
                f"`torchrun --nproc-per-node {world} {command}` exited {done.returncode}: "
                f"{_tail(done.stderr or done.stdout)} (whole output: {log_file}, kept with --keep)"
            )


_LAUNCHER_LOG = re.compile(r"[WIE]\d{4} ")  # torchrun's own log lines (glog format)


def _tail(output: str, lines: int = 3) -> str:
    """What the workers said last before torchrun's failure report (rank 0 first: the other
    ranks repeat an error every rank raised as ``[rank N] ...``)."""
    said = []
    for line in output.splitlines():
        if line.startswith("E") and _LAUNCHER_LOG.match(line):
            break  # the launcher's traceback and failure summary follow
        banner = line.startswith(("*", "Setting OMP_NUM_THREADS")) or _LAUNCHER_LOG.match(line)
        if line.strip() and not banner:
            said.append(line.strip())
    main = [line for line in said if not line.startswith("[rank")] or said
    return " | ".join(main[-lines:]) or "(no output)"


# -- what the runs recorded -------------------------------------------------------------------


def _losses(run_dir: Path) -> dict[int, float]:
    return {m.step: m.loss for m in read_metrics(run_dir)}


def _final_meta(run_dir: Path, step: int):
    from fp8ops.checkpoint import read_meta
    from fp8ops.checkpoint.directory import checkpoint_name

    return read_meta(RunLayout(run_dir).checkpoints / checkpoint_name(step))


def _resumed_event(run_dir: Path) -> dict | None:
    events = [e.model_dump() for e in read_events(run_dir) if e.event == "resumed"]
    return events[-1] if events else None


def _completed(ev: Evidence, run_dir: Path, steps: int, label: str) -> bool:
    status = find_status(run_dir)
    state, step = (status.state, status.step) if status is not None else (None, None)
    return ev.check(
        state == "completed" and step == steps,
        f"{label} completed all {steps} steps ({run_dir.name}/status.json)",
        f"{label} is {state} at step {step}, not completed at {steps} ({run_dir.name}/status.json)",
    )


def _first_difference(a: dict[int, float], b: dict[int, float]) -> str:
    differing = [step for step in sorted(a.keys() | b.keys()) if a.get(step) != b.get(step)]
    if not differing:
        return "none"
    step = differing[0]
    return f"first at step {step}: {a.get(step)!r} vs {b.get(step)!r}"


# -- 4. FP8 state survives save -> load ----------------------------------------------------------


def fp8_state_survives(r: Rehearsal) -> Evidence:
    """K steps straight equal K/2 steps, a checkpoint, a resume and K/2 more, bit for bit."""
    ev = Evidence()
    if not r.fp8:
        ev.na("precision.enabled is false: there is no FP8 state to save")
        return ev
    try:
        straight = r.straight()
        resumed = r.copy_of_paused("resumed")
        r.resume(resumed)
    except RehearsalError as exc:
        ev.fail(str(exc))
        return ev
    if not _completed(ev, resumed, r.steps, f"the copy resumed at step {r.half}"):
        return ev
    a, b = _losses(straight), _losses(resumed)
    ev.facts["losses"] = {"straight": list(a.values()), "resumed": list(b.values())}
    if a == b:
        ev.ok(
            f"losses of steps 1-{r.steps} bit-identical: straight, and stopped at {r.half} "
            "then resumed"
        )
    else:
        ev.fail("losses differ: " + _first_difference(a, b))
    meta_a, meta_b = _final_meta(straight, r.steps), _final_meta(resumed, r.steps)
    digests_a, digests_b = meta_a.fp8.digests, meta_b.fp8.digests
    differ = sorted(
        m for m in digests_a.keys() | digests_b.keys() if digests_a.get(m) != digests_b.get(m)
    )
    ev.check(
        not differ,
        f"FP8 state digests of all {len(digests_a)} modules bit-identical at step {r.steps}",
        f"FP8 state differs at step {r.steps} for {len(differ)} module(s): {differ[:3]}",
    )
    ev.check(
        meta_a.weights_fingerprint == meta_b.weights_fingerprint,
        f"weights fingerprint bit-identical at step {r.steps} ({meta_a.weights_fingerprint[:12]})",
        f"weights differ at step {r.steps}: {meta_a.weights_fingerprint[:12]} vs "
        f"{meta_b.weights_fingerprint[:12]}",
    )
    event = _resumed_event(resumed)
    if event is None:
        ev.fail(f"{resumed}/events.jsonl records no resume")
    else:
        ev.ok(
            f"the load of {event['checkpoint']} verified every file's sha256, the weights "
            f"fingerprint and every module's FP8 digest ({event['load_seconds']} s)"
        )
    return ev


# -- 5. BF16 control reproduces ------------------------------------------------------------------


def bf16_control(r: Rehearsal) -> Evidence:
    """The base-dtype control, K steps twice from the same seeds: the same losses, bitwise."""
    ev = Evidence()
    try:
        control = derived(r.manifest, {"precision.enabled": False}, "preflight: BF16 control")
        file = write_manifest(control, r.work_dir / "bf16-control.yaml")
        first = r.train(file, r.work_dir / "bf16-a", what=f"BF16 control, {r.steps} steps")
        second = r.train(file, r.work_dir / "bf16-b", what="BF16 control again, same seeds")
    except (RehearsalError, Fp8opsError) as exc:
        ev.fail(str(exc))
        return ev
    a, b = _losses(first), _losses(second)
    ev.facts["losses"] = {"first": list(a.values()), "second": list(b.values())}
    seeds = control.seeds
    ev.check(
        a == b and len(a) == r.steps,
        f"two {control.precision.base_dtype} runs of {r.steps} steps (seeds model "
        f"{seeds.model}, data {seeds.data}): losses bit-identical "
        f"({', '.join(f'{v:.4f}' for v in a.values())})",
        f"two runs from the same seeds differ ({_first_difference(a, b)}) or stopped short "
        f"({len(a)} and {len(b)} of {r.steps} steps)",
    )
    wa, wb = (_final_meta(run, r.steps).weights_fingerprint for run in (first, second))
    ev.check(
        wa == wb,
        f"weights fingerprint bit-identical at step {r.steps} ({wa[:12]})",
        f"weights differ at step {r.steps}: {wa[:12]} vs {wb[:12]}",
    )
    return ev


# -- 8. BF16 fallback rehearsed -------------------------------------------------------------------


def fallback(r: Rehearsal) -> Evidence:
    """One FP8 module staged and approved through the ledger, applied by a resume."""
    from fp8ops.overrides import Ledger
    from fp8ops.run.records import read_layers_json

    ev = Evidence()
    if not r.fp8:
        ev.na("precision.enabled is false: no module runs FP8, nothing to fall back from")
        return ev
    try:
        run = r.copy_of_paused("fallback")
    except RehearsalError as exc:
        ev.fail(str(exc))
        return ev
    ledger = Ledger(run)
    taken = {o.module for o in ledger.overrides().values() if o.is_open}  # e.g. an alert's
    module = next(
        (row.fqn for row in read_layers_json(run).table.rows if row.fp8 and row.fqn not in taken),
        None,
    )
    if module is None:
        ev.na("no FP8 module without an open override to rehearse with")
        return ev
    approver = OPERATOR if r.manifest.review.allow_self_approval else REVIEWER
    try:
        staged = ledger.stage(module, "preflight: rehearse a BF16 fallback", who=OPERATOR)
        ledger.approve(staged.id, who=approver, note="preflight rehearsal")
        ev.ok(f"{module}: staged by {OPERATOR} ({staged.id[:12]}), approved by {approver}")
        r.resume(run)
    except (RehearsalError, Fp8opsError) as exc:
        ev.fail(str(exc))
        return ev
    ev.facts["module"] = module
    _completed(ev, run, r.steps, "the copy resumed with the fallback")
    after = {s: loss for s, loss in _losses(run).items() if s > r.half}
    finite = all(math.isfinite(loss) for loss in after.values())
    ev.check(
        finite and len(after) == r.steps - r.half,
        f"losses of steps {r.half + 1}-{r.steps} finite in BF16 fallback",
        f"losses after the fallback: {after}",
    )
    table = read_fallbacks(run)
    entry = table.get(module)
    ev.check(
        entry is not None and entry.dtype == "bf16" and entry.from_step == r.half + 1,
        f"fallbacks.json: {module} bf16 from step {r.half + 1}",
        f"fallbacks.json does not name {module} in bf16 from step {r.half + 1}: "
        f"{ {name: e.model_dump() for name, e in table.items()} }",
    )
    row = read_layers_json(run).table.row(module)
    ev.check(
        not row.fp8 and row.reason.code == "override",
        f"layers.json: {module} {row.precision} ({row.reason.code})",
        f"layers.json: {module} {row.precision} ({row.reason.code}), not an override",
    )
    applied = ledger.get(staged.id)
    ev.check(
        applied.status == "applied" and applied.applied_step == r.half + 1,
        f"ledger: applied at step {applied.applied_step} by revision "
        f"{(applied.applied_revision or '')[:12]}",
        f"ledger: {applied.status}, applied_step {applied.applied_step}",
    )
    before = _final_meta(r.paused(), r.half).fp8.digests[module]  # kept whatever keep_checkpoints
    after_digest = _final_meta(run, r.steps).fp8.digests[module]
    ev.check(
        before == after_digest,
        f"{module}: FP8 state frozen (digest at step {r.steps} = at step {r.half})",
        f"{module}: FP8 state changed while in BF16",
    )
    return ev


# -- 9. topology-change restore -------------------------------------------------------------------


def other_tensor_parallel(manifest: Manifest) -> tuple[dict | None, list[str], list[str]]:
    """TP x2 where the model divides and this machine has the GPUs, else TP /2. Returns the
    topology changes, or None with the sizes the model does not divide into and those that
    lack GPUs."""
    tp = manifest.topology.tensor_parallel
    sizes = (tp * 2, tp // 2) if tp % 2 == 0 else (tp * 2,)
    return _other_topology(manifest, [{"tensor_parallel": size} for size in sizes])


def other_pipeline_parallel(manifest: Manifest) -> tuple[dict | None, list[str], list[str]]:
    """PP 1 for a pipelined manifest; else PP 2 where the manifest allows it, on twice the
    ranks, or on the same ranks with half the data-parallel replicas where twice is more than
    the machine has; as :func:`other_tensor_parallel`."""
    topology = manifest.topology
    if topology.pipeline_parallel > 1:
        return _other_topology(manifest, [{"pipeline_parallel": 1}])
    candidates = [{"pipeline_parallel": 2}]
    if topology.data_parallel % 2 == 0:
        candidates.append({"pipeline_parallel": 2, "data_parallel": topology.data_parallel // 2})
    return _other_topology(manifest, candidates)


_SHORT = {"tensor_parallel": "TP", "pipeline_parallel": "PP", "data_parallel": "DP"}


def _label(changes: dict) -> str:
    return " x ".join(f"{_SHORT[field]} {size}" for field, size in changes.items())


def _other_topology(
    manifest: Manifest, candidates: list[dict]
) -> tuple[dict | None, list[str], list[str]]:
    """The first of ``candidates`` (topology changes) the manifest allows and this machine
    has the GPUs for."""
    import torch

    from fp8ops.errors import ManifestError

    invalid, too_big = [], []
    for changes in candidates:
        try:
            moved = derive(
                manifest, {f"topology.{f}": size for f, size in changes.items()}, "preflight"
            )
        except ManifestError as exc:
            invalid.append(f"{_label(changes)}: {str(exc).splitlines()[-1].strip()}")
            continue
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
        if gpus is not None and moved.topology.world_size > gpus:
            too_big.append(
                f"{_label(changes)} needs {moved.topology.world_size} GPUs, this machine has {gpus}"
            )
            continue
        return changes, invalid, too_big
    return None, invalid, too_big


def topology_change(r: Rehearsal) -> Evidence:
    """The K/2 checkpoint resumed at another TP size, and at another PP size: each completes,
    its first losses match the straight run closely, and the FP8 state was mapped (the
    ``resumed`` event)."""
    ev = Evidence()
    for field, (changes, invalid, too_big) in (
        ("tensor_parallel", other_tensor_parallel(r.manifest)),
        ("pipeline_parallel", other_pipeline_parallel(r.manifest)),
    ):
        short = _SHORT[field]
        if changes is None and too_big:  # possible, just not here
            ev.fail(
                f"cannot rehearse a {short} change on this machine: "
                + "; ".join(too_big)
                + "; run preflight on a node with that many GPUs, or --skip topology"
            )
        elif changes is None:  # this model never runs at another size
            ev.na(f"the model runs at no other {short} size: " + "; ".join(invalid))
        else:
            _rehearse_change(r, ev, field, changes)
    return ev


def _rehearse_change(r: Rehearsal, ev: Evidence, field: str, changes: dict) -> None:
    """Resume a copy of *paused* with the topology ``changes`` and check it (into ``ev``)."""
    short, label = _SHORT[field], _label(changes)
    saved = _label({f: getattr(r.manifest.topology, f) for f in changes})
    assignments = {f"topology.{f}": size for f, size in changes.items()}
    world = derive(r.manifest, assignments, "preflight").topology.world_size
    try:
        straight = r.straight()
        run = r.copy_of_paused(f"topology-{short.lower()}")
        r.resume(run, assignments, accept_drift="preflight", world_size=world)
    except RehearsalError as exc:
        ev.fail(str(exc))
        return
    if not _completed(ev, run, r.steps, f"the copy resumed at {label}"):
        return
    event = _resumed_event(run) or {}
    drift = [c for c in event.get("drift", []) if c["path"] == f"topology.{field}"]
    ev.check(
        bool(drift),
        f"resumed at {label} from the {saved} checkpoint of step {r.half} ({world} processes)",
        f"the resumed event records no {short} change",
    )
    if r.fp8:
        mapping = event.get("fp8_state")
        ev.check(
            mapping in ("group0", "own"),
            f"FP8 state mapped onto {label} ({mapping}: "
            + (
                "every rank took the one saved state group"
                if mapping == "group0"
                else "each rank read its own group"
            )
            + "), verified against its digests at load",
            f"the resumed event records FP8 state mapping {mapping!r}",
        )
    else:
        ev.na("precision.enabled is false: no FP8 state to map")
    a, b = _losses(straight), _losses(run)
    compared = range(r.half + 1, min(r.half + TP_LOSS_STEPS, r.steps) + 1)
    # Relative gaps. A straight loss of 0 divides by a tiny floor instead of raising; a
    # non-finite loss makes a NaN gap, which fails the check below.
    gaps = {s: abs(b[s] - a[s]) / max(abs(a[s]), 1e-12) for s in compared if s in a and s in b}
    key = "relative_loss_gaps" if field == "tensor_parallel" else "pipeline_relative_loss_gaps"
    ev.facts[key] = gaps
    ev.check(
        len(gaps) == len(compared) and all(g <= TP_LOSS_TOLERANCE for g in gaps.values()),
        f"losses of steps {compared.start}-{compared[-1]} at {label} within "
        f"{TP_LOSS_TOLERANCE:.0%} of the straight run (largest gap "
        f"{max(gaps.values(), default=0):.2e})",
        f"losses after the {short} change differ from the straight run by more than "
        f"{TP_LOSS_TOLERANCE:.0%}: "
        + ", ".join(f"step {s}: {a.get(s)} vs {b.get(s)}" for s in compared),
    )
