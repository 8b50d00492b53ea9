"""Pipeline stages as the rest of fp8ops asks about them: the pipeline group, and a list of
every stage's items (modules, admission rows, counts) gathered in the model's order."""

from __future__ import annotations

import torch.distributed as dist

from fp8ops.megatron.compat import parallel_state


def pipeline_group():
    """The pipeline group when the model is split over stages, else None."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_pipeline_model_parallel_group()


def every_stage(items: list) -> list:
    """``items`` of every pipeline stage, first stage first (collective over the pipeline
    group); this stage's own without pipelining."""
    stages = pipeline_group()
    if stages is None:
        return items
    everyone: list = [None] * dist.get_world_size(stages)
    dist.all_gather_object(everyone, items, group=stages)
    return [item for stage in everyone for item in stage]
