"""One step's forward and backward through Megatron-Core's pipeline schedule.

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

Status: the trainer does not run this yet (``topology.pipeline_parallel`` other than 1 is refused
when a run starts); ``tests/test_pipeline.py`` checks it against the unpipelined step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

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
    device = next(model.parameters()).device
    batches = iter(micro_batches)

    def forward_step(data_iterator, stage_model):
        mb = next(data_iterator).to(device)
        with fp8():
            # The first stage reads the tokens, the last the labels; the others neither.
            output = stage_model(mb.tokens, mb.position_ids, None, labels=mb.labels)

        def loss_func(per_token: torch.Tensor):
            loss = (per_token.float() * mb.loss_mask).sum() / loss_tokens.to(device)
            # (loss, tokens, reported): the per-token form the schedule leaves undivided.
            return loss, torch.ones((), dtype=torch.int), {"loss": loss.detach()}

        return output, loss_func

    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    if len(shapes) != 1:  # the stages exchange activations of one fixed shape
        raise ValueError(
            f"every micro-batch of a pipelined step must have one shape, got {sorted(shapes)} "
            "(pad sequences to seq_length: data.pad_to)"
        )
    micro_batch_size, seq_length = shapes.pop()
    reported = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    loss = torch.zeros((), dtype=torch.float64)
    for record in reported:  # only the last stage has any
        loss += record["loss"].double().cpu()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(loss, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return loss
