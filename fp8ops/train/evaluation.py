"""A run's evaluations of the model it trains, between two steps: the loss on the held-out set,
overall and per bucket (``eval.jsonl``), and greedy answers to the capability items
(``capability.jsonl``, :mod:`fp8ops.evaluate`). Every rank runs them (collective at TP>1 and
under pipeline parallelism); rank 0 writes them.

Both run held out of training (:meth:`Evaluator.held_out`): evaluating more or less often does
not change the run.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from fp8ops.evaluate.capability import evaluate_capability
from fp8ops.evaluate.records import score, write_capability
from fp8ops.manifest.schema import Manifest
from fp8ops.megatron import mark_first_microbatch
from fp8ops.megatron.pipeline import sequence_losses
from fp8ops.run import EvalRow, RunDir
from fp8ops.telemetry.collector import TelemetryCollector
from fp8ops.train.inputs import Inputs


class Evaluator:
    """The evaluations of ``model`` on this rank, recorded in ``run``.

    ``fp8()`` opens the precision context each forward runs in and ``gemms()`` the context of the
    run's bf16 GEMMs (the trainer's, as in training); ``fp8_modules``: the modules whose FP8
    state the run checkpoints, saved and restored around each evaluation; ``collector``: paused
    meanwhile."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        run: RunDir,
        *,
        device: torch.device,
        pipelined: bool,
        fp8: Callable,
        gemms: Callable,
        fp8_modules: dict[str, nn.Module],
        collector: TelemetryCollector,
    ):
        self.model, self.inputs, self.run = model, inputs, run
        self.device, self.pipelined = device, pipelined
        self.fp8, self.gemms = fp8, gemms
        self.fp8_modules, self.collector = fp8_modules, collector
        self.capability_accuracy: float | None = None  # the last capability evaluation's

    def loss(self, step: int, manifest: Manifest) -> float | None:
        """Mean loss over the held-out set, overall and per bucket; FP8 state left as it was
        (:meth:`held_out`). None when there is no held-out set (``data.eval_fraction: 0``)."""
        if len(self.inputs.data.eval) == 0:
            return None
        with self.held_out():
            return self._loss(step, manifest)

    def _loss(self, step: int, manifest: Manifest) -> float:
        data = self.inputs.data
        totals: dict[str, list[float]] = {}
        loss_sum, token_sum = 0.0, 0.0
        schedule = manifest.schedule
        batches = data.eval_batches(schedule.micro_batch_size)
        for mb in itertools.islice(batches, schedule.eval_iters):  # None: all of them
            if self.pipelined:
                per_sequence = sequence_losses(self.model, mb, fp8=self.fp8)
            else:
                mb = mb.to(self.device)
                with self.fp8():
                    per_token = self.model(mb.tokens, mb.position_ids, None, labels=mb.labels)
                # On the host once, not one device sync per sequence below (free on the CPU).
                per_sequence = (per_token.float() * mb.loss_mask).sum(dim=1).cpu()
            tokens = mb.loss_mask.sum(dim=1).cpu()
            loss_sum += per_sequence.sum().item()
            token_sum += tokens.sum().item()
            for index, seq_loss, seq_tokens in zip(mb.indices.tolist(), per_sequence, tokens):
                buckets = data.eval.buckets[index] if data.eval.examples else {}
                for name, value in buckets.items():
                    entry = totals.setdefault(f"{name}={value}", [0.0, 0.0])
                    entry[0] += seq_loss.item()
                    entry[1] += seq_tokens.item()
        loss = loss_sum / max(token_sum, 1.0)
        buckets = {name: s / max(t, 1.0) for name, (s, t) in sorted(totals.items())}
        self.run.log_eval(EvalRow(step=step, loss=loss, tokens=int(token_sum), buckets=buckets))
        return loss

    def capability_due(self, step: int, manifest: Manifest) -> bool:
        """At every ``capability.interval`` steps and the last, where there are items."""
        interval = manifest.capability.interval
        at_interval = interval is not None and step % interval == 0
        return bool(self.inputs.capability_examples) and (
            at_interval or step == manifest.schedule.train_steps
        )

    def capability(self, step: int, manifest: Manifest) -> float | None:
        """Greedy answers to the held-out items, exact match overall and per bucket
        (``fp8ops.evaluate``); rank 0 writes ``capability.jsonl`` and the step's predictions.
        Held out of training as :meth:`loss` is.

        A failing evaluation is recorded (event ``capability_failed``) and training goes on:
        hours of training are worth more than one measurement, and ``fp8ops compare`` fails a
        run whose capability records are missing. Under pipeline parallelism the failure ends
        the run instead (the stages would otherwise wait on each other).
        """
        started = time.perf_counter()
        try:
            with self.held_out():
                predictions = evaluate_capability(
                    self.model,
                    self.inputs.capability_examples,
                    manifest,
                    self.inputs.tokenizer,
                    fp8=self.fp8,
                )
        except Exception as exc:  # any failure of the measurement, not of training
            if self.pipelined:
                # Only the last stage picks the tokens: a failure there leaves the other stages
                # waiting for them, so going on would hang the run rather than save it.
                raise
            if self.run.writer:
                print(f"capability evaluation at step {step} failed: {exc}", file=sys.stderr)
            self.run.event("capability_failed", step=step, error=f"{type(exc).__name__}: {exc}")
            return None
        seconds = time.perf_counter() - started
        self.capability_accuracy = score(predictions)["accuracy"]
        if self.run.writer:
            write_capability(self.run.path, step, predictions, seconds)
        self.run.event(
            "capability_evaluated",
            step=step,
            accuracy=self.capability_accuracy,
            seconds=round(seconds, 3),
        )
        return self.capability_accuracy

    @contextlib.contextmanager
    def held_out(self):
        """Run evaluation forwards without changing the training run.

        They run in FP8 with the training scales, but their amaxes are discarded: TE would fold
        them into the next training update, so evaluating more or less often would change the
        training run. Telemetry is paused, so the evaluation's GEMMs and casts do not show up in
        the next step's row.
        """
        # state_dict() copies, on both backends.
        saved = {name: m.fp8_meta.state_dict() for name, m in self.fp8_modules.items()}
        try:
            with torch.no_grad(), self.collector.paused(), self.gemms():
                self.model.eval()
                mark_first_microbatch(self.model)  # cast the current weights once, reuse them
                yield
        finally:  # also when the evaluation fails: training must go on unchanged
            self.model.train()
            for name, module in self.fp8_modules.items():
                module.fp8_meta.load_state_dict(saved[name])
