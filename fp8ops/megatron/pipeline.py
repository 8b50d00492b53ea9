"""Forward and backward through Megatron-Core's pipeline schedule: a training step, an
evaluation batch, and forwards without labels (generation, the logit check of an import).

Under pipeline parallelism each rank holds one stage (``build_gpt`` builds the embedding on the
first, the LM head on the last, and the layers in between by Megatron's layer offset), and
Megatron's ``get_forward_backward_func`` runs the micro-batches through the stages: 1F1B, the
activations and their gradients sent between neighbouring stages. The delayed-scaling cadence is
the one without pipelining:

* ``fp8()`` is entered around each micro-batch's forward, on every stage, so each stage's
  scope reduces its modules' forward amaxes over its own amax group (Megatron's TP x DP group
  of that stage) and updates the scales once per micro-batch; the gradient amaxes are reduced
  and their scales updated in backward, as without pipelining;
* the caller marks the weights' first micro-batch (``mark_first_microbatch``) before the step,
  so each stage casts its weights once per step.

1F1B runs micro-batch 1's forward before micro-batch 0's backward; forward and backward scaling
states are separate, so the order changes no scale.

The loss function divides each micro-batch's summed loss by the global batch's loss-token count
(fp8ops' per-token loss), and the model's config sets ``calculate_per_token_loss`` so that the
schedule does not divide it again by the number of micro-batches.

Evaluation runs forward only through the same schedule (:func:`sequence_losses`), and so do
forwards that want the logits (:func:`last_stage_output`): Megatron's ``collect_non_loss_data``
hands the last stage's logits to a function of the caller's, whose result every stage receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8ops.megatron.compat import get_forward_backward_func, parallel_state


def forward_backward(
    model,
    micro_batches: Sequence,
    *,
    loss_tokens: torch.Tensor,
    fp8: Callable = contextlib.nullcontext,
    forward_only: bool = False,
) -> torch.Tensor:
    """Run ``micro_batches`` (fp8ops' ``MicroBatch``es, the same on every stage) through the
    pipeline; backward too unless ``forward_only``. Returns the step's loss, a float64 scalar on
    the host, on every stage (the last stage's, broadcast over the pipeline group; collective)."""

    def measure(per_token: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
        loss = (per_token.float() * mb.loss_mask).sum() / loss_tokens.to(per_token.device)
        return loss, loss.detach()

    reported = _through_stages(model, micro_batches, measure, fp8=fp8, forward_only=forward_only)
    loss = torch.zeros((), dtype=torch.float64)
    for value in reported:  # only the last stage has any
        loss += value.double().cpu()
    return _from_last_stage(loss)


def sequence_losses(model, mb, *, fp8: Callable = contextlib.nullcontext) -> torch.Tensor:
    """Forward only, one micro-batch: each sequence's loss summed over its loss-bearing tokens,
    float32 on the host, on every stage (collective over the pipeline group)."""

    def measure(per_token: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
        per_sequence = (per_token.float() * mb.loss_mask).sum(dim=1)
        return per_sequence.sum(), per_sequence

    reported = _through_stages(model, [mb], measure, fp8=fp8, forward_only=True)
    values = reported[0].cpu() if reported else torch.zeros(mb.tokens.shape[0])
    return _from_last_stage(values)


@dataclass(frozen=True)
class Prompts:
    """Token ids to run forward without labels: [b, s] each."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels = None

    def to(self, device: torch.device) -> Prompts:
        return Prompts(self.tokens.to(device), self.position_ids.to(device))


def last_stage_output(
    model,
    prompts: Prompts,
    measure: Callable[[torch.Tensor], torch.Tensor],
    *,
    like: torch.Tensor,
    fp8: Callable = contextlib.nullcontext,
) -> torch.Tensor:
    """Forward only, no labels: ``measure(logits)`` of the last stage's logits ([b, s, padded
    vocab], gathered over TP), a host tensor of ``like``'s shape and dtype, on every stage
    (collective over the pipeline group)."""
    reported = _through_stages(model, [prompts], measure, fp8=fp8, forward_only=True)
    if reported:  # the last stage: what it sends must be what the others wait for
        value = reported[0].cpu()
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(
                f"the last stage measured a {value.dtype} tensor of shape {tuple(value.shape)}; "
                f"the other stages expect {like.dtype} of shape {tuple(like.shape)}"
            )
        return _from_last_stage(value)
    return _from_last_stage(like.clone())


def _through_stages(
    model, micro_batches: Sequence, measure: Callable, *, fp8: Callable, forward_only: bool
) -> list[torch.Tensor]:
    """Megatron's schedule over ``micro_batches``; on the last stage, what ``measure`` reported
    of each. With labels, ``measure(per_token, micro_batch)`` returns the loss backward starts
    from and what to report; without (:class:`Prompts`), ``measure(logits)`` what to report."""
    device = next(model.parameters()).device
    batches = iter(micro_batches)
    no_labels = micro_batches[0].labels is None

    def forward_step(data_iterator, stage_model):
        mb = next(data_iterator).to(device)
        with fp8():
            # The first stage reads the tokens, the last the labels; the others neither.
            if no_labels:  # every TP rank of the last stage holds the whole vocabulary
                output = stage_model(mb.tokens, mb.position_ids, None, runtime_gather_output=True)
            else:
                output = stage_model(mb.tokens, mb.position_ids, None, labels=mb.labels)

        def loss_func(output: torch.Tensor, non_loss_data: bool = False):
            if non_loss_data:  # what the schedule keeps, as it is
                return measure(output)
            loss, reported = measure(output, mb)
            # (loss, tokens, reported): the per-token form the schedule leaves undivided.
            return loss, torch.ones((), dtype=torch.int), {"value": reported}

        return output, loss_func

    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    if len(shapes) != 1:  # the stages exchange activations of one fixed shape
        raise ValueError(
            f"every micro-batch of a pipelined step must have one shape, got {sorted(shapes)} "
            "(pad sequences to seq_length: data.pad_to)"
        )
    micro_batch_size, seq_length = shapes.pop()
    records = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=no_labels,
    )
    return records if no_labels else [record["value"] for record in records]


def _from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """``value`` as the last stage holds it, on every stage (a host tensor)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(value, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return value
