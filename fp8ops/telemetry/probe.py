"""What an FP8 layer tells telemetry about one step: a probe the collector attaches to it.

The layer calls the probe after each forward (``fp8_call`` or ``fallback_call``); the
collector reads and resets it once per step (``take``). On steps that measure, the layer casts
with full statistics (``track``: the forward casts fill it at once, the backward cast of the
gradient fills it later, during backward) and the probe keeps every micro-batch's; on other
steps the probe only counts GEMMs, which costs nothing measurable.

Measurements stay tensors on the layer's device: a ``.item()`` here would stop the host until
the GPU caught up, once per module and step. The collector copies them over together, without
waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8ops.precision.gemms import ALL_GEMMS, GEMMS


@dataclass
class Probe:
    """One module's telemetry for the step in progress."""

    measure: bool = False  # this step: full cast statistics and norms
    sample_error: bool = False  # this step: FP8 output against the base-dtype GEMM
    fp8_gemms: int = 0
    fallback_gemms: int = 0
    cast_logs: list[dict] = field(default_factory=list)  # role -> CastStats, per micro-batch
    input_norm: torch.Tensor | float = float("nan")  # a 0-dim tensor once measured
    rel_error: torch.Tensor | float = float("nan")
    # The error sample compares at most this many tokens (telemetry.error_sample_tokens).
    error_tokens: int | None = None

    def track(self) -> dict | None:
        """The dict to pass to ``fp8_linear`` as ``track`` (None when not measuring)."""
        if not self.measure:
            return None
        log: dict = {}
        self.cast_logs.append(log)
        return log

    def fp8_call(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        weight,
        bias,
        *,
        error=True,
        fp8_gemms: frozenset[str] = ALL_GEMMS,
    ) -> None:
        """After an FP8 forward: count its GEMMs, in FP8 (``fp8_gemms``) and not; measure the
        input and, when sampling, the error against the same GEMM in the input's dtype (not
        when fprop itself ran in high precision: there is no FP8 output to compare).
        ``error=False`` where ``out`` is not ``x @ weight.T + bias`` (a TE LayerNormLinear
        normalises ``x`` first)."""
        ran = _gemms(x, weight)
        in_fp8 = sum(g in fp8_gemms for g in ran)
        self.fp8_gemms += in_fp8
        self.fallback_gemms += len(ran) - in_fp8
        if self.measure:
            self.input_norm = _norm(x)
        if self.sample_error and error and "fprop" in fp8_gemms:
            x_rows, out_rows = _token_sample(x, out, self.error_tokens)
            with torch.no_grad():
                reference = F.linear(x_rows, weight.detach(), bias).float()
                # bf16 - float32 subtracts in float32 (exactly what .float() first would give)
                # without a float32 copy of the output.
                self.rel_error = _norm(out_rows - reference) / _norm(reference)

    def fallback_call(self, x: torch.Tensor, weight, sequence_group=None) -> None:
        """After a forward in the base dtype (the module is held out of FP8, or no scope).
        ``sequence_group``: the TP group ``x``'s sequence is split over (sequence parallelism),
        whose parts make up the input the FP8 path measures after gathering it (collective)."""
        self.fallback_gemms += len(_gemms(x, weight))
        if self.measure:
            if sequence_group is None or dist.get_world_size(sequence_group) == 1:
                self.input_norm = _norm(x)
                return
            square = _norm(x).square()
            dist.all_reduce(square, group=sequence_group)
            self.input_norm = square.sqrt()

    def take(self) -> Probe:
        """This step's record; the probe starts the next step empty (same cadence flags)."""
        record = Probe(
            self.measure,
            self.sample_error,
            self.fp8_gemms,
            self.fallback_gemms,
            self.cast_logs,
            self.input_norm,
            self.rel_error,
        )
        self.fp8_gemms = self.fallback_gemms = 0
        self.cast_logs = []
        self.input_norm = self.rel_error = float("nan")
        return record


def _gemms(x: torch.Tensor, weight) -> tuple[str, ...]:
    # fprop, plus dgrad and wgrad when this call will run a backward.
    builds_graph = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return GEMMS if builds_graph else ("fprop",)


def _norm(x: torch.Tensor) -> torch.Tensor:
    # The 2-norm accumulated in float32 in one kernel, without a float32 copy of x.
    return torch.linalg.vector_norm(x.detach(), dtype=torch.float32)


def _token_sample(x: torch.Tensor, out: torch.Tensor, limit: int | None):
    """``x`` and ``out`` as ``[tokens, features]`` rows: all of them, or with a ``limit``, the
    tokens at every k-th position of the first dimension, so at most ``limit`` (at least one
    position's). That dimension is the sequence in Megatron's ``[s, b, h]``, so every sequence
    of the micro-batch is compared at the same positions; the reference GEMM costs that many
    tokens."""
    if limit is not None:
        per_position = x[0].numel() // x.shape[-1]  # b in [s, b, h]; 1 in [tokens, h]
        positions = max(1, limit // per_position)
        if positions < x.shape[0]:
            stride = -(-x.shape[0] // positions)
            x, out = x[::stride], out[::stride]
    return x.detach().reshape(-1, x.shape[-1]), out.detach().reshape(-1, out.shape[-1])
