"""The checklist items that read records: versions (1), version control (2), fingerprints (3),
per-layer telemetry (6), gates and alerts (7).

Each takes the :class:`~fp8ops.preflight.target.Target` (item 6: a run directory) and returns
its :class:`~fp8ops.preflight.results.Evidence`. For a manifest file they judge the file and
the machine preflight runs on; for a run directory, what the run recorded.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from fp8ops.checkpoint import CheckpointDir, CheckpointError, read_meta
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import ManifestStore, load_manifest, manifest_hash
from fp8ops.manifest.load import parse_yaml
from fp8ops.manifest.schema import Manifest
from fp8ops.preflight.results import Evidence
from fp8ops.preflight.target import Target
from fp8ops.run import RunLayout, locked_manifest

GPU_FIELDS = ("transformer_engine", "cuda", "cudnn", "driver", "gpu")

# -- 1. versions -------------------------------------------------------------------------------


def versions(target: Target) -> Evidence:
    """Every version a resume compares is known; for a run, the same as the run recorded."""
    import torch

    from fp8ops.run.environment import environment_fingerprint
    from fp8ops.start.drift import environment_drift

    ev = Evidence()
    env = environment_fingerprint()
    ev.facts["environment"] = env
    for key in ("python", "platform", "torch", "megatron_core"):
        ev.check(env[key] is not None, f"{key} {env[key]}", f"{key}: not installed")
    if torch.cuda.is_available():
        for key in GPU_FIELDS:
            ev.check(
                env[key] is not None,
                f"{key} {env[key]}",
                f"{key}: unknown on this GPU machine; a resume could not tell whether it "
                "changed (install it, or check /proc/driver/nvidia/version)",
            )
    else:
        te = env["transformer_engine"]
        ev.na(
            f"no GPU: cuda, cudnn, driver, gpu not applicable; transformer_engine "
            f"{te or 'absent'} (recipe only on a CPU)"
        )
    if target.is_run:
        recorded, where = _recorded_environment(target)
        changes = environment_drift(recorded, env)
        ev.facts["drift"] = [{"field": c.path, "recorded": c.old, "now": c.new} for c in changes]
        ev.check(
            not changes,
            f"equal to the environment {where} recorded",
            f"differs from the environment {where} recorded: "
            + "; ".join(f"{c.path} {c.old!r} -> {c.new!r}" for c in changes)
            + ". A resume here would be refused as drift (exit 4): run where the run ran, or "
            f'accept it with fp8ops resume {target.run_dir} --accept-drift "why"',
        )
    return ev


def _recorded_environment(target: Target) -> tuple[dict, str]:
    """What a resume compares with: the latest checkpoint's environment, else run.json's."""
    try:
        latest = CheckpointDir(target.run_dir).latest()
    except CheckpointError:
        latest = None
    if latest is not None:
        try:
            return read_meta(latest).environment, f"checkpoint {latest.name}"
        except CheckpointError:
            pass
    return target.run_info.environment or {}, "run.json"


# -- 2. version control --------------------------------------------------------------------------


def version_control(target: Target) -> Evidence:
    """The manifest file is committed and unmodified, and holds the layer lists; for a run,
    the file it started from is, and it is the root of the run's revision chain."""
    ev = Evidence()
    file = target.manifest_file
    if file is None:
        ev.fail(target.source_problem)
        return ev
    _committed(ev, file)
    _layer_lists(ev, file, target.manifest)
    if target.is_run:
        _chain_root(ev, target.run_dir, file)
    return ev


def _git(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-C", str(directory), *args], capture_output=True, text=True, check=False
    )


def _committed(ev: Evidence, file: Path) -> None:
    where, name = file.resolve().parent, file.resolve().name
    try:
        inside = _git(where, "rev-parse", "--show-toplevel")
    except FileNotFoundError:
        ev.fail("git is not installed: cannot tell whether the manifest is under version control")
        return
    if inside.returncode:
        ev.fail(
            f"{file}: not in a git repository; commit it to one (git add {file} && git "
            "commit) so the launched manifest can be traced"
        )
        return
    if _git(where, "ls-files", "--error-unmatch", "--", name).returncode:
        ev.fail(
            f"{file}: not tracked by git (git ls-files --error-unmatch); git add {file} && "
            "git commit"
        )
        return
    status = _git(where, "status", "--porcelain", "--", name).stdout.strip()
    if status:
        ev.fail(
            f"{file}: changed since its last commit (git status: {status!r}); commit the "
            f"change, or restore the file (git checkout -- {file})"
        )
        return
    commit = _git(where, "log", "-1", "--format=%h %cs", "--", name).stdout.strip()
    ev.ok(f"{file}: tracked by git and unmodified (last commit {commit or 'unknown'})")
    ev.facts["commit"] = commit


