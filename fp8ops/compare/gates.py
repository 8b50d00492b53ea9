"""The release gates: one candidate against the reference, with one set of thresholds
(``gates``: :class:`fp8ops.manifest.schema.Gates`) for every candidate: the runs' own, which
must agree (:func:`one_bar`), or a manifest's given with ``--gates``.

Every gate is reported, passing or not, with its value and threshold; a gate that does not
apply (a run never resumed, capability not evaluated) passes with a detail saying why it was
not gated. In order:

``reference``           the reference itself completed and stayed finite
``completed``           the candidate reached its train_steps with status completed
``loss_gap``            held-out loss, candidate minus reference, at the last evaluation both
                        made at equal training tokens
``bucket_accuracy_gap`` capability accuracy, reference minus candidate, in every bucket with
                        enough items and overall, at the last capability step both reached;
                        a drop over the gap fails when the paired sign test says it is not
                        noise (``bucket_significance``, Holm over the gated rows); not
                        measured (passes, saying so) when the reference got no item right
``finite``              no NaN/Inf loss, gradient norm, cast (telemetry) or nonfinite alert
``skipped_steps``       no optimizer step skipped
``resume_continuity``   a resumed run continued where it left off
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fp8ops.alerts import Alert
from fp8ops.compare.runs import RunRecords, finite
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import Gates

RESUME_WINDOW = 10  # steps averaged on each side of a resume (gates.resume_loss_jump's window)


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    value: float | int | None
    threshold: float | int | bool | None
    detail: str  # one sentence; a failing gate's detail is its part of the cause


@dataclass
class CandidateVerdict:
    label: str
    run_dir: str
    manifest: str  # sha256 of the locked manifest
    fp8_modules: int  # modules admitted to FP8 (layers.json)
    gates: list[GateResult]
    evaluations: list[dict[str, Any]]  # the loss gap at every matched evaluation
    capability: dict[str, Any] | None  # per-bucket comparison at the matched capability step
    worst_bucket: dict[str, Any] | None
    worst_layer: dict[str, Any] | None
    fallback_modules: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates)

    @property
    def cause(self) -> str | None:
        """The failing gates in one line, and the layer most likely to blame."""
        if self.passed:
            return None
        parts = [gate.detail for gate in self.gates if not gate.passed]
        if self.worst_layer is not None:
            parts.append(describe_layer(self.worst_layer))
        return "; ".join(parts)


def one_bar(runs: list[RunRecords]) -> Gates:
    """The gates every candidate is judged by: the runs' own, which must be one bar. A
    candidate's own looser gates would pass it where the reference's would not."""
    reference, bar = runs[0], runs[0].manifest.gates.model_dump()
    for run in runs[1:]:
        own = run.manifest.gates.model_dump()
        differ = [
            f"gates.{key} is {own[key]!r}, the reference has {bar[key]!r}"
            for key in bar
            if own[key] != bar[key]
        ]
        if differ:
            raise Fp8opsError(
                f"{run.path}: manifest.yaml {'; '.join(differ)} ({reference.path}); every "
                "candidate is judged by one bar: give it with --gates MANIFEST (its gates "
                "section judges every run)"
            )
    return reference.manifest.gates


def judge(reference: RunRecords, candidate: RunRecords, gates: Gates) -> CandidateVerdict:
    """Every gate for ``candidate``, at the thresholds of ``gates``."""
    evaluations = matched_evaluations(reference, candidate)
    bucket_gate, capability, worst_bucket = _buckets(reference, candidate, gates)
    return CandidateVerdict(
        label=candidate.label,
        run_dir=str(candidate.path),
        manifest=candidate.manifest_sha256,
        fp8_modules=len(candidate.layers.table.fp8_fqns),
        gates=[
            _reference_gate(reference),
            _completed_gate(candidate),
            _loss_gate(reference, candidate, evaluations, gates),
            bucket_gate,
            _finite_gate(candidate, gates),
            _skipped_gate(candidate, gates),
            _resume_gate(candidate, reference, gates),
        ],
        evaluations=evaluations,
        capability=capability,
        worst_bucket=worst_bucket,
        worst_layer=worst_layer(candidate),
        fallback_modules=dict(candidate.track.fallback_modules),
    )


def reference_problems(reference: RunRecords) -> list[str]:
    """Why the reference cannot anchor a verdict (empty: it is clean)."""
    problems = [_completion_problem(reference)]
    steps, detail = _nonfinite(reference)
    if steps:
        problems.append(detail)
    bad_evals = [r["step"] for r in reference.evals if not finite(r["loss"])]
    if bad_evals:
        problems.append(f"held-out loss not finite at {_steps(bad_evals)} (eval.jsonl)")
    return [p for p in problems if p]


# --------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------


def _reference_gate(reference: RunRecords) -> GateResult:
    problems = reference_problems(reference)
    if problems:
        detail = f"reference {reference.label} is not clean: {'; '.join(problems)}"
    else:
        detail = f"reference {reference.label} completed with finite losses"
    return GateResult("reference", not problems, None, None, detail)


def _completed_gate(run: RunRecords) -> GateResult:
    problem = _completion_problem(run)
    steps = run.manifest.schedule.train_steps
    detail = problem or f"completed {steps} steps"
    return GateResult("completed", problem is None, run.last_step, steps, detail)


def _completion_problem(run: RunRecords) -> str | None:
    steps, status = run.manifest.schedule.train_steps, run.status
    where = f"{run.label} status {run.state} at step {status.step} of {steps}"
    if run.state == "stopped":
        alert = status.alert or {}
        return f"{where}: {alert.get('message') or 'stopped by an alert'}"
    if run.state == "failed":
        return f"{where}: {status.error or 'failed (see its events.jsonl)'}"
    if run.state != "completed":
        return f"{where} (resume it to the end, then compare)"
    if run.last_step < steps:
        return f"{run.label} status completed, but metrics.jsonl ends at step {run.last_step}"
    gaps = sorted(set(range(1, run.last_step + 1)) - {m["step"] for m in run.metrics})
    if gaps:  # every later step's tokens would differ, and the gates judge an earlier step
        return f"{run.label} metrics.jsonl lacks {_steps(gaps)}; the log is damaged"
    return None


def matched_evaluations(reference: RunRecords, candidate: RunRecords) -> list[dict[str, Any]]:
    """Held-out losses at every step both runs evaluated after equal training tokens."""
    ours = {record["step"]: record for record in reference.evals}
    matched = []
    for record in candidate.evals:
        step = record["step"]
        tokens = candidate.tokens_through.get(step)
        if step not in ours or tokens is None or tokens != reference.tokens_through.get(step):
            continue
        ref_loss, cand_loss = ours[step]["loss"], record["loss"]
        gap = cand_loss - ref_loss if finite(ref_loss) and finite(cand_loss) else math.nan
        matched.append(
            {
                "step": step,
                "tokens": tokens,
                "reference": ref_loss,
                "candidate": cand_loss,
                "gap": gap,
            }
        )
    return matched


def _loss_gate(
    reference: RunRecords,
    candidate: RunRecords,
    evaluations: list[dict[str, Any]],
    gates: Gates,
) -> GateResult:
    if not evaluations:
        return GateResult(
            "loss_gap",
            False,
            None,
            gates.loss_gap,
            f"no held-out evaluation at a step both runs reached with equal tokens "
            f"(reference evaluated at steps {_steps(r['step'] for r in reference.evals)})",
        )
    last = evaluations[-1]
    final = max((r["step"] for r in candidate.evals), default=None)
    if candidate.state == "completed" and final != last["step"]:
        return GateResult(
            "loss_gap",
            False,
            None,
            gates.loss_gap,
            f"the candidate's last evaluation (step {final}) has no reference evaluation after "
            f"equal tokens; the last matched one is at step {last['step']}",
        )
    gap = last["gap"]
    passed = finite(gap) and gap <= gates.loss_gap
    where = f"at step {last['step']} (tokens {last['tokens']})"
    if not finite(gap):
        detail = f"loss gap not finite {where} (candidate {last['candidate']})"
    else:
        detail = f"loss gap {gap:.3g} {'<=' if passed else '>'} {gates.loss_gap:g} {where}"
    return GateResult("loss_gap", passed, gap, gates.loss_gap, detail)


def _buckets(
    reference: RunRecords, candidate: RunRecords, gates: Gates
) -> tuple[GateResult, dict[str, Any] | None, dict[str, Any] | None]:
    """The bucket gate, the comparison behind it, and the worst gated bucket."""
    gap, name = gates.bucket_accuracy_gap, "bucket_accuracy_gap"
    expected = candidate.manifest.capability.enabled and (
        candidate.info.data is not None and candidate.info.data.objective == "sft"
    )
    missing = [run for run in (reference, candidate) if not run.capability]
    if missing and not expected:
        why = (
            "capability.enabled is false"
            if not candidate.manifest.capability.enabled
            else "the data has no answers to check (not SFT)"
        )
        return GateResult(name, True, None, gap, f"not gated: {why}"), None, None
    if missing:
        run = missing[0]
        return (
            GateResult(
                name,
                False,
                None,
                gap,
                f"no capability records in {run.label} ({run.path}/capability.jsonl), though "
                "capability.enabled is true",
            ),
            None,
            None,
        )
    step = _matched_capability_step(reference, candidate)
    if step is None:
        return (
            GateResult(
                name,
                False,
                None,
                gap,
                "no capability evaluation at a step both runs reached with equal tokens",
            ),
            None,
            None,
        )
    last = candidate.manifest.schedule.train_steps
    if candidate.state == "completed" and step != last:  # every run evaluates at its last step
        return (
            GateResult(
                name,
                False,
                None,
                gap,
                f"no capability evaluation of both runs at the last step ({last}) with equal tokens "
                f"(one failed? see events.jsonl: capability_failed); the last matched one is at "
                f"step {step}",
            ),
            None,
            None,
        )

    ours, theirs = (
        {_item_key(item) for item in run.predictions[step]} for run in (reference, candidate)
    )
    if ours != theirs:  # unpaired items count for neither side: any drop would pass
        return (
            GateResult(
                name,
                False,
                None,
                gap,
                f"the runs answered different held-out items at step {step} ({len(ours & theirs)} "
                f"of {len(ours | theirs)} in both): evaluate the same items (capability.items, the "
                "data's eval split)",
            ),
            None,
            None,
        )
    comparison = compare_capability(reference, candidate, step, gates)
    overall = comparison["overall"]
    if overall["reference_accuracy"] == 0:  # nothing right to lose: any candidate would pass
        return (
            GateResult(
                name,
                True,
                None,
                gap,
                f"not measured: the reference answered none of its {overall['items']} items right at "
                f"step {step}, so no drop can show; evaluate items it can answer (a trained base "
                "checkpoint, more steps, an easier capability set)",
            ),
            comparison,
            None,
        )
    rows = [overall, *comparison["buckets"]]
    gated = [row for row in rows if row["gated"]]
    failing = _failing_rows(gated, gap, gates.bucket_significance)
    buckets = [row for row in comparison["buckets"] if row["gated"]]
    worst = max(buckets, key=_drop_order) if buckets else None
    value = max(gated, key=_drop_order)["drop"]
    where = f"at step {step}"
    if failing:
        first = max(failing, key=_drop_order)
        more = f"; {len(failing) - 1} more over the gap" if len(failing) > 1 else ""
        detail = f"accuracy drop {_describe_bucket(first)} > {gap:g} {where}{more}"
    else:
        top = max(gated, key=_drop_order)
        small = len(comparison["buckets"]) - len(buckets)
        note = f"; {small} buckets under {gates.min_bucket_items} items not gated" if small else ""
        if top["drop"] <= gap:
            detail = f"largest accuracy drop {top['drop']:.3g} <= {gap:g} ({top['bucket']})"
        else:  # over the gap, but the disagreeing items could be coin flips
            detail = (
                f"largest accuracy drop {_describe_bucket(top)} > {gap:g} but not significant "
                f"(Holm over {len(gated)} gated rows at {gates.bucket_significance:g})"
            )
        detail += f" {where}{note}"
    return GateResult(name, not failing, value, gap, detail), comparison, worst


def _failing_rows(
    rows: list[dict[str, Any]], gap: float, significance: float | None
) -> list[dict[str, Any]]:
    """The gated rows whose drop is over the gap and is not noise.

    Every row is a test on the same items at once, so their p-values go through Holm's step-down
    procedure: the chance that a clean candidate fails any row by noise stays under
    ``significance`` (as with Bonferroni, but a second and third real regression need less
    evidence than the first). An unknown drop always fails.
    """
    failing = [row for row in rows if not finite(row["drop"])]
    known = [row for row in rows if finite(row["drop"])]
    if significance is None:
        return failing + [row for row in known if row["drop"] > gap]
    for i, row in enumerate(sorted(known, key=lambda r: r["p_value"])):
        if row["p_value"] >= significance / (len(rows) - i):
            break  # this and every larger p-value: not significant
        if row["drop"] > gap:
            failing.append(row)
    return failing


def sign_test_p(lost: int, gained: int) -> float:
    """One-sided exact sign test (McNemar's, exact): the probability of ``lost`` or more of the
    ``lost + gained`` disagreeing items going against the candidate if each were a coin flip."""
    n = lost + gained
    return sum(math.comb(n, k) for k in range(lost, n + 1)) / 2**n


def _matched_capability_step(reference: RunRecords, candidate: RunRecords) -> int | None:
    ours = {record["step"] for record in reference.capability}
    steps = [
        r["step"]
        for r in candidate.capability
        if r["step"] in ours
        and candidate.tokens_through.get(r["step"]) is not None
        and candidate.tokens_through.get(r["step"]) == reference.tokens_through.get(r["step"])
    ]
    return max(steps, default=None)


def compare_capability(
    reference: RunRecords, candidate: RunRecords, step: int, gates: Gates
) -> dict[str, Any]:
    """Accuracy per bucket and overall at ``step``, with paired counts from the per-item files:
    ``lost`` items right in the reference and wrong in the candidate, ``gained`` the reverse."""
    ref = next(r for r in reference.capability if r["step"] == step)
    cand = next(r for r in candidate.capability if r["step"] == step)
    lost, gained = _paired_counts(reference.predictions[step], candidate.predictions[step])

    def row(bucket: str, r: dict[str, Any], c: dict[str, Any], gated: bool) -> dict[str, Any]:
        ref_acc, cand_acc = r.get("accuracy"), c.get("accuracy")
        drop = ref_acc - cand_acc if finite(ref_acc) and finite(cand_acc) else math.nan
        return {
            "bucket": bucket,
            "items": min(r.get("items", 0), c.get("items", 0)),
            "reference_accuracy": ref_acc,
            "candidate_accuracy": cand_acc,
            "drop": drop,
            "gated": gated,
            "lost": lost.get(bucket, 0),
            "gained": gained.get(bucket, 0),
            "p_value": sign_test_p(lost.get(bucket, 0), gained.get(bucket, 0)),
        }

    buckets = []
    for bucket in sorted(set(ref["buckets"]) | set(cand["buckets"])):
        r, c = ref["buckets"].get(bucket, {}), cand["buckets"].get(bucket, {})
        items = min(r.get("items", 0), c.get("items", 0))
        buckets.append(row(bucket, r, c, items >= gates.min_bucket_items))
    return {
        "step": step,
        "tokens": candidate.tokens_through.get(step),
        "overall": row("overall", ref, cand, True),
        "buckets": buckets,
    }


def _paired_counts(
    reference: list[dict[str, Any]], candidate: list[dict[str, Any]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Per bucket (and ``overall``): items only the reference got right, and only the candidate."""
    theirs = {_item_key(item): item for item in candidate}
    lost: dict[str, int] = {}
    gained: dict[str, int] = {}
    for item in reference:
        other = theirs.get(_item_key(item))
        if other is None or bool(item.get("correct")) == bool(other.get("correct")):
            continue
        tally = lost if item.get("correct") else gained
        for bucket in ("overall", *_item_buckets(item)):
            tally[bucket] = tally.get(bucket, 0) + 1
    return lost, gained


def _item_key(item: dict[str, Any]) -> Any:
    # The row of the eval split: every track evaluates the same rows. Not the problem key,
    # which the terse and verbose wordings of one problem share.
    return item.get("index", item.get("key"))


def _item_buckets(item: dict[str, Any]) -> list[str]:
    buckets = item.get("buckets") or {}
    if isinstance(buckets, dict):  # {"task": "add"}: named as capability.jsonl names them
        return [f"{name}={value}" for name, value in buckets.items()]
    return [str(bucket) for bucket in buckets]


def _drop_order(row: dict[str, Any]) -> float:
    return row["drop"] if finite(row["drop"]) else math.inf  # unknown counts as worst


def _describe_bucket(row: dict[str, Any]) -> str:
    def number(x: Any, spec: str) -> str:  # an accuracy a damaged record left out reads as such
        return format(x, spec) if finite(x) else "unknown"

    return (
        f"{number(row['drop'], '.3g')} in {row['bucket']} "
        f"({number(row['reference_accuracy'], '.3f')} -> "
        f"{number(row['candidate_accuracy'], '.3f')}; {row['lost']} right only in the reference, "
        f"{row['gained']} only in the candidate, of {row['items']}; sign test p "
        f"{row['p_value']:.2g})"
    )


def _finite_gate(run: RunRecords, gates: Gates) -> GateResult:
    steps, detail = _nonfinite(run)
    allowed = gates.allow_nonfinite
    if steps and allowed:
        detail += " (allowed by gates.allow_nonfinite)"
    return GateResult(
        "finite", not steps or allowed, len(steps), allowed, detail or "no NaN or Inf seen"
    )


def _nonfinite(run: RunRecords) -> tuple[list[int], str]:
    """The steps where something was NaN or infinite, and a sentence saying where."""
    # A skipped step is skipped because its gradient norm was not finite: that is the
    # skipped_steps gate's to judge (gates.allow_skipped_steps), not this one's.
    in_metrics = [
        m["step"]
        for m in run.metrics
        if not finite(m.get("loss"))
        or ("grad_norm" in m and not m.get("skipped") and not finite(m["grad_norm"]))
    ]
    telemetry = run.telemetry
    in_casts = list(telemetry.nonfinite_steps) if telemetry else []
    alerts = [a for a in run.alerts if a.rule == "nonfinite"]
    steps = sorted(set(in_metrics) | set(in_casts) | {a.step for a in alerts})
    if not steps:
        return [], ""
    parts = []
    if in_metrics:
        parts.append(f"loss or grad_norm at {_steps(in_metrics)}")
    if in_casts:
        worst = max(telemetry.layers, key=lambda layer: layer.nonfinite)
        parts.append(
            f"{telemetry.nonfinite} NaN/Inf cast elements at {_steps(in_casts)} (most in "
            f"{worst.module})"
        )
    if alerts:
        parts.append(f"{len(alerts)} nonfinite alerts (first: {alerts[0].message})")
    return steps, f"{run.label} non-finite: {'; '.join(parts)}"


def _skipped_gate(run: RunRecords, gates: Gates) -> GateResult:
    skipped = [m["step"] for m in run.metrics if m.get("skipped")]
    allowed = gates.allow_skipped_steps
    if not skipped:
        detail = "no optimizer step skipped"
    else:
        detail = f"{len(skipped)} optimizer steps skipped ({_steps(skipped)})"
        if allowed:
            detail += " (allowed by gates.allow_skipped_steps)"
    return GateResult("skipped_steps", not skipped or allowed, len(skipped), allowed, detail)


def _resume_gate(run: RunRecords, reference: RunRecords, gates: Gates) -> GateResult:
    name, limit = "resume_continuity", gates.resume_loss_jump
    if not gates.require_resume_continuity:
        return GateResult(name, True, None, limit, "not gated: require_resume_continuity is false")
    resume_steps = sorted({r.step for r in run.resumes} | set(run.restarts))
    if not resume_steps:
        return GateResult(name, True, None, limit, "not resumed")

    problems = []
    logged = {m["step"] for m in run.metrics}
    gaps = sorted(set(range(1, run.last_step + 1)) - logged)
    if gaps:
        problems.append(f"metrics.jsonl lacks {_steps(gaps)}")
    recorded = {r.step: r for r in run.resumes}
    for step in run.restarts:
        if step not in recorded:
            problems.append(f"training continued after step {step} with no resumed event")
    for resume in run.resumes:
        if not resume.checkpoint:
            problems.append(f"the resumed event at step {resume.step} names no checkpoint")

    # The change across the resume, less the reference's across the same steps: same data in
    # the same order, so its change is what the loss would have done anyway (falling early in
    # training, which would otherwise hide a jump; harder or easier batches).
    # A reference that itself resumed near the step is no baseline: a jump of its own would
    # cancel the candidate's.
    ours = {m["step"]: m.get("loss") for m in run.metrics}
    theirs = {m["step"]: m.get("loss") for m in reference.metrics}
    its_resumes = {r.step for r in reference.resumes} | set(reference.restarts)
    jumps = {}
    for step in resume_steps:
        change, expected = _change_across(ours, step), _change_across(theirs, step)
        if any(abs(step - other) <= RESUME_WINDOW for other in its_resumes):
            expected = None
        if change is not None:
            jumps[step] = change - (expected if expected is not None else 0.0)
    worst_step = max(jumps, key=jumps.get, default=None)
    value = jumps.get(worst_step)
    if value is not None and value > limit:
        checkpoint = recorded[worst_step].checkpoint if worst_step in recorded else None
        problems.append(
            f"mean loss rose {value:.3g} > {limit:g} more than the reference's over the "
            f"{RESUME_WINDOW} steps after the resume at step {worst_step}"
            + (f" ({checkpoint})" if checkpoint else "")
        )
    if problems:
        return GateResult(name, False, value, limit, f"resume: {'; '.join(problems)}")
    change = f"; largest loss change {value:.3g} <= {limit:g}" if value is not None else ""
    return GateResult(
        name, True, value, limit, f"resumed at {_steps(resume_steps)}, steps contiguous{change}"
    )


def _change_across(losses: dict[int, Any], step: int) -> float | None:
    """Mean loss of the ``RESUME_WINDOW`` steps after ``step`` less that of the ones up to it."""
    before = [losses.get(s) for s in range(step - RESUME_WINDOW + 1, step + 1)]
    after = [losses.get(s) for s in range(step + 1, step + RESUME_WINDOW + 1)]
    before, after = [x for x in before if finite(x)], [x for x in after if finite(x)]
    return sum(after) / len(after) - sum(before) / len(before) if before and after else None


# --------------------------------------------------------------------------------------
# The layer to look at first
# --------------------------------------------------------------------------------------


def worst_layer(run: RunRecords) -> dict[str, Any] | None:
    """The FP8 module with the largest mean sampled GEMM error over the last quarter of the
    run (``fp8ops.compare.layers``), its saturation and underflow there, and its alerts."""
    if run.telemetry is None:
        return None
    sampled = [layer for layer in run.telemetry.layers if layer.fp8 and layer.fp8_error is not None]
    if not sampled:
        return None
    worst = max(sampled, key=lambda layer: layer.fp8_error)
    return {
        "module": worst.module,
        "fp8_error": worst.fp8_error,
        "fp8_error_max": worst.fp8_error_max,
        "error_samples": worst.error_samples,
        "error_steps": list(run.telemetry.error_window),
        "steps": list(run.telemetry.window),
        "saturation": dict(worst.saturation),
        "underflow": dict(worst.underflow),
        "alerts": [alert_json(a) for a in run.alerts if a.module == worst.module],
    }


def alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "step": alert.step,
        "level": alert.level,
        "rule": alert.rule,
        "metric": alert.metric,
        "value": alert.value,
        "message": alert.message,
    }


def describe_layer(layer: dict[str, Any]) -> str:
    """``worst layer M: fp8 error 0.21, weight underflow 0.63`` (the largest saturation and
    underflow slots, when not zero, and how many alerts the module raised)."""
    parts = [f"fp8 error {layer['fp8_error']:.2g}"]
    for kind in ("underflow", "saturation"):
        known = {slot: v for slot, v in layer[kind].items() if v}
        if known:
            slot = max(known, key=known.get)
            parts.append(f"{slot} {kind} {known[slot]:.2g}")
    if layer["alerts"]:
        levels = sorted({a["level"] for a in layer["alerts"]})
        parts.append(f"{len(layer['alerts'])} alerts ({', '.join(levels)})")
    return f"worst layer {layer['module']}: {', '.join(parts)}"


def _steps(steps) -> str:
    """``step 7``, ``steps 7, 9, 12``, ``steps 7, 9, 12, ... (40 in all)``."""
    steps = sorted(steps)
    if not steps:
        return "no steps"
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = ", ".join(str(s) for s in steps[:3])
    return f"steps {shown}" + (f", ... ({len(steps)} in all)" if len(steps) > 3 else "")
