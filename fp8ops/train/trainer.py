"""The training loop: :class:`Trainer` builds a run's parts in ``__init__`` (in the order they
depend on each other) and ``train`` is the loop, in execution order. The command around it
(load the manifest, check, start ranks, resume or start) is ``launch.py``.

Delayed scaling as Megatron uses it: one FP8 scope per micro-batch forward (input and gradient
histories advance per micro-batch), the weight cast once per optimizer step
(``mark_first_microbatch``: weight histories advance per step), amaxes reduced over the
manifest's amax reduction group. The scope is fp8ops' ``Fp8Scope``, or on the TE backend TE's own
autocast, which Megatron's ``TransformerBlock`` enters; either way the run reads the FP8 state
through ``fp8_state_modules``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.manifest import manifest_hash
from fp8ops.manifest.schema import Manifest
from fp8ops.telemetry.catalogue import STEP_METRIC_NAMES
from fp8ops.train import weights
from fp8ops.train.cpu_gemm import Fp32Gemm, check_compiled_casts, cpu_bf16_gemm
from fp8ops.train.distributed import Ranks
from fp8ops.train.environment import environment_fingerprint
from fp8ops.train.optimizer import MainParamsOptimizer, learning_rate
from fp8ops.train.run_dir import RunDir
from fp8ops.train.signals import REQUEST_FILE


class StopRun(Fp8opsError):
    """A Stop alert: the run saved a checkpoint and its telemetry and ended (exit code 3)."""

    exit_code = 3
    collective = True  # every rank raises it; rank 0 says so

    def __init__(self, message: str, alerts: list[dict]):
        super().__init__(f"stopped by an alert: {message}")
        self.alerts = alerts


@dataclass(frozen=True)
class TrainResult:
    """What a run (or a segment of it, between resumes) reports to the command line."""

    run_dir: Path
    steps: int  # the step the run stands at
    first_loss: float
    last_loss: float
    last_eval_loss: float | None
    seconds: float
    first_step: int = 1  # of this segment
    paused: bool = False  # --stop-at or a stop request: checkpointed and left to resume
    interrupted_by: str | None = None  # the stop request (signal, request file) that ended it
    resume_summary: list[str] | None = None
    capability_accuracy: float | None = None  # the segment's last capability evaluation


def _run_record(run_dir: Path) -> dict:
    """``run.json``, or {} when it cannot be read (the run's files say so elsewhere)."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _check_same_tokenizer(tokenizer, config, run_dir: Path, plan) -> None:
    """A resume encodes and decodes with the tokenizer the run started with. Its manifest
    section is locked, but the file it names can be edited: compared here, before the data is
    built with it, so the refusal names the tokenizer and not what it changed downstream."""
    from fp8ops.checkpoint.drift import DriftRefused

    recorded = (_run_record(run_dir).get("tokenizer") or {}).get("fingerprint")
    now = tokenizer.fingerprint()
    if recorded is None or recorded == now:
        return
    what = (
        f"tokenizer.path {config.path} (its bytes or the end-of-document token "
        f"{tokenizer.eod_token!r})"
        if tokenizer.kind != "byte"
        else "fp8ops' byte tokenizer (another fp8ops version)"
    )
    raise DriftRefused(
        f"refusing to resume from {plan.checkpoint}: {what} changed since the run started "
        f"(run.json records tokenizer fingerprint {recorded[:12]}, it now hashes to {now[:12]}); "
        "the data and the capability answers would be encoded and decoded otherwise than the "
        "checkpoint was trained on. Restore the tokenizer the run started with, or train with "
        f"the new one in a new run (another --run-dir){_from_these_weights(plan)}"
    )


def _check_same_data(data, run_dir: Path, plan) -> None:
    """A resume reads the data the run started on: the sampler's position means nothing in
    other data. ``data.fingerprint: null`` checks nothing when a run starts, so the data are
    checked here against what the run recorded in ``run.json``."""
    from fp8ops.checkpoint.drift import DriftRefused

    recorded = _run_record(run_dir).get("data") or {}
    if recorded.get("fingerprint") in (None, data.fingerprint):
        return
    # What the record says the data came from, against now: the file's sha256, the corpus.
    before, after = recorded.get("source") or {}, data.source
    changed = [
        f"{key} {str(before.get(key))[:12]} -> {str(after.get(key))[:12]}"
        for key in sorted(before.keys() | after.keys())
        if key != "path" and before.get(key) != after.get(key)
    ]
    origin = f"data.path {after['path']}" if "path" in after else f"data.kind {data.kind}"
    hashes = (
        f"run.json records data fingerprint {recorded['fingerprint'][:12]}, the data now "
        f"hash to {data.fingerprint[:12]}"
    )
    raise DriftRefused(
        f"refusing to resume from {plan.checkpoint}: the training data changed since the run "
        f"started ({origin}: {'; '.join([*changed, hashes])}), and the sampler's position means "
        "nothing in other data. Restore the data the run started on, or train on the new data "
        f"in a new run (another --run-dir){_from_these_weights(plan)}"
    )


def _from_these_weights(plan) -> str:
    return (
        f", from this checkpoint's weights if you want them: fp8ops checkpoints export "
        f"{plan.run_dir} --checkpoint {plan.step} --out DIR, then model.init_checkpoint: "
        "DIR"
    )


class Trainer:
    """One run: the model, its data, optimizer and FP8 scope, and the run directory."""

    def __init__(
        self,
        manifest: Manifest,
        lineage: list[Manifest] | None,
        run_dir: Path,
        ranks: Ranks,
        *,
        progress: bool = True,
        resume=None,
        stop_request=None,
    ):
        """``lineage``: the manifest's revisions, root first, for a new run; ``resume``: a
        :class:`~fp8ops.checkpoint.ResumePlan` to continue a run from instead; ``stop_request``:
        a :class:`~fp8ops.train.signals.StopRequest` polled at every step boundary."""
        # Imported here: Megatron takes seconds to import, and `fp8ops --help` should not.
        from fp8ops.admission import apply_admission, decide_admission, write_layers_json
        from fp8ops.alerts import AlertEngine
        from fp8ops.checkpoint.resume import check_not_moved_on
        from fp8ops.checkpoint.state import Fp8Layout
        from fp8ops.data import TrainSampler, build_data, tokenizer_for
        from fp8ops.evaluate.capability import capability_examples
        from fp8ops.megatron import amax_reduction_group, build_gpt, fp8_state_modules
        from fp8ops.megatron.compat import parallel_state
        from fp8ops.precision import DelayedScalingRecipe, Fp8Scope
        from fp8ops.telemetry.collector import TelemetryCollector

        self.manifest, self.ranks, self.resume = manifest, ranks, resume
        self.device = ranks.device  # the model, its FP8 state and each micro-batch live there
        # "float32" for a bf16 model on a CPU without bf16 GEMMs (cpu_gemm.py); None: no bf16.
        bf16 = manifest.precision.base_dtype == "bf16"
        self.cpu_bf16_gemm = cpu_bf16_gemm(self.device) if bf16 else None
        if manifest.precision.enabled and manifest.precision.backend != "te":
            check_compiled_casts(self.device, self.cpu_bf16_gemm)
        self.stop_request = stop_request
        self.start_step = resume.step if resume is not None else 0
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.progress = progress and ranks.is_main

        # Everything that can refuse the manifest runs before the run directory is claimed,
        # so a refused run leaves nothing behind.
        # Built once: the data and every capability evaluation encode with this one, so an edit
        # of a tokenizer.json mid-run changes nothing.
        self.tokenizer = tokenizer_for(manifest.tokenizer)
        if resume is not None:
            _check_same_tokenizer(self.tokenizer, manifest.tokenizer, Path(run_dir), resume)
        self.data = build_data(manifest, self.tokenizer)
        if resume is not None:
            _check_same_data(self.data, Path(run_dir), resume)
        self.capability_examples = capability_examples(
            self.data, manifest.capability, self.tokenizer
        )
        asked, held = manifest.capability.items, len(self.capability_examples)
        if ranks.is_main and held and asked is not None and asked > held:  # said, not silent
            print(
                f"warning: capability.items is {asked}, but the eval split holds {held} items; "
                "all of them are evaluated",
                file=sys.stderr,
            )
        self.capability_accuracy: float | None = None
        schedule = manifest.schedule
        self.sampler = TrainSampler(
            self.data.train,
            seed=manifest.seeds.data,
            global_batch_size=schedule.global_batch_size,
            micro_batch_size=schedule.micro_batch_size,
            dp_rank=ranks.dp_rank,
            dp_size=manifest.topology.data_parallel,
        )

        precision = manifest.precision
        self.recipe = DelayedScalingRecipe.from_precision(precision)
        self.model = build_gpt(
            manifest, self.recipe if precision.enabled else None, device=self.device
        )
        # Before the base loads: it also refuses FP8 modules precision.backend cannot take.
        self.admission = decide_admission(
            self.model, precision, tensor_parallel=manifest.topology.tensor_parallel
        )
        self.model_dtype = next(self.model.parameters()).dtype
        self.base = self._load_base() if resume is None else None  # resume: weights come later
        apply_admission(self.admission, self.model)
        self.collector = TelemetryCollector(
            fp8_state_modules(self.model, self.recipe), manifest.telemetry
        )
        self.alert_engine = AlertEngine(
            manifest.alerts,
            self.collector.names,
            [module.fp8_enabled for module in self.collector.modules.values()],
            amax_compute_algo=precision.amax_compute_algo,
        )
        self.amax_group = amax_reduction_group(manifest.topology)
        # On TE, Megatron's TransformerBlock enters TE's own delayed-scaling autocast, which
        # reduces and updates; fp8ops' scope is for fp8ops' own FP8 layers.
        own_scope = precision.enabled and precision.backend != "te"
        self.scope = Fp8Scope(self.recipe, group=self.amax_group) if own_scope else None
        self.optimizer = MainParamsOptimizer(
            self.model, manifest.optimizer, tp_group=self.tp_group, dp_group=self.dp_group
        )
        self.fp8_layout = Fp8Layout.for_run(
            fp8=precision.enabled and bool(self.collector.names),
            reduce_amax=precision.reduce_amax,
            topology=manifest.topology,
            ranks=ranks,
        )
        if resume is not None:
            self._check_admission(resume)
            self._load_checkpoint(resume)  # loaded and verified before anything is written
            check_not_moved_on(resume)  # loading took a while: nobody trained the run meanwhile

        dist.barrier()  # every rank has passed every check
        if not ranks.is_main:
            self.run = RunDir(run_dir)
        elif resume is None:
            self.run = RunDir.claim(run_dir, manifest, lineage)
        else:
            self.run = RunDir.reopen(
                run_dir,
                manifest,
                resume.new_revisions,
                step=resume.step,
                checkpoint=resume.checkpoint.name,
            )
        try:
            if ranks.is_main:
                from fp8ops.overrides import Ledger

                self.ledger = Ledger(self.run.path)
                write_layers_json(
                    self.run.path,
                    self.admission,
                    self.recipe,
                    tensor_parallel=manifest.topology.tensor_parallel,
                    manifest_hash=manifest_hash(manifest),
                )
            if resume is None:
                self._record_run_info(self.amax_group)
            else:
                self._record_resume(resume)
            if ranks.is_main:
                self._write_fallbacks()
            self.telemetry = self._open_telemetry()
        except BaseException as exc:
            self._mark_failed(exc)
            self.run.release()
            raise

    # -- the loop ------------------------------------------------------------------------------

    def train(self, stop_at: int | None = None) -> TrainResult:
        """Train from :attr:`start_step` to the end (or to ``stop_at``: checkpoint, then stop)."""
        schedule = self.manifest.schedule
        started = time.perf_counter()
        losses: list[float] = []
        last_eval = None
        self._event("train_started", steps=schedule.train_steps, from_step=self.start_step)
        try:
            with self._progress_bar() as advance:
                for step in range(self.start_step, schedule.train_steps):
                    record = self.train_step(step)
                    losses.append(record["loss"])
                    self._log_step(record, advance)
                    self.observe(record)  # telemetry and alerts; raises StopRun
                    finished = step + 1
                    if finished % schedule.eval_interval == 0 or finished == schedule.train_steps:
                        last_eval = self.evaluate(finished)
                        self.check_fp8_agreement(finished)
                    if self._capability_due(finished):
                        self.evaluate_capability(finished)
                    if finished == schedule.train_steps:
                        break
                    if finished == stop_at:
                        return self._pause(finished, losses, last_eval, started, "stop-at")
                    if self.stop_request is not None and self.stop_request.agreed(self.run.path):
                        return self._pause(
                            finished, losses, last_eval, started, self.stop_request.reason
                        )
                    if finished % schedule.checkpoint_interval == 0:
                        self.save_checkpoint(finished, "periodic")
            if self.telemetry is not None:  # the last steps reach the disk before "completed"
                self.telemetry.close()
            final = self.save_checkpoint(schedule.train_steps, "final")
            self._save_final_weights(final, losses[-1])
        except StopRun as stop:
            try:
                self._stop(stop)
            except BaseException as exc:  # the Stop path itself failed: say so, not "running"
                self._mark_failed(exc)
                raise
            raise
        except BaseException as exc:
            self._close_telemetry_after(exc)  # keep what was measured up to the failure
            self._mark_failed(exc)
            raise
        seconds = self._completed(started)
        return TrainResult(
            self.run.path,
            schedule.train_steps,
            losses[0],
            losses[-1],
            last_eval,
            seconds,
            first_step=self.start_step + 1,
            resume_summary=self._resume_summary(),
            capability_accuracy=self.capability_accuracy,
        )

    def finish(self) -> TrainResult:
        """Complete a run whose checkpoint is at its last step but which never wrote its final
        weights (``final/``) or its completed status:

        * the process ended after the final checkpoint (a kill or a preemption while ``final/``
          is written, minutes on a large model): nothing is left but the weights;
        * a Stop alert fired at the last step (its checkpoint's reason is ``alert-stop``): the
          last step's evaluations never ran, so they run first, under the resumed manifest
          (with any override approved since).

        The weights are the checkpoint's, which the constructor loaded: nothing is trained."""
        steps, checkpoint = self.manifest.schedule.train_steps, self.resume.checkpoint
        started = time.perf_counter()
        self._event("finishing", checkpoint=checkpoint.name)
        last_loss, last_eval = self._logged_loss(steps), None
        try:
            if self.resume.meta.reason != "final":  # stopped before the last step's evaluations
                last_eval = self.evaluate(steps)
                self.check_fp8_agreement(steps)
                if self._capability_due(steps):
                    self.evaluate_capability(steps)
            if self.telemetry is not None:
                self.telemetry.close()
            self._save_final_weights(checkpoint, last_loss)
        except BaseException as exc:
            self._close_telemetry_after(exc)
            self._mark_failed(exc)
            raise
        seconds = self._completed(started)
        return TrainResult(
            self.run.path,
            steps,
            last_loss,
            last_loss,
            last_eval,
            seconds,
            first_step=steps + 1,
            resume_summary=self._resume_summary(),
            capability_accuracy=self.capability_accuracy,
        )

    def _completed(self, started: float) -> float:
        """Mark the run completed (final weights written); the seconds since ``started``."""
        seconds = time.perf_counter() - started
        if self.ranks.is_main:
            self.run.set_status("completed", step=self.manifest.schedule.train_steps)
            self.run.event("train_completed", seconds=round(seconds, 3))
        return seconds

    def _logged_loss(self, step: int) -> float:
        """The loss metrics.jsonl holds for ``step`` (NaN if it holds none: the line was lost)."""
        from fp8ops.train.run_dir import read_metrics

        logged = {r["step"]: r["loss"] for r in read_metrics(self.run.path)}
        return logged.get(step, float("nan"))

    def _pause(
        self, step: int, losses: list[float], last_eval, started: float, why: str
    ) -> TrainResult:
        """Stop at a step boundary with a checkpoint, ready for ``fp8ops resume``: ``--stop-at``
        (status paused) or a stop request (status interrupted: requeue)."""
        requested = why != "stop-at"
        path = self.save_checkpoint(step, f"requested: {why}" if requested else why)
        if self.telemetry is not None:
            self.telemetry.close()
        if self.ranks.is_main:
            state = "interrupted" if requested else "paused"
            self.run.set_status(state, step=step, checkpoint=path.name, reason=why)
            self.run.event(state, step=step, checkpoint=path.name, reason=why)
            (self.run.path / REQUEST_FILE).unlink(missing_ok=True)  # answered
        seconds = time.perf_counter() - started
        return TrainResult(
            self.run.path,
            step,
            losses[0],
            losses[-1],
            last_eval,
            seconds,
            first_step=self.start_step + 1,
            paused=True,
            resume_summary=self._resume_summary(),
            interrupted_by=why if requested else None,
            capability_accuracy=self.capability_accuracy,
        )

    def train_step(self, step: int) -> dict:
        """One optimizer step over the global batch; returns its metrics record."""
        started = time.perf_counter()
        micro_batches = self.sampler.next_step()
        lr = learning_rate(step, self.manifest.optimizer, self.manifest.schedule)
        # The loss is a mean over every loss-bearing token of the global batch, so micro-batches
        # and data-parallel ranks with more answer tokens weigh more (as one big batch would).
        # Counted on the host batches: a CPU float64 scalar, which divides a loss on any device.
        loss_tokens = self._dp_sum(sum(mb.loss_mask.sum() for mb in micro_batches))
        from fp8ops.megatron import mark_first_microbatch

        mark_first_microbatch(self.model)
        self.collector.begin_step(step + 1)
        # Accumulated where the losses are (no host sync per micro-batch); summed over DP on the
        # host by _dp_sum.
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        with self._gemms():
            for mb in micro_batches:
                mb = mb.to(self.device)
                with self._fp8():
                    per_token = self.model(mb.tokens, mb.position_ids, None, labels=mb.labels)
                loss = (per_token.float() * mb.loss_mask).sum() / loss_tokens
                loss.backward()
                step_loss += loss.detach().double()
        step_loss = self._dp_sum(step_loss)
        # Read before the optimizer step: it zeroes the gradients the row reports. The row's
        # copies to the host run on; the loss below syncs anyway, so observe() does not wait.
        self._telemetry_row = self.collector.end_step()
        grad_norm, skipped = self.optimizer.step(lr)
        seconds = time.perf_counter() - started
        tokens = self._dp_sum(torch.tensor(float(sum(mb.tokens.numel() for mb in micro_batches))))
        return {
            "step": step + 1,
            "loss": step_loss.item(),
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,  # JSON has no NaN
            "update_norm": self.optimizer.last_update_norm,
            "lr": lr,
            "skipped": skipped,
            "tokens": int(tokens.item()),
            "loss_tokens": int(loss_tokens.item()),
            "seconds": seconds,
            "tokens_per_s": tokens.item() / seconds,
            "peak_memory_mib": _peak_memory_mib(),
        }

    def evaluate(self, step: int) -> float | None:
        """Mean loss over the held-out set, overall and per bucket; FP8 state left as it was
        (:meth:`_held_out`). None when there is no held-out set (``data.eval_fraction: 0``)."""
        if len(self.data.eval) == 0:
            return None
        with self._held_out():
            return self._evaluate(step)

    def _evaluate(self, step: int) -> float:
        totals: dict[str, list[float]] = {}
        loss_sum, token_sum = 0.0, 0.0
        schedule = self.manifest.schedule
        batches = self.data.eval_batches(schedule.micro_batch_size)
        for mb in itertools.islice(batches, schedule.eval_iters):  # None: all of them
            mb = mb.to(self.device)
            with self._fp8():
                per_token = self.model(mb.tokens, mb.position_ids, None, labels=mb.labels)
            # On the host once, not one device sync per sequence below (free on the CPU).
            per_sequence = (per_token.float() * mb.loss_mask).sum(dim=1).cpu()
            tokens = mb.loss_mask.sum(dim=1).cpu()
            loss_sum += per_sequence.sum().item()
            token_sum += tokens.sum().item()
            for index, seq_loss, seq_tokens in zip(mb.indices.tolist(), per_sequence, tokens):
                buckets = self.data.eval.buckets[index] if self.data.eval.examples else {}
                for name, value in buckets.items():
                    entry = totals.setdefault(f"{name}={value}", [0.0, 0.0])
                    entry[0] += seq_loss.item()
                    entry[1] += seq_tokens.item()
        loss = loss_sum / max(token_sum, 1.0)
        record = {
            "step": step,
            "loss": loss,
            "tokens": int(token_sum),
            "buckets": {name: s / max(t, 1.0) for name, (s, t) in sorted(totals.items())},
        }
        if self.ranks.is_main:
            self.run.append("eval.jsonl", record)
            self.run.event("evaluated", step=step, loss=loss)
        return loss

    def _capability_due(self, step: int) -> bool:
        interval = self.manifest.capability.interval
        at_interval = interval is not None and step % interval == 0
        return bool(self.capability_examples) and (
            at_interval or step == self.manifest.schedule.train_steps
        )

    def evaluate_capability(self, step: int) -> float | None:
        """Greedy answers to the held-out items, exact match overall and per bucket
        (``fp8ops.evaluate``); rank 0 writes ``capability.jsonl`` and the step's predictions.
        Every rank runs it (collective at TP>1), held out of training as :meth:`evaluate` is.

        A failing evaluation is recorded (event ``capability_failed``) and training goes on:
        hours of training are worth more than one measurement, and ``fp8ops compare`` fails a
        run whose capability records are missing.
        """
        from fp8ops.evaluate.capability import evaluate_capability
        from fp8ops.evaluate.records import score, write_capability

        started = time.perf_counter()
        try:
            with self._held_out():
                predictions = evaluate_capability(
                    self.model,
                    self.capability_examples,
                    self.manifest,
                    self.tokenizer,
                    fp8=self._fp8,
                )
        except Exception as exc:  # noqa: BLE001 - any failure of the measurement, not of training
            if self.ranks.is_main:
                print(f"capability evaluation at step {step} failed: {exc}", file=sys.stderr)
                self.run.event("capability_failed", step=step, error=f"{type(exc).__name__}: {exc}")
            return None
        seconds = time.perf_counter() - started
        self.capability_accuracy = score(predictions)["accuracy"]
        if self.ranks.is_main:
            write_capability(self.run.path, step, predictions, seconds)
            self.run.event(
                "capability_evaluated",
                step=step,
                accuracy=self.capability_accuracy,
                seconds=round(seconds, 3),
            )
        return self.capability_accuracy

    @contextlib.contextmanager
    def _held_out(self):
        """Run evaluation forwards without changing the training run.

        They run in FP8 with the training scales, but their amaxes are discarded: TE would fold
        them into the next training update, so evaluating more or less often would change the
        training run. Telemetry is paused, so the evaluation's GEMMs and casts do not show up in
        the next step's row.
        """
        from fp8ops.megatron import mark_first_microbatch

        saved = self._fp8_state()
        try:
            with torch.no_grad(), self.collector.paused(), self._gemms():
                self.model.eval()
                mark_first_microbatch(self.model)  # cast the current weights once, reuse them
                yield
        finally:  # also when the evaluation fails: training must go on unchanged
            self.model.train()
            self._restore_fp8_state(saved)

    def observe(self, record: dict) -> None:
        """After :meth:`train_step`: hand the step's telemetry row to the store and the alert rules.

        Every rank evaluates its own row (saturation and norms are per shard); the alerts of all
        ranks are gathered to rank 0, which writes them, so a NaN on one shard is not missed and
        every rank stops at the same step.
        """
        step = record["step"]
        step_values = {
            "loss": record["loss"],
            "grad_norm": math.nan if record["grad_norm"] is None else record["grad_norm"],
            "lr": record["lr"],
            "skipped": float(record["skipped"]),
            "tokens_per_s": record["tokens_per_s"],
            "step_seconds": record["seconds"],
        }
        row = self._telemetry_row.result()
        if self.telemetry is not None:
            scalars = np.array([step_values[m] for m in STEP_METRIC_NAMES], dtype=np.float32)
            self.telemetry.append(step, row, scalars)
        if self.collector.active:  # an unobserved step (a benchmark's) has nothing to judge
            self._raise_alerts(step, self.alert_engine.observe(step, row, step_values))

    def _raise_alerts(self, step: int, alerts: list) -> None:
        """Gather every rank's alerts to rank 0 (only when some rank has any), record them and
        their proposals, and stop all ranks together on a Stop alert."""
        from fp8ops.alerts import Alert, write_alerts
        from fp8ops.alerts.records import merge_rank_alerts

        flag = torch.tensor(float(len(alerts) > 0))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [a.to_json() for a in alerts])
        everyone = merge_rank_alerts(gathered)
        if self.ranks.is_main:
            write_alerts(self.run.path, everyone)
            # Degrade proposes a BF16 override into the ledger, where an operator reviews it.
            for proposal in self.alert_engine.proposals(everyone):
                triggers = [
                    Alert.from_json(a)
                    for a in everyone
                    if a.get("module") == proposal.module
                    and a["step"] == proposal.step
                    and a.get("metric") is not None
                ]
                try:
                    self.ledger.propose(proposal.module, proposal.reason, triggers, proposal.step)
                except Fp8opsError as exc:  # an operator's damaged ledger must not end training
                    self.run.event(
                        "proposal_not_recorded",
                        module=proposal.module,
                        step=proposal.step,
                        error=str(exc),
                    )
        stops = [a for a in everyone if a["level"] == "stop"]
        if stops:
            raise StopRun(stops[0]["message"], stops)

    def _open_telemetry(self):
        """The store, or None for a run without FP8-capable modules (FP8 off: the per-step
        metrics are in metrics.jsonl, and there is no per-module FP8 state to record)."""
        from fp8ops.telemetry import TelemetryWriter
        from fp8ops.telemetry.store import TelemetryError, rank_group

        if not self.collector.names:
            return None
        path = self.run.path / "telemetry.zarr"
        if self.resume is not None and path.exists():
            dist.barrier()  # rank 0 may have rewritten nothing yet; all ranks see one store
            try:
                if (path / rank_group(self.ranks.rank)).exists():
                    return TelemetryWriter.resume(
                        path, rank=self.ranks.rank, next_step=self.start_step + 1
                    )
                return TelemetryWriter.join(
                    path,
                    rank=self.ranks.rank,
                    next_step=self.start_step + 1,
                    flush_every=self.manifest.telemetry.flush_steps,
                )
            except TelemetryError as exc:
                raise TelemetryError(
                    f"{exc}. The checkpoint is not affected: to resume without the damaged "
                    f"store, move it aside (mv {path} {path}.damaged); a new one then records "
                    f"from step {self.start_step + 1}"
                ) from None
        if self.resume is not None and self.resume.meta.telemetry_committed and self.ranks.is_main:
            # The run had a store and it is gone: say so, rather than start a new one quietly.
            message = (
                f"{path} is missing, though the checkpoint's run had committed telemetry "
                f"up to step {self.resume.meta.telemetry_committed}; a new store records "
                f"from step {self.start_step + 1}"
            )
            print(f"warning: {message}", file=sys.stderr)
            self.run.event("telemetry_restarted", message=message)
        return TelemetryWriter(
            path,
            rank=self.ranks.rank,
            first_step=self.start_step + 1,
            modules=self.collector.names,
            flush_every=self.manifest.telemetry.flush_steps,
            attrs={"manifest": manifest_hash(self.manifest), "world_size": self.ranks.world_size},
        )

    def _close_telemetry_after(self, failure: BaseException) -> None:
        """Flush telemetry on a failure path; a writer error then is recorded, not raised, so
        the failure that stopped the run stays the one reported."""
        try:
            if self.telemetry is not None:
                self.telemetry.close()
        except Exception as exc:  # noqa: BLE001 - secondary to `failure`
            if self.ranks.is_main:
                self.run.event("telemetry_lost", error=str(exc), during=type(failure).__name__)

    def _stop(self, stop: StopRun) -> None:
        """The Stop path: telemetry flushed, a checkpoint of the step that raised the alert
        (resumable, e.g. with an approved override), the run marked stopped."""
        first = stop.alerts[0]
        path = self.save_checkpoint(first["step"], f"alert-stop: {first['rule']}")
        self._close_telemetry_after(stop)
        if self.ranks.is_main:
            self.run.set_status("stopped", step=first["step"], alert=first, checkpoint=path.name)
            self.run.event("stopped", alert=first, checkpoint=path.name)

    # -- checkpoints and resume ------------------------------------------------------------------

    def save_checkpoint(self, step: int, reason: str) -> Path:
        """A training checkpoint of the state after ``step`` (collective)."""
        from fp8ops.checkpoint.meta import TopologyRecord
        from fp8ops.checkpoint.training import save_checkpoint

        committed = None
        if self.telemetry is not None and not self.telemetry.closed:
            self.telemetry.flush()  # the store is committed up to the checkpoint's step
            committed = self.telemetry.next_step - 1
        topology = self.manifest.topology
        path, seconds = save_checkpoint(
            self._parts(),
            self.run.path,
            step=step,
            reason=reason,
            manifest=self.manifest,
            revisions=self._revision_hashes(),
            environment=environment_fingerprint(),
            topology=TopologyRecord(
                tensor_parallel=topology.tensor_parallel,
                pipeline_parallel=topology.pipeline_parallel,
                data_parallel=topology.data_parallel,
                world_size=self.ranks.world_size,
                amax_reduction=topology.amax_reduction,
                reduce_amax=self.manifest.precision.reduce_amax,
            ),
            admission=self._admission_hash(),
            sampler=self.sampler.state_dict(),
            telemetry_committed=committed,
            keep=self.manifest.schedule.keep_checkpoints,
        )
        self._event(
            "checkpoint_saved", step=step, path=path.name, reason=reason, seconds=round(seconds, 3)
        )
        return path

    def _parts(self):
        from fp8ops.checkpoint.training import TrainingParts

        return TrainingParts(
            model=self.model,
            optimizer=self.optimizer,
            fp8_modules=self.collector.modules,
            alert_engine=self.alert_engine,
            layout=self.fp8_layout,
            ranks=self.ranks,
            tp_group=self.tp_group,
        )

    def _load_checkpoint(self, plan) -> None:
        """Load the plan's checkpoint into the model, optimizer, FP8 state, data position and
        alert windows, and verify it (collective). Nothing on disk changes here."""
        from fp8ops.checkpoint.training import load_checkpoint

        self._load_seconds = load_checkpoint(
            self._parts(),
            plan.checkpoint,
            plan.meta,
            fp8_read=plan.fp8_read,
            # Windows of another shape (another alert configuration) start empty instead.
            alert_windows=plan.saved_manifest.alerts == self.manifest.alerts,
        )
        self.sampler.load_state_dict(plan.meta.sampler)
        self._carried_scales = self._carry_scales(plan)
        self.collector.seed_previous_scales()  # the next row's scale_change continues

    def _carry_scales(self, plan) -> dict[str, float]:
        """An accepted change of ``fp8_format`` or ``margin`` applies from the first step: the
        loaded scales were computed for the old FP8 maximum and margin, and would saturate (or
        waste range) until the first update. Scaled by the exact factor instead
        (``ScalingState.carry_scales``); the histories, raw amaxes, stay as saved."""
        from fp8ops.precision import DelayedScalingRecipe
        from fp8ops.precision.state import carry_scales

        saved = plan.saved_manifest.precision
        if not (saved.enabled and self.manifest.precision.enabled):
            return {}
        metas = [module.fp8_meta for module in self.collector.modules.values()]
        return carry_scales(metas, DelayedScalingRecipe.from_precision(saved), self.recipe)

    def _record_resume(self, plan) -> None:
        """After the load: the ledger's applied records, ``latest`` moved back if the resume
        left later checkpoints behind, and the ``resumed`` event (rank 0)."""
        from fp8ops.checkpoint import CheckpointDir
        from fp8ops.train.signals import REQUEST_FILE

        if not self.ranks.is_main:
            return
        digest = manifest_hash(self.manifest)
        # Only first applications and first lifts are new to the ledger; re-applying after a
        # resume from an older checkpoint is in the event below.
        news = [o.id for o in plan.applied_overrides if o.status == "approved"]
        news += [o.id for o in plan.lifted_overrides if o.to_lift]
        if news:
            self.ledger.record_applied(news, step=plan.step + 1, revision=digest)
        superseded = CheckpointDir(self.run.path).rewind(plan.checkpoint)
        if self.stop_request is not None and self.stop_request.stale_file(self.run.path):
            (self.run.path / REQUEST_FILE).unlink()  # a request the last attempt never saw
        self.run.event(
            "resumed",
            step=plan.step,
            checkpoint=plan.checkpoint.name,
            manifest=digest,
            new_revisions=[manifest_hash(m) for m in plan.new_revisions],
            drift=plan.drift.to_json(),
            accepted=plan.accepted_reason,
            after_stop=plan.after_stop,
            cpu_bf16_gemm=self.cpu_bf16_gemm,
            overrides_applied=[o.module for o in plan.applied_overrides],
            overrides_lifted=[o.module for o in plan.lifted_overrides],
            superseded=[p.name for p in superseded],
            fp8_state=plan.fp8_read,
            scales_carried=self._carried_scales,
            environment=environment_fingerprint(),
            command=sys.argv,
            load_seconds=round(self._load_seconds, 3),
        )

    def _write_fallbacks(self) -> None:
        """``fallbacks.json``: module -> dtype, reason, the step it took effect, revision. An
        entry keeps its first step across resumes; a lifted one is gone."""
        path = self.run.path / "fallbacks.json"
        if not self.manifest.precision.overrides and not path.exists():
            return
        before = json.loads(path.read_text()) if path.exists() else {}
        table = {}
        for override in self.manifest.precision.overrides:
            earlier = before.get(override.module)
            if earlier is not None and earlier.get("approval") == override.approval:
                table[override.module] = earlier
                continue
            table[override.module] = {
                "dtype": override.dtype,
                "reason": override.reason,
                "approval": override.approval,
                "from_step": self.start_step + 1,
                "revision": manifest_hash(self.manifest),
            }
        self.run.write_json("fallbacks.json", table)

    def _check_admission(self, plan) -> None:
        """The per-layer decisions must be the checkpoint's unless the manifest changed."""
        from fp8ops.checkpoint.drift import Change, Drift, refuse

        found = self._admission_hash()
        if found == plan.meta.admission or plan.new_revisions:
            return
        change = Change("admission", "layers.json table", plan.meta.admission, found)
        if plan.accept_drift is not None:
            plan.drift.changes.append(change)  # recorded in the resumed event
            plan.accepted_reason = plan.accept_drift
            return
        raise refuse(
            Drift([change]),
            str(plan.checkpoint),
            "The manifest is unchanged, so the admission rules themselves changed (another "
            "fp8ops version?); compare with `fp8ops inspect RUN_DIR --layers`, then accept the "
            'change with --accept-drift "reason"',
        )

    def _admission_hash(self) -> str | None:
        from fp8ops.admission import RecipeRecord, table_hash

        if not self.collector.names:
            return None
        return table_hash(self.admission.rows, RecipeRecord.from_recipe(self.recipe))

    def _revision_hashes(self) -> list[str]:
        """The manifest's revision chain, root first, as far as the run knows it (a manifest
        file that is itself a revision names a parent the run may not hold)."""
        from fp8ops.manifest import ManifestStore

        if not self.ranks.is_main:
            return []
        store = ManifestStore(self.run.path / "manifests")
        current, chain = self.manifest, [manifest_hash(self.manifest)]
        while current.revision.parent is not None:
            chain.append(current.revision.parent)
            if not store.path_for(current.revision.parent).exists():
                break
            current = store.get(current.revision.parent)
        return chain[::-1]

    def _resume_summary(self) -> list[str] | None:
        """What the resume changed, and tokens/s over (up to) 20 steps before and after it."""
        plan = self.resume
        if plan is None or not self.ranks.is_main:
            return None
        from fp8ops.train.run_dir import read_metrics

        lines = [f"resumed from {plan.checkpoint.name} (step {plan.step})"]
        if plan.accepted_reason:
            lines.append(f"accepted drift: {plan.drift.summary()} ({plan.accepted_reason})")
        lines += [f"fallback: {o.module} -> bf16 ({o.reason})" for o in plan.applied_overrides]
        lines += [f"lifted: {o.module} -> fp8" for o in plan.lifted_overrides]
        lines += [
            f"{direction} scales carried to the new recipe: x{factor:g}"
            for direction, factor in self._carried_scales.items()
        ]
        metrics = read_metrics(self.run.path)
        before = [m["tokens_per_s"] for m in metrics if plan.step - 20 < m["step"] <= plan.step]
        after = [m["tokens_per_s"] for m in metrics if plan.step < m["step"] <= plan.step + 20]
        if before and after:
            b, a = float(np.median(before)), float(np.median(after))
            # Each process's first steps warm up: a median of a handful of steps is mostly them.
            change = f" ({a / b - 1:+.1%})" if min(len(before), len(after)) >= 5 else ""
            lines.append(
                f"tokens/s: median {b:,.0f} over the {len(before)} steps before, "
                f"{a:,.0f} over the {len(after)} after{change}"
            )
        return lines

    def check_fp8_agreement(self, step: int) -> str | None:
        """Check that every rank of the amax reduction group holds the same FP8 state.

        Reduced amaxes make scales and histories identical across the group; a rank that
        drifted (a missed collective, a module that ran on one rank only) would quietly train
        with other scales. Compares one sha256 per rank; returns it (None when not checked:
        FP8 off, or amaxes not reduced, so ranks may differ by design).
        """
        if not self.manifest.precision.enabled or not self.recipe.reduce_amax:
            return None
        from fp8ops.checkpoint.state import fp8_digest

        # The checkpoint's per-module digests, combined: one definition of "the same state".
        digest = hashlib.sha256()
        for module in self.collector.modules.values():
            digest.update(fp8_digest(module).encode())
        mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
        ranks = dist.get_world_size(self.amax_group)
        everyone = [torch.empty_like(mine) for _ in range(ranks)]
        dist.all_gather(everyone, mine, group=self.amax_group)
        # Every rank learns whether any group disagreed (with amax_reduction tp_cp there is one
        # group per DP replica), so all of them take the same collective path below.
        agree = torch.tensor(float(all(torch.equal(mine, other) for other in everyone)))
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        agree = bool(agree.item())
        if self.ranks.is_main:
            self.run.event(
                "fp8_state_checked", step=step, ranks=ranks, agree=agree, digest=digest.hexdigest()
            )
        if not agree:  # a Stop alert, reported once (by rank 0), raised on every rank
            message = (
                f"step {step}: FP8 scaling state differs across the {ranks} ranks of the amax "
                "reduction group; their scales must be identical (see events.jsonl)"
            )
            alert = self.alert_engine.report(step, "ranks_disagree", "stop", message)
            self._raise_alerts(step, [alert] if self.ranks.is_main else [])
        return digest.hexdigest()

    # -- parts ---------------------------------------------------------------------------------

    def _fp8(self):
        return self.scope() if self.scope is not None else contextlib.nullcontext()

    def _gemms(self):
        # bf16 GEMMs in float32 where the CPU has no bf16 GEMM instructions (cpu_gemm.py).
        return Fp32Gemm() if self.cpu_bf16_gemm == "float32" else contextlib.nullcontext()

    def _fp8_state(self) -> dict[str, dict[str, torch.Tensor]]:
        # state_dict() copies, on both backends.
        return {name: m.fp8_meta.state_dict() for name, m in self.collector.modules.items()}

    def _restore_fp8_state(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, module in self.collector.modules.items():
            module.fp8_meta.load_state_dict(saved[name])

    def _dp_sum(self, value) -> torch.Tensor:
        # A CPU float64 scalar from any device: the sum goes over gloo, as every small control
        # collective does (distributed.py), and .item() on it costs no device sync.
        value = torch.as_tensor(value, dtype=torch.float64, device="cpu").clone()
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(value, group=self.dp_group)
        return value

    def _load_base(self) -> dict | None:
        path = self.manifest.model.init_checkpoint
        if path is None:
            return None
        meta = weights.load_weights(
            self.model,
            Path(path),
            self.manifest.model,
            tp_group=self.tp_group,
            field="model.init_checkpoint",
        )
        wanted = self.manifest.model.fingerprint
        if wanted is not None and wanted != meta["fingerprint"]:
            raise ManifestError(
                f"model.fingerprint is {wanted} but {path} holds weights {meta['fingerprint']}; "
                "point model.init_checkpoint at the intended base or update model.fingerprint"
            )
        return meta

    def _record_run_info(self, amax_group) -> None:
        manifest, topology = self.manifest, self.manifest.topology
        # A base loaded and verified in the model's own dtype is already hashed: the same bytes.
        same_dtype = self.base and self.base["dtype"] == str(self.model_dtype).removeprefix(
            "torch."
        )
        if self.base and self.base["verified"] and same_dtype:
            initial, scheme = self.base["fingerprint"], self.base["fingerprint_scheme"]
        else:
            scheme = weights.FINGERPRINT_SCHEME
            initial = weights.weights_fingerprint(self.model, self.tp_group, scheme=scheme)
        if not self.ranks.is_main:
            return
        self.run.write_json(
            "run.json",
            {
                "manifest": manifest_hash(manifest),
                "revision": manifest.revision.number,
                "command": sys.argv,
                "environment": environment_fingerprint(),
                "cpu_bf16_gemm": self.cpu_bf16_gemm,
                "topology": {
                    "tensor_parallel": topology.tensor_parallel,
                    "pipeline_parallel": topology.pipeline_parallel,
                    "data_parallel": topology.data_parallel,
                    "world_size": self.ranks.world_size,
                    "amax_reduction": topology.amax_reduction,
                    "amax_reduction_ranks": dist.get_process_group_ranks(amax_group),
                },
                "seeds": manifest.seeds.model_dump(),
                "model": {
                    "config_fingerprint": weights.architecture_fingerprint(manifest.model),
                    "init_checkpoint": manifest.model.init_checkpoint,
                    "init_fingerprint": self.base["fingerprint"] if self.base else None,
                    "init_fingerprint_scheme": self.base["fingerprint_scheme"]
                    if self.base
                    else None,
                    "init_verified": self.base["verified"] if self.base else None,
                    "initial_weights_fingerprint": initial,
                    "initial_weights_fingerprint_scheme": scheme,
                    "parameters": sum(p.numel() for p in self.model.parameters()),
                },
                "tokenizer": {
                    "kind": manifest.tokenizer.kind,
                    "fingerprint": self.data.source["tokenizer_fingerprint"],
                },
                "data": {
                    **self.data.summary(),
                    "fingerprint": self.data.fingerprint,
                    "sampler": self.sampler.describe(),
                },
                "admission": {
                    "fp8_modules": sum(r.precision == "fp8" for r in self.admission.rows)
                },
                # Which kernels cast (FP8OPS_COMPILED_CASTS, FP8OPS_CAST_KERNEL, or TE's own): the
                # same bits either way, so not part of the environment a resume compares.
                "fp8_casts": _fp8_casts(manifest.precision, self.device),
            },
        )
        self.run.event("run_started", manifest=manifest_hash(manifest))

    def _save_final_weights(self, checkpoint: Path, last_loss: float) -> None:
        """``final/``: the weights of the final ``checkpoint`` (the model holds them)."""
        from fp8ops.checkpoint import read_meta

        # The same weights: the checkpoint already gathered and hashed them.
        saved = read_meta(checkpoint)
        fingerprint = saved.weights_fingerprint
        meta = {
            "architecture": weights.architecture(self.manifest.model),
            "fingerprint": fingerprint,
            "fingerprint_scheme": saved.weights_fingerprint_scheme,
            "manifest": saved.manifest,  # what trained them (a finish may run under a later one)
            "steps": self.manifest.schedule.train_steps,
            "last_loss": last_loss,
        }
        weights.save_weights(self.model, self.run.path / "final", meta, is_main=self.ranks.is_main)
        if self.ranks.is_main:
            self.run.event("weights_saved", path="final", fingerprint=fingerprint)

    def _mark_failed(self, exc: BaseException) -> None:
        """Record why the run stopped, so nobody mistakes it for a live or finished one."""
        if self.ranks.is_main:
            self.run.set_status("failed", error=f"{type(exc).__name__}: {exc}")
            self.run.event("failed", error=f"{type(exc).__name__}: {exc}")

    def _event(self, kind: str, **fields) -> None:
        if self.ranks.is_main:
            self.run.event(kind, **fields)

    def _log_step(self, record: dict, advance) -> None:
        if not self.ranks.is_main:
            return
        self.run.append("metrics.jsonl", record)
        # status.json is rewritten with an fsync, so not on every step: metrics.jsonl has them.
        if record["step"] % self.manifest.schedule.log_interval == 0:
            self.run.set_status("running", step=record["step"])
        advance(record)

    @contextlib.contextmanager
    def _progress_bar(self):
        """Yields ``advance(record)``: a rich progress bar on a terminal, log lines otherwise."""
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        schedule = self.manifest.schedule
        console = Console(stderr=True, highlight=False)
        live = self.progress and console.is_terminal
        bar = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=console,
            disable=not live,
        )
        task = bar.add_task("train", total=schedule.train_steps, loss="-", tps="-")

        def advance(record: dict) -> None:
            loss, tps = f"{record['loss']:.4f}", f"{record['tokens_per_s']:,.0f}"
            norm = "skipped" if record["skipped"] else f"{record['grad_norm']:.3f}"
            bar.update(task, completed=record["step"], loss=loss, tps=tps)
            step = record["step"]
            if (
                self.progress
                and not live
                and (step % schedule.log_interval == 0 or step == schedule.train_steps)
            ):
                # A plain print: rich would wrap the line at its 80-column default for a
                # file, and a job log is grepped line by line.
                print(
                    f"step {step}/{schedule.train_steps}  loss {loss}  grad_norm {norm}  "
                    f"lr {record['lr']:.2e}  {tps} tok/s",
                    file=sys.stderr,
                    flush=True,
                )

        with bar:
            yield advance


def _peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    # Linux reports the peak resident set size in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fp8_casts(precision, device: torch.device) -> str | None:
    """What ran the FP8 casts: TE's kernels, or fp8ops' (eager, or compiled: which kernel)."""
    from fp8ops.precision.linear import cast_path

    if not precision.enabled:
        return None
    return "transformer_engine" if precision.backend == "te" else cast_path(device)
