"""The ``topology`` section: the parallel layout."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from fp8ops.manifest.base import Section, added_field


class Topology(Section):
    """The parallel layout. The world size is their product."""

    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks; must divide heads, query groups and ffn_hidden_size.",
    )
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages; must divide num_layers.")
    data_parallel: int = Field(1, ge=1, description="Data-parallel replicas.")
    sequence_parallel: bool = added_field(
        False,
        added_in="0.1.0",
        description=(
            "Megatron's sequence parallelism: norms and the residual stream split the sequence "
            "over the tensor-parallel ranks (all-gather before the column-parallel linears, "
            "reduce-scatter after the row-parallel ones). Needs tensor_parallel > 1, amaxes "
            "reduced over TP (precision.reduce_amax), and sequences padded to seq_length."
        ),
    )
    context_parallel: int = added_field(
        1,
        added_in="0.1.0",
        ge=1,
        description=(
            "Megatron's context parallelism (the sequence split over ranks inside attention "
            "too). Only 1 so far: fp8ops' attention and data path do not split sequences; "
            "for long sequences use tensor_parallel with sequence_parallel."
        ),
    )
    amax_reduction: Literal["tp_dp_cp", "tp_cp"] = Field(
        "tp_dp_cp",
        description=(
            "Group the amax all-reduce spans: 'tp_dp_cp' (Megatron's default, every rank that "
            "sees the tensor) or 'tp_cp' (Megatron's tp_only_amax_red: cheaper, DP replicas "
            "may then drift to different scales)."
        ),
    )

    @field_validator("context_parallel")
    @classmethod
    def _no_context_parallel(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError(
                "manifest_rule",
                "context parallelism is not supported yet (fp8ops' attention and data path do "
                "not split sequences); set it to 1, and for long sequences use "
                "topology.sequence_parallel with tensor_parallel > 1",
            )
        return value

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage (all of them without pipelining)."""
        return self.tensor_parallel * self.data_parallel
