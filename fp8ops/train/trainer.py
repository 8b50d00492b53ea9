"""The training loop: :class:`Trainer` builds a run's parts in ``__init__`` (in the order they
depend on each other) and :meth:`Trainer.train` is the loop, in execution order. How a run
starts (the plan and its checks, the ranks, the run directory claimed, its records) is
:mod:`fp8ops.train.startup`'s; what the loop calls between steps is its own module's: the
evaluations (:mod:`~fp8ops.train.evaluation`), what a Degrade alert does
(:mod:`~fp8ops.train.degrade`), and the ways a run ends (:mod:`~fp8ops.train.ending`).

Delayed scaling as Megatron uses it: one FP8 scope per micro-batch forward (input and gradient
histories advance per micro-batch), the weight cast once per optimizer step
(``mark_first_microbatch``: weight histories advance per step), amaxes reduced over the
manifest's amax reduction group. The scope is fp8ops' ``Fp8Scope``, or on the TE backend TE's own
autocast, which Megatron's ``TransformerBlock`` enters; either way the run reads the FP8 state
through ``fp8_state_modules``.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fp8ops.admission import apply_admission
from fp8ops.alerts import AlertEngine, write_alerts
from fp8ops.alerts.records import merge_rank_alerts
from fp8ops.checkpoint import weights
from fp8ops.checkpoint.meta import TopologyRecord
from fp8ops.checkpoint.state import Fp8Layout, fp8_states_agree
from fp8ops.checkpoint.training import TrainingParts, load_checkpoint, save_checkpoint
from fp8ops.collective import together
from fp8ops.data import TrainSampler
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.hf import verify as hf_verify
from fp8ops.manifest import ManifestStore, manifest_hash
from fp8ops.manifest.schema import Manifest
from fp8ops.megatron import (
    amax_reduction_group,
    build_gpt,
    fp8_state_modules,
    mark_first_microbatch,
)
from fp8ops.megatron.compat import parallel_state
from fp8ops.megatron.pipeline import forward_backward
from fp8ops.megatron.stages import every_stage
from fp8ops.overrides import Ledger
from fp8ops.precision import DelayedScalingRecipe, Fp8Scope, recipe_from_precision
from fp8ops.precision.state import carry_scales
from fp8ops.run import MetricsRow, RunDir, read_metrics, read_run_record
from fp8ops.run.environment import environment_fingerprint
from fp8ops.run.records import RecipeRecord, table_hash
from fp8ops.telemetry import TelemetryWriter
from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES
from fp8ops.telemetry.collector import TelemetryCollector
from fp8ops.telemetry.store import TelemetryError, rank_group, read_schema
from fp8ops.train import ending
from fp8ops.train.cpu_gemm import Fp32Gemm, check_compiled_casts, cpu_bf16_gemm
from fp8ops.train.degrade import auto_degrade, propose_overrides
from fp8ops.train.distributed import Ranks
from fp8ops.train.distributed_optimizer import DistributedMainParamsOptimizer
from fp8ops.train.ending import StopRun, TrainResult
from fp8ops.train.evaluation import Evaluator
from fp8ops.train.inputs import Inputs
from fp8ops.train.optimizer import MainParamsOptimizer, learning_rate
from fp8ops.train.phases import at_boundary, decide_at
from fp8ops.train.progress import StepLogger
from fp8ops.train.reporting import Reporting


class Trainer:
    """One run on this rank: the model, its data, optimizer and FP8 scope.

    Built before anything is written (a refused run leaves nothing behind), from the base
    weights (``from_base``: a new run) or, for a resume, to be loaded with a checkpoint
    (:meth:`restore`); the start-up then claims the run directory and hands it over
    (:meth:`open`); :meth:`train` or :meth:`finish` runs.
    """

    def __init__(
        self,
        manifest: Manifest,
        inputs: Inputs,
        ranks: Ranks,
        *,
        from_base: bool = True,
        verify_base: bool | None = None,
        progress: bool = True,
        stop_request=None,
    ):
        """``inputs``: the tokenizer, data and capability items, built once (an edit of a
        tokenizer.json mid-run changes nothing); ``from_base``: load ``model.init_checkpoint``
        (a new run; a resume's weights come from its checkpoint); ``stop_request``: a
        :class:`~fp8ops.train.signals.StopRequest` polled at every step boundary."""
        self.manifest, self.inputs, self.ranks = manifest, inputs, ranks
        self.data = inputs.data
        self.stop_request = stop_request
        self.progress = progress and ranks.is_main
        self.device = ranks.device  # the model, its FP8 state and each micro-batch live there
        precision, schedule = manifest.precision, manifest.schedule
        # "float32" for a bf16 model on a CPU without bf16 GEMMs (cpu_gemm.py); None: no bf16.
        bf16 = precision.base_dtype == "bf16"
        self.cpu_bf16_gemm = cpu_bf16_gemm(self.device) if bf16 else None
        # What the model's forwards and backwards run in: bf16 GEMMs in float32 there.
        self.gemms = Fp32Gemm if self.cpu_bf16_gemm == "float32" else contextlib.nullcontext
        if precision.enabled and precision.backend != "te":
            check_compiled_casts(self.device, self.cpu_bf16_gemm)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        # Under pipeline parallelism this rank holds one stage of the model, and Megatron's
        # schedule runs the micro-batches through the stages (fp8ops.megatron.pipeline).
        self.pipelined = manifest.topology.pipeline_parallel > 1
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.start_step = 0  # the step a checkpoint restores (restore())
        self.resumed_from = None  # the fp8ops.start.Resume plan restore() loaded

        self.sampler = TrainSampler(
            self.data.train,
            seed=manifest.seeds.data,
            global_batch_size=schedule.global_batch_size,
            micro_batch_size=schedule.micro_batch_size,
            dp_rank=ranks.dp_rank,
            dp_size=manifest.topology.data_parallel,
        )
        self.recipe = recipe_from_precision(precision)
        # Delayed scaling keeps per-module state (checkpointed, compared across ranks); the
        # stateless recipes keep none.
        self.stateful = isinstance(self.recipe, DelayedScalingRecipe)
        self.model = build_gpt(
            manifest, self.recipe if precision.enabled else None, device=self.device
        )
        self.model_dtype = next(self.model.parameters()).dtype
        # Decided before the base loads: it also refuses FP8 modules whose GEMM
        # precision.backend cannot take, which loading weights first would only delay.
        # For the first step: a resume decides again for its own (phases.resume_at).
        self.admission = decide_at(
            self.model,
            manifest,
            1,
            refuse_idle_recipes=from_base,  # a resume runs as it ran
        )
        apply_admission(self.admission, self.model)
        # Before the optimizer: it takes its float32 main weights from the model as it is now.
        self.base = self._load_base(verify_base) if from_base else None
        self.collector = TelemetryCollector(
            fp8_state_modules(self.model, self.recipe), manifest.telemetry
        )
        fp8_enabled = [module.fp8_enabled for module in self.collector.modules.values()]
        # Every stage's modules, in the model's order: the store holds them all (the first
        # stage writes them, observe()), and every rank proposes overrides for them alike.
        everywhere = every_stage(list(zip(self.collector.names, fp8_enabled)))
        self.telemetry_modules = [name for name, _ in everywhere]
        self.alert_engine = AlertEngine(
            manifest.alerts,
            self.collector.names,
            fp8_enabled,
            amax_compute_algo=precision.amax_compute_algo,
            # The modules whose scales come from an amax history (amax_jump judges only those).
            delayed=[
                self.stateful and module.fp8_meta is not None
                for module in self.collector.modules.values()
            ],
            other_stages={n: on for n, on in everywhere if n not in self.collector.modules},
        )
        self.amax_group = amax_reduction_group(manifest.topology)
        # On TE, Megatron's TransformerBlock enters TE's own delayed-scaling autocast, which
        # reduces and updates; fp8ops' scope is for fp8ops' own FP8 layers.
        own_scope = precision.enabled and precision.backend != "te"
        self.scope = Fp8Scope(self.recipe, group=self.amax_group) if own_scope else None
        # What each forward runs in. Not a bound method: the evaluator keeps it, and a cycle
        # back to the trainer would hold a finished trainer's run.lock until a GC pass.
        self.fp8 = self.scope if self.scope is not None else contextlib.nullcontext
        optimizer_class = (
            DistributedMainParamsOptimizer
            if manifest.optimizer.distributed
            else MainParamsOptimizer
        )
        self.optimizer = optimizer_class(
            self.model,
            manifest.optimizer,
            tp_group=self.tp_group,
            dp_group=self.dp_group,
            pp_group=self.pp_group,
        )
        self.fp8_layout = Fp8Layout.for_run(
            fp8=precision.enabled and bool(self.fp8_state_modules),
            reduce_amax=precision.reduce_amax,
            topology=manifest.topology,
            ranks=ranks,
        )
        self.carried_scales: dict[str, float] = {}  # a resume's scale factors (restore)
        self.load_seconds = 0.0
        self.run: RunDir | None = None  # open()
        self.ledger: Ledger | None = None
        self.telemetry: TelemetryWriter | None = None
        self.evaluator: Evaluator | None = None
        self.reporting = Reporting()  # open(): rank 0's metric sinks and webhooks

    # -- before the loop: a checkpoint in, the run directory handed over ------------------------

    def _load_base(self, verify: bool | None) -> dict | None:
        """A new run's starting weights: ``model.init_checkpoint``, loaded and verified; its
        metadata (None without a base). A Hugging Face base is compared with transformers'
        logits (``verify``: None where transformers is installed, True required to match,
        False not at all)."""
        path = self.manifest.model.init_checkpoint
        if verify and (path is None or not weights.is_hf_base(Path(path))):
            raise ManifestError(
                "--verify compares a Hugging Face model.init_checkpoint with transformers, and "
                f"this run's base is {'none' if path is None else 'an fp8ops weights checkpoint'}"
                ": leave --verify out"
            )
        if path is None:
            return None
        base = weights.load_base(
            self.model,
            Path(path),
            self.manifest.model,
            tp_group=self.tp_group,
            field="model.init_checkpoint",
        )
        wanted, found = self.manifest.model.fingerprint, base["fingerprint"]
        if wanted is not None and wanted != found:
            raise ManifestError(
                f"model.fingerprint is {wanted} but {path} holds weights {found}; point "
                "model.init_checkpoint at the intended base or update model.fingerprint"
            )
        if base.get("format") == "hf" and verify is not False:
            base["verification"] = self._verify_hf_base(Path(path), bool(verify))
        return base

    def _verify_hf_base(self, path: Path, required: bool) -> dict | None:
        if not hf_verify.transformers_available():
            if required:
                raise ManifestError(
                    "--verify needs transformers to compare the imported model with: "
                    "pip install 'fp8ops[hf]'"
                )
            return None
        record = hf_verify.compare(
            self.model, path, self.manifest.model, tp_group=self.tp_group, what="import"
        )
        if required:
            hf_verify.require(record, source=f"model.init_checkpoint {path}")
        return record

    def restore(self, plan) -> None:
        """Load the plan's checkpoint into the model, optimizer, FP8 state, data position and
        alert windows, and verify it (collective). Nothing on disk changes here."""
        self.start_step = plan.step
        self.load_seconds = load_checkpoint(
            self._parts(),
            plan.checkpoint,
            plan.meta,
            fp8_read=plan.fp8_read,
            # Windows of another shape (another alert configuration) start empty instead.
            alert_windows=plan.saved_manifest.alerts == self.manifest.alerts,
        )
        self.sampler.load_state_dict(plan.meta.sampler)
        # An accepted change of fp8_format or margin applies from the first step: the loaded
        # scales were computed for the old FP8 maximum and margin and would saturate (or waste
        # range) until the first update, so they are scaled by the exact factor instead; the
        # histories, raw amaxes, stay as saved.
        saved = plan.saved_manifest.precision
        both_delayed = saved.scaling == "delayed" and self.stateful
        if saved.enabled and self.manifest.precision.enabled and both_delayed:
            metas = [module.fp8_meta for module in self.fp8_state_modules.values()]
            old = DelayedScalingRecipe.from_precision(saved)
            self.carried_scales = carry_scales(metas, old, self.recipe)
        self.collector.seed_previous_scales()  # the next row's scale_change continues
        self.resumed_from = plan

    def admission_hash(self) -> str | None:
        """The identity of the per-layer decisions (``layers.json``'s table hash)."""
        if not self.telemetry_modules:
            return None
        return table_hash(self.admission.rows, RecipeRecord.from_recipe(self.recipe))

    def open(self, run: RunDir) -> None:
        """Take over the claimed run directory: the ledger for alert proposals, the telemetry
        store (a resume's reopened at the step after its checkpoint), the evaluations."""
        self.run = run
        if run.writer:
            self.ledger = Ledger(run.path)
        self.telemetry = self._open_telemetry()
        self.reporting = Reporting.open(
            run, self.manifest, start_step=self.start_step, modules=self.telemetry_modules
        )
        self.evaluator = Evaluator(
            self.model,
            self.inputs,
            run,
            device=self.device,
            pipelined=self.pipelined,
            fp8=self.fp8,
            gemms=self.gemms,
            fp8_modules=self.fp8_state_modules,
            collector=self.collector,
        )

    # -- the loop ------------------------------------------------------------------------------

    def train(self, stop_at: int | None = None) -> TrainResult:
        """Train from :attr:`start_step` to the end (or to ``stop_at``: checkpoint, then stop)."""
        schedule = self.manifest.schedule
        started = time.perf_counter()
        losses: list[float] = []
        last_eval = None
        self.run.event("train_started", steps=schedule.train_steps, from_step=self.start_step)
        logger = StepLogger(schedule.train_steps, schedule.log_interval, enabled=self.progress)
        finished = self.start_step  # the last step finished, as a failure reports it
        try:
            for step in range(self.start_step, schedule.train_steps):
                row = self.train_step(step)
                losses.append(row.loss)
                self.run.log_metrics(row, with_status=row.step % schedule.log_interval == 0)
                logger.log(row)
                self.observe(row)  # telemetry and alerts; raises StopRun
                finished = step + 1
                if finished % schedule.eval_interval == 0 or finished == schedule.train_steps:
                    last_eval = self.evaluator.loss(finished, self.manifest)
                    self.check_fp8_agreement(finished)
                if self.evaluator.capability_due(finished, self.manifest):
                    self.evaluator.capability(finished, self.manifest)
                if finished == schedule.train_steps:
                    break
                self.admission = at_boundary(self, finished + 1)  # the precision schedule
                if finished == stop_at:
                    return self._pause(finished, losses, last_eval, started, "stop-at")
                if self.stop_request is not None and self.stop_request.agreed(self.run.path):
                    reason = self.stop_request.reason
                    return self._pause(finished, losses, last_eval, started, reason)
                if finished % schedule.checkpoint_interval == 0:
                    self.save_checkpoint(finished, "periodic")
            if self.telemetry is not None:  # the last steps reach the disk before "completed"
                self.telemetry.close()
            # Judged first: the final save of a result not releasable deletes no checkpoint.
            problems = ending.releasable(self.run, schedule.train_steps)
            final = self.save_checkpoint(schedule.train_steps, "final", rotate=not problems)
            ending.check_releasable(self.run, schedule.train_steps, final, problems)
            self._save_final_weights(final, losses[-1])
        except StopRun as stop:  # a checkpoint of the alert's step, status stopped
            if (halted := stop.alerts[0]["step"]) < schedule.train_steps:  # as a pause's does,
                self.admission = at_boundary(self, halted + 1)  # its table is the next step's
            ending.stop(self.run, self.telemetry, self.save_checkpoint, stop)
            raise
        except BaseException as exc:  # what was measured up to the failure kept, status failed
            full = ending.fail(self.run, self.telemetry, exc, finished)
            if full is None:
                raise
            raise full from exc  # a full disk, said once (the traceback kept as its cause)
        finally:
            logger.close()
        seconds = ending.complete(self.run, self.manifest, started)
        return TrainResult(
            self.run.path,
            schedule.train_steps,
            losses[0],
            losses[-1],
            last_eval,
            seconds,
            first_step=self.start_step + 1,
            capability_accuracy=self.evaluator.capability_accuracy,
        )

    def train_step(self, step: int) -> MetricsRow:
        """One optimizer step over the global batch; returns its metrics row."""
        started = time.perf_counter()
        micro_batches = self.sampler.next_step()
        lr = learning_rate(step, self.manifest.optimizer, self.manifest.schedule)
        # The loss is a mean over every loss-bearing token of the global batch, so micro-batches
        # and data-parallel ranks with more answer tokens weigh more (as one big batch would).
        # Counted on the host batches: a CPU float64 scalar, which divides a loss on any device.
        loss_tokens = self._dp_sum(sum(mb.loss_mask.sum() for mb in micro_batches))
        mark_first_microbatch(self.model)
        self.collector.begin_step(step + 1)
        with self.gemms():
            if self.pipelined:  # the same losses, the micro-batches passed through the stages
                step_loss = forward_backward(
                    self.model, micro_batches, loss_tokens=loss_tokens, fp8=self.fp8
                )
            else:
                step_loss = self._forward_backward(micro_batches, loss_tokens)
        step_loss = self._dp_sum(step_loss)
        # Read before the optimizer step: it zeroes the gradients the row reports. The row's
        # copies to the host run on; the loss below syncs anyway, so observe() does not wait.
        self._telemetry_row = self.collector.end_step()
        grad_norm, skipped = self.optimizer.step(lr)
        seconds = time.perf_counter() - started
        tokens = self._dp_sum(torch.tensor(float(sum(mb.tokens.numel() for mb in micro_batches))))
        return MetricsRow(
            step=step + 1,
            loss=step_loss.item(),
            grad_norm=grad_norm if math.isfinite(grad_norm) else None,  # JSON has no NaN
            update_norm=self.optimizer.last_update_norm,
            weight_norm=self.optimizer.last_weight_norm,
            lr=lr,
            skipped=skipped,
            tokens=int(tokens.item()),
            loss_tokens=int(loss_tokens.item()),
            seconds=seconds,
            tokens_per_s=tokens.item() / seconds,
            peak_memory_mib=_peak_memory_mib(),
        )

    def _forward_backward(self, micro_batches, loss_tokens: torch.Tensor) -> torch.Tensor:
        """The step's forward and backward on a whole model; its loss on this DP rank."""
        # Accumulated where the losses are (no host sync per micro-batch).
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            mb = mb.to(self.device)
            with self.fp8():
                per_token = self.model(mb.tokens, mb.position_ids, None, labels=mb.labels)
            loss = (per_token.float() * mb.loss_mask).sum() / loss_tokens
            loss.backward()
            step_loss += loss.detach().double()
        return step_loss

    def observe(self, row: MetricsRow) -> None:
        """After :meth:`train_step`: hand the step's telemetry row to the store and the alert
        rules.

        Every rank evaluates its own row (saturation and norms are per shard); the alerts of all
        ranks are gathered to rank 0, which writes them, so a NaN on one shard is not missed and
        every rank stops at the same step.
        """
        step_values = {
            "loss": row.loss,
            "grad_norm": math.nan if row.grad_norm is None else row.grad_norm,
            # Not in the store (its step columns are fixed); the update_blowup rule reads them.
            "update_norm": math.nan if row.update_norm is None else row.update_norm,
            "weight_norm": math.nan if row.weight_norm is None else row.weight_norm,
            "lr": row.lr,
            "skipped": float(row.skipped),
            "tokens_per_s": row.tokens_per_s,
            "step_seconds": row.seconds,
        }
        telemetry_row = self._telemetry_row.result()
        if self.telemetry_modules:
            stored = self._to_first_stage(telemetry_row)  # every stage's modules, first stage
        if self.telemetry is not None:
            scalars = np.array([step_values[m] for m in STEP_METRIC_NAMES], dtype=np.float32)
            self.telemetry.append(row.step, stored, scalars)
            self.reporting.layers(row.step, stored)
        if self.collector.active:  # an unobserved step (a benchmark's) has nothing to judge
            alerts = self.alert_engine.observe(row.step, telemetry_row, step_values)
            self._raise_alerts(row.step, alerts)

    def _raise_alerts(self, step: int, alerts: list) -> None:
        """Gather every rank's alerts to rank 0 (only when some rank has any), record them and
        their proposals, and stop all ranks together on a Stop alert."""
        flag = torch.tensor(float(len(alerts) > 0))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [a.to_json() for a in alerts])
        everyone = merge_rank_alerts(gathered)
        proposals = self.alert_engine.proposals(everyone)
        if self.run.writer:
            write_alerts(self.run.path, everyone)
            # Degrade proposes a BF16 override into the ledger, where an operator reviews it.
            propose_overrides(self.run, self.ledger, proposals, everyone)
        stops = [a for a in everyone if a["level"] == "stop"]
        proposed = [p.module for p in proposals]
        if stops:
            self.reporting.alerts(everyone, proposed=proposed)
            raise StopRun(stops[0]["message"], stops)
        # A reviewed policy may switch modules to BF16 before the next step (degrade.py).
        switched = auto_degrade(
            step,
            proposals,
            manifest=self.manifest,
            model=self.model,
            recipe=self.recipe,
            alert_engine=self.alert_engine,
            run=self.run,
            ledger=self.ledger,
        )
        self.reporting.alerts(
            everyone, proposed=proposed, switched=switched.modules if switched else ()
        )
        if switched is not None:
            self.manifest, self.admission = switched.manifest, switched.admission

    def check_fp8_agreement(self, step: int) -> str | None:
        """Every rank of the amax reduction group must hold the same FP8 state
        (:func:`~fp8ops.checkpoint.state.fp8_states_agree`); a disagreement is a Stop alert.
        Returns the state's digest, or None when not checked (FP8 off, or amaxes not reduced,
        so ranks may differ by design)."""
        if not self.manifest.precision.enabled or not self.fp8_state_modules:
            return None
        if not self.recipe.reduce_amax:
            return None
        found = fp8_states_agree(self.fp8_state_modules, self.amax_group)
        self.run.event(
            "fp8_state_checked",
            step=step,
            ranks=found.ranks,
            agree=found.agree,
            digest=found.digest,
        )
        if not found.agree:  # a Stop alert, reported once (by rank 0), raised on every rank
            message = (
                f"step {step}: FP8 scaling state differs across the {found.ranks} ranks of the "
                "amax reduction group; their scales must be identical (see events.jsonl)"
            )
            alert = self.alert_engine.report(step, "ranks_disagree", "stop", message)
            self._raise_alerts(step, [alert] if self.ranks.is_main else [])
        return found.digest

    # -- checkpoints and the ways a run ends ------------------------------------------------------

    def save_checkpoint(self, step: int, reason: str, *, rotate: bool = True) -> Path:
        """A training checkpoint of the state after ``step`` (collective); ``rotate``: delete
        the oldest beyond ``schedule.keep_checkpoints``."""
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
            admission=self.admission_hash(),
            sampler=self.sampler.state_dict(),
            telemetry_committed=committed,
            keep=self.manifest.schedule.keep_checkpoints if rotate else None,
            ledger=self._ledger_anchor(),
        )
        self.run.event(
            "checkpoint_saved", step=step, path=path.name, reason=reason, seconds=round(seconds, 3)
        )
        return path

    def finish(self) -> TrainResult:
        """Complete a run whose checkpoint (the one :meth:`restore` loaded) is at its last step
        but which never wrote its final weights (``final/``) or its completed status:

        * the process ended after the final checkpoint (a kill or a preemption while ``final/``
          is written, minutes on a large model): nothing is left but the weights;
        * a Stop alert fired at the last step (its checkpoint's reason is ``alert-stop``): the
          last step's evaluations never ran, so they run first, under the resumed manifest
          (with any override approved since).

        Nothing is trained."""
        steps, plan = self.manifest.schedule.train_steps, self.resumed_from
        started = time.perf_counter()
        self.run.event("finishing", checkpoint=plan.checkpoint.name)
        logged = {row.step: row.loss for row in read_metrics(self.run.path)}
        last_loss, last_eval = logged.get(steps, float("nan")), None  # NaN: the line was lost
        try:
            if plan.meta.reason != "final":  # stopped before the last step's evaluations
                last_eval = self.evaluator.loss(steps, self.manifest)
                self.check_fp8_agreement(steps)
                if self.evaluator.capability_due(steps, self.manifest):
                    self.evaluator.capability(steps, self.manifest)
            if self.telemetry is not None:
                self.telemetry.close()
            ending.check_releasable(self.run, steps, plan.checkpoint)
            self._save_final_weights(plan.checkpoint, last_loss)
        except BaseException as exc:
            full = ending.fail(self.run, self.telemetry, exc, steps)
            if full is None:
                raise
            raise full from exc
        seconds = ending.complete(self.run, self.manifest, started)
        return TrainResult(
            self.run.path,
            steps,
            last_loss,
            last_loss,
            last_eval,
            seconds,
            first_step=steps + 1,
            capability_accuracy=self.evaluator.capability_accuracy,
        )

    def _pause(
        self, step: int, losses: list[float], last_eval, started: float, why: str
    ) -> TrainResult:
        """Stop at a step boundary with a checkpoint, ready for ``fp8ops resume``: ``--stop-at``
        (status paused) or a stop request (status interrupted: requeue)."""
        ending.pause(self.run, self.telemetry, self.save_checkpoint, step, why)
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
            interrupted_by=None if why == "stop-at" else why,
            capability_accuracy=self.evaluator.capability_accuracy,
        )

    def _save_final_weights(self, checkpoint: Path, last_loss: float) -> None:
        """``final/``: the weights of the final ``checkpoint``, which the model holds."""
        ending.save_final_weights(
            self.run, self.model, self.manifest, checkpoint, last_loss, is_main=self.ranks.is_main
        )

    # -- telemetry ------------------------------------------------------------------------------

    def _open_telemetry(self) -> TelemetryWriter | None:
        """The store, or None for a run without FP8-capable modules (FP8 off: the per-step
        metrics are in metrics.jsonl, and there is no per-module FP8 state to record)."""
        if not self.telemetry_modules:
            return None
        path, resumed = self.run.layout.telemetry, self.resumed_from
        reopened = resumed is not None and path.exists()
        if reopened:
            dist.barrier()  # rank 0 may have rewritten nothing yet; all ranks see one store
        # The first stage writes every stage's modules (observe()); a store it refuses stops
        # every stage, or the others would wait for it in the pipeline schedule.
        with together(TelemetryError):
            return self._open_store(path, reopened) if self.first_stage else None

    def _open_store(self, path: Path, reopened: bool) -> TelemetryWriter:
        """The first stage's writer: a resume's store reopened (checked to be this run's), or
        a new one."""
        first, resumed = self.start_step + 1, self.resumed_from
        if reopened:
            try:
                # Before anything is opened for writing: a resume drops steps past its own.
                _check_same_run(path, read_schema(path)[1].run_attrs, self._run_id())
                if (path / rank_group(self.ranks.rank)).exists():
                    writer = TelemetryWriter.resume(path, rank=self.ranks.rank, next_step=first)
                else:
                    writer = TelemetryWriter.join(
                        path,
                        rank=self.ranks.rank,
                        next_step=first,
                        flush_every=self.manifest.telemetry.flush_steps,
                    )
            except TelemetryError as exc:
                raise TelemetryError(
                    f"{exc}. The checkpoint is not affected: to resume without the damaged "
                    f"store, move it aside (mv {path} {path}.damaged); a new one then records "
                    f"from step {first}"
                ) from None
            _check_catalogue(path, writer.schema.module_metrics, first)
            return writer
        committed = resumed.meta.telemetry_committed if resumed is not None else None
        if committed and self.ranks.is_main:
            # The run had a store and it is gone: say so, rather than start a new one quietly.
            message = (
                f"{path} is missing, though the checkpoint's run had committed telemetry "
                f"up to step {committed}; a new store records from step {first}"
            )
            print(f"warning: {message}", file=sys.stderr)
            self.run.event("telemetry_restarted", message=message)
        return TelemetryWriter(
            path,
            rank=self.ranks.rank,
            first_step=first,
            modules=self.telemetry_modules,
            flush_every=self.manifest.telemetry.flush_steps,
            attrs={
                "manifest": manifest_hash(self.manifest),
                "world_size": self.ranks.world_size,
                # Rank 0 makes the store's root (its attributes), once run.json is written.
                "run_id": self._run_id() if self.ranks.is_main else None,
            },
        )

    def _run_id(self) -> str | None:
        """``run.json``'s run id (rank 0 wrote it before the trainer opened; None: an older
        run's record, without one)."""
        return read_run_record(self.run.path).run_id

    # -- parts ---------------------------------------------------------------------------------

    @property
    def fp8_state_modules(self) -> dict:
        """The modules whose FP8 state is checkpointed and restored: those under delayed
        scaling (none under a stateless recipe, nor a module under a per-module one)."""
        if not self.stateful:
            return {}
        return {n: m for n, m in self.collector.modules.items() if m.fp8_meta is not None}

    def _to_first_stage(self, row: np.ndarray) -> np.ndarray | None:
        """A telemetry row of every stage's modules, on the first stage (which writes the
        store; None elsewhere); this rank's row without pipelining."""
        if not self.pipelined:
            return row
        first = dist.get_global_rank(self.pp_group, 0)
        rows: list | None = (
            [None] * dist.get_world_size(self.pp_group) if self.first_stage else None
        )
        dist.gather_object(row, rows, dst=first, group=self.pp_group)
        return np.concatenate(rows) if self.first_stage else None

    def _dp_sum(self, value) -> torch.Tensor:
        # A CPU float64 scalar from any device: the sum goes over gloo, as every small control
        # collective does (distributed.py), and .item() on it costs no device sync.
        value = torch.as_tensor(value, dtype=torch.float64, device="cpu").clone()
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(value, group=self.dp_group)
        return value

    def _parts(self) -> TrainingParts:
        return TrainingParts(
            model=self.model,
            optimizer=self.optimizer,
            fp8_modules=self.fp8_state_modules,
            alert_engine=self.alert_engine,
            layout=self.fp8_layout,
            ranks=self.ranks,
            tp_group=self.tp_group,
            stages=self.manifest.topology.pipeline_parallel,
        )

    def _ledger_anchor(self) -> dict | None:
        """Rank 0: the ledger's length and head for the checkpoint (Ledger.anchor); a damaged
        ledger is left to the next resume to refuse, and the checkpoint is saved without."""
        if not self.run.writer:
            return None
        try:
            return self.ledger.anchor()
        except Fp8opsError as exc:
            self.run.event("ledger_not_anchored", error=str(exc))
            return None

    def _revision_hashes(self) -> list[str]:
        """The manifest's revision chain, root first, as far as the run knows it (a manifest
        file that is itself a revision names a parent the run may not hold)."""
        if not self.ranks.is_main:
            return []
        store = ManifestStore(self.run.layout.manifests)
        current, chain = self.manifest, [manifest_hash(self.manifest)]
        while current.revision.parent is not None:
            chain.append(current.revision.parent)
            if not store.path_for(current.revision.parent).exists():
                break
            current = store.get(current.revision.parent)
        return chain[::-1]