def _raw_yaml(file: Path) -> dict[str, Any]:
    """The mapping written in ``file``: what it sets, defaults not filled in."""
    data, _ = parse_yaml(file.read_text(encoding="utf-8-sig"), str(file))
    return data if isinstance(data, dict) else {}


def _layer_lists(ev: Evidence, file: Path, manifest: Manifest) -> None:
    precision = _raw_yaml(file).get("precision") or {}
    written = load_manifest(file).precision
    ev.check(
        "include_modules" in precision,
        f"precision.include_modules written in the file: {list(written.include_modules)}",
        f"{file}: precision.include_modules is not written, so which layers run FP8 comes from "
        f"fp8ops' default ({list(written.include_modules)}), which a newer fp8ops may change; "
        "write the list into the manifest",
    )
    excluded = list(written.exclude_modules)
    ev.ok(
        f"precision.exclude_modules: {excluded}"
        + ("" if "exclude_modules" in precision else " (not written: nothing excluded)")
    )
    ev.ok(f"precision.overrides in the file: {[o.module for o in written.overrides]}")
    from_ledger = [o for o in manifest.precision.overrides if o.approval is not None]
    if from_ledger:  # a run's locked manifest: the ledger's approvals, anchored by revisions
        ev.ok(
            "the run's manifest adds overrides from its ledger: "
            + ", ".join(f"{o.module} (approval {o.approval[:12]})" for o in from_ledger)
        )


def _chain_root(ev: Evidence, run_dir: Path, file: Path) -> None:
    """The file hashes to the first revision of the run's chain that the run holds (a file
    that is itself a revision names a parent the run never stored)."""
    store = ManifestStore(RunLayout(run_dir).manifests)
    try:
        current = locked_manifest(run_dir)  # manifest.yaml is the locked, stored revision
        held = [current]
        while current.revision.parent and store.path_for(current.revision.parent).exists():
            current = store.get(current.revision.parent)  # re-hashed against its name
            held.append(current)
    except Fp8opsError as exc:
        ev.fail(f"{run_dir}: the run's locked manifest or its revision chain is damaged: {exc}")
        return
    root, file_hash = manifest_hash(held[-1]), manifest_hash(load_manifest(file))
    ev.facts["chain_root"] = root
    if held[-1].revision.parent == file_hash:  # e.g. a dual-track's bf16 or fallback track
        ev.ok(
            f"the run's revision chain starts at a revision of {file} ({root[:12]}, whose "
            f"parent is the file, {file_hash[:12]})"
        )
        return
    ev.check(
        root == file_hash,
        f"{file} is the root of the run's revision chain ({root[:12]}, "
        f"{len(held)} revision(s) in {run_dir}/manifests)",
        f"{file} hashes to {file_hash[:12]} but the run's revision chain starts at {root[:12]}: "
        "the file changed after the run started (git log -p -- FILE), or the run was started "
        "from another file",
    )


# -- 3. fingerprints -----------------------------------------------------------------------------


def fingerprints(target: Target) -> Evidence:
    """Model, tokenizer and data fingerprints: pinned in a manifest and equal to what is there
    now, or recorded by the run."""
    return _recorded_fingerprints(target) if target.is_run else _pinned_fingerprints(target)


def _pinned_fingerprints(target: Target) -> Evidence:
    from fp8ops.checkpoint.weights import read_base_meta
    from fp8ops.data import build_data
    from fp8ops.data.tokenizer import tokenizer_for

    ev, m = Evidence(), target.manifest
    to_pin: dict[str, str] = {}

    def pinned(field: str, pin: str | None, actual: str, what: str) -> None:
        ev.facts[field] = {"pinned": pin, "actual": actual}
        if pin is None:
            to_pin[field] = actual
            ev.fail(f"{field} is not pinned; {what} is {actual}")
        else:
            ev.check(
                pin == actual,
                f"{field} pinned and equal to {what} ({actual[:12]})",
                f"{field} is pinned to {pin} but {what} is {actual}",
            )

    if m.model.init_checkpoint is None:
        ev.na(f"model: no init checkpoint, initialised from seeds.model {m.seeds.model}")
    else:
        try:
            meta = read_base_meta(
                Path(m.model.init_checkpoint), m.model, field="model.init_checkpoint"
            )
            pinned(
                "model.fingerprint",
                m.model.fingerprint,
                meta["fingerprint"],
                f"the weights of {m.model.init_checkpoint}",
            )
        except Fp8opsError as exc:
            ev.fail(str(exc))
    try:
        unpinned_tokenizer = m.tokenizer.model_copy(update={"fingerprint": None})
        what = "fp8ops' byte tokenizer" if m.tokenizer.kind == "byte" else str(m.tokenizer.path)
        pinned(
            "tokenizer.fingerprint",
            m.tokenizer.fingerprint,
            tokenizer_for(unpinned_tokenizer).fingerprint(),
            what,
        )
    except Fp8opsError as exc:
        ev.fail(str(exc))
    try:
        unpinned = m.model_copy(update={"data": m.data.model_copy(update={"fingerprint": None})})
        pinned(
            "data.fingerprint",
            m.data.fingerprint,
            build_data(unpinned).fingerprint,
            "the data built from the manifest now",
        )
    except Fp8opsError as exc:
        ev.fail(f"data: {exc}")
    if to_pin:
        sets = " ".join(f"--set {field}={value}" for field, value in to_pin.items())
        out = target.path.with_name(f"{target.path.stem}-pinned.yaml")
        command = (
            f'fp8ops manifest derive {target.path} {sets} --reason "pin fingerprints" --out {out}'
        )
        ev.facts["pin_command"] = command
        ev.fail(f"pin them in a revision, then commit it: {command}")
    return ev


def _recorded_fingerprints(target: Target) -> Evidence:
    from fp8ops.data import build_data
    from fp8ops.data.tokenizer import tokenizer_for

    ev, info, m = Evidence(), target.run_info, target.manifest
    model = info.model
    if model.init_checkpoint:
        found = model.init_fingerprint
        how = (
            "verified at load"
            if model.init_verified
            else "not re-hashed at load: saved in a wider dtype than the run trains in"
        )
        ev.check(
            found is not None,
            f"model: run.json records the init checkpoint's weights {str(found)[:12]}, {how}",
            "model: run.json records no fingerprint of the init checkpoint",
        )
    else:
        found = model.initial_weights_fingerprint
        ev.check(
            found is not None,
            f"model: initial weights {str(found)[:12]} (from seeds.model)",
            "model: run.json records no initial weights fingerprint",
        )
    token = info.tokenizer.fingerprint if info.tokenizer is not None else None
    if ev.check(
        token is not None,
        f"tokenizer: run.json records {str(token)[:12]}",
        "tokenizer: run.json records no fingerprint",
    ):
        try:
            unpinned = m.tokenizer.model_copy(update={"fingerprint": None})
            token_now = tokenizer_for(unpinned).fingerprint()
        except Fp8opsError as exc:
            ev.fail(f"tokenizer: cannot be read now from the run's manifest: {exc}")
        else:
            ev.check(
                token_now == token,
                "tokenizer: read now, it hashes the same",
                f"tokenizer: read now from the run's manifest it hashes to {token_now}, not "
                f"{token}: a resume would encode and decode otherwise",
            )
    recorded = info.data.fingerprint if info.data is not None else None
    if not ev.check(
        recorded is not None,
        f"data: run.json records {str(recorded)[:12]}",
        "data: run.json records no fingerprint",
    ):
        return ev
    try:
        unpinned = m.model_copy(update={"data": m.data.model_copy(update={"fingerprint": None})})
        now = build_data(unpinned).fingerprint
    except Fp8opsError as exc:
        ev.fail(f"data: cannot be built now from the run's manifest: {exc}")
        return ev
    ev.facts.update(model=found, tokenizer=token, data={"recorded": recorded, "now": now})
    ev.check(
        now == recorded,
        "data: built now from the run's manifest, it hashes the same",
        f"data: built now from the run's manifest it hashes to {now}, not {recorded}: a "
        "resume would train on other data",
    )
    return ev


# -- 6. per-layer telemetry ---------------------------------------------------------------------

STATE_METRICS = tuple(
    f"{slot}.{m}" for slot in ("input", "weight", "grad_output") for m in ("amax", "scale")
)
CAST_METRICS = tuple(
    f"{slot}.{m}"
    for slot in ("input", "weight", "grad_output")
    for m in ("saturation", "underflow", "nan", "inf")
)


def telemetry(run_dir: Path, manifest: Manifest, last_step: int | None) -> Evidence:
    """Every FP8 module of ``layers.json`` has a row at every step up to ``last_step`` (None: a
    live run, whatever is committed) on every rank, with finite amax and scale, and cast
    statistics (and the FP8 error) at their cadence."""
    from fp8ops.run.records import read_layers_json
    from fp8ops.telemetry import open_run

    ev = Evidence()
    if not manifest.precision.enabled:
        ev.na("precision.enabled is false: no FP8 modules, no per-layer FP8 telemetry")
        return ev
    try:
        modules = read_layers_json(run_dir).table.fp8_fqns
        store = open_run(run_dir)
    except Fp8opsError as exc:
        ev.fail(str(exc))
        return ev
    if not modules:
        ev.na(f"{run_dir}/layers.json admits no module to FP8")
        return ev
    missing = sorted(set(modules) - set(store.modules))
    if not ev.check(
        not missing,
        f"{len(modules)} FP8 modules of layers.json in the store",
        f"FP8 modules without telemetry: {missing[:4]}",
    ):
        return ev
    cadence = manifest.telemetry
    for rank in store.ranks:
        _rank_telemetry(ev, store, rank, list(modules), last_step, cadence)
    return ev