def _peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    # Linux reports the peak resident set size in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _check_catalogue(path, stored: tuple[str, ...], first: int) -> None:
    """A resumed store must hold this catalogue's module metrics, in its order: the rows the
    collector writes are laid out by it."""
    if stored == MODULE_METRIC_NAMES:
        return
    added = [m for m in MODULE_METRIC_NAMES if m not in stored]
    gone = [m for m in stored if m not in MODULE_METRIC_NAMES]
    parts = []
    if added:
        parts.append(f"this version adds {', '.join(added[:4])}{' ...' if len(added) > 4 else ''}")
    if gone:
        parts.append(f"drops {', '.join(gone[:4])}")
    change = "; ".join(parts) or "the same metrics in another order"
    raise TelemetryError(
        f"{path} holds {len(stored)} module metrics per row, written by another fp8ops version; "
        f"this one writes {len(MODULE_METRIC_NAMES)} ({change}), so it cannot append to it. "
        "The checkpoint is not affected: resume with the fp8ops version that wrote the store, "
        f"or move it aside (mv {path} {path}.old; its steps stay readable there) and a new one "
        f"records from step {first}"
    )


def _check_same_run(path: Path, attrs: dict, run_id: str | None) -> None:
    """The store being continued was made by this run: a link to or a copy of another run's
    store would get this run's steps appended to that run's telemetry."""
    if run_id is not None and attrs.get("run_id") != run_id:
        raise TelemetryError(
            f"{path} was written by another run (run id {attrs.get('run_id')}, this run's is "
            f"{run_id} in run.json): it is a link to or a copy of that run's store, and "
            "continuing it would write this run's steps into it"
        )