def _rank_telemetry(
    ev, store, rank: int, modules: list[str], last_step: int | None, cadence
) -> None:
    steps = store.steps(rank)
    last = steps[-1] if steps else None
    if not ev.check(
        bool(steps) and (last_step is None or last >= last_step),
        f"rank {rank}: steps {steps.start}-{last} committed",
        f"rank {rank}: telemetry committed up to step {last}, the run is at {last_step}",
    ):
        return

    def window(metric: str) -> np.ndarray:  # steps x modules
        return store.metric_window(metric, rank=rank)[modules].to_numpy()

    first = 0  # rank 0 has every step; a rank that joined at a topology change, rows from then
    if rank > 0:
        recorded = ~np.isnan(window("fp8_enabled")).all(axis=1)
        first = int(np.argmax(recorded)) if recorded.any() else len(steps)
        if first:
            ev.ok(f"rank {rank}: joined at step {steps[first]} (a topology change)")
    numbers = np.asarray(steps[first:])
    problems = []
    for metric in STATE_METRICS:
        bad = ~np.isfinite(window(metric)[first:])
        if bad.any():
            problems.append(_first_bad(metric, bad, numbers, modules, "not finite"))
    ran_fp8 = window("fp8_enabled")[first:] == 1  # not while an override held it in BF16
    cadences = [(m, cadence.every_steps) for m in CAST_METRICS]
    for metric, every in cadences + [("fp8_rel_error", cadence.error_sample_every)]:
        bad = ran_fp8 & (numbers % every == 0)[:, None] & np.isnan(window(metric)[first:])
        if bad.any():
            problems.append(_first_bad(metric, bad, numbers, modules, "missing"))
    measured = int((numbers % cadence.every_steps == 0).sum())
    sampled = int((numbers % cadence.error_sample_every == 0).sum())
    ev.check(
        not problems,
        f"rank {rank}: {len(modules)} modules x {len(numbers)} steps: amax and scale finite "
        f"every step; cast statistics on the {measured} steps due (every "
        f"{cadence.every_steps}), FP8 error on the {sampled} due (every "
        f"{cadence.error_sample_every})",
        f"rank {rank}: " + "; ".join(problems[:4]),
    )


def _first_bad(metric: str, bad: np.ndarray, steps, modules: list[str], what: str) -> str:
    row, col = np.argwhere(bad)[0]
    return (
        f"{metric} {what} for {int(bad.sum())} module-steps (first: {modules[col]} at step "
        f"{steps[row]})"
    )


# -- 7. gates and alerts ---------------------------------------------------------------------------


def gates(target: Target) -> Evidence:
    """The manifest file itself writes ``gates`` and ``alerts`` (not fp8ops' defaults), and
    the Stop rule on non-finite values is on."""
    ev = Evidence()
    file = target.manifest_file
    if file is None:
        ev.fail(target.source_problem)
        return ev
    raw, m = _raw_yaml(file), load_manifest(file)
    for section in ("gates", "alerts"):
        written = raw.get(section)
        ev.check(
            isinstance(written, dict) and bool(written),
            f"{section}: written in {file} ({', '.join(sorted(written or {}))})",
            f"{file} writes no {section} section, so fp8ops' defaults would decide; write "
            f"the {section} you accept into the manifest",
        )
    ev.check(
        m.alerts.nonfinite_stop,
        "alerts.nonfinite_stop: true (Stop at the first NaN/Inf)",
        "alerts.nonfinite_stop is false: a NaN/Inf would not stop the run; set it to true",
    )
    g = m.gates
    ev.ok(
        f"gates: loss_gap {g.loss_gap}, bucket_accuracy_gap {g.bucket_accuracy_gap}, "
        f"allow_nonfinite {g.allow_nonfinite}, allow_skipped_steps {g.allow_skipped_steps}, "
        f"min_bucket_items {g.min_bucket_items}, require_resume_continuity "
        f"{g.require_resume_continuity}, resume_loss_jump {g.resume_loss_jump}"
    )
    a = m.alerts
    stops = {
        name: getattr(a, name).stop
        for name in ("saturation", "underflow", "scale_change", "fp8_rel_error")
    }
    ev.ok(
        "alert stop levels: "
        + ", ".join(f"{k} {v}" for k, v in stops.items())
        + f"; divergence x{a.divergence_factor} after {a.divergence_warmup_steps} steps, "
        f"patience {a.patience_steps}"
    )
    ev.facts.update(gates=g.model_dump(mode="json"), alert_stops=stops)
    return ev
