"""bf16 GEMMs on CPUs without bf16 GEMM instructions: computed in float32, rounded once
(``fp8ops.train.cpu_gemm``)."""

from __future__ import annotations

import pytest
import torch
from support.gemm_log import GemmLog

from fp8ops.errors import Fp8opsError
from fp8ops.train.cpu_gemm import CHOICE_VARIABLE, Fp32Gemm, cpu_bf16_gemm, cpu_has_bf16_gemm


class _Linear(torch.autograd.Function):
    """A linear with its own backward, as Megatron's layers have: its GEMMs run in backward()."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad.matmul(w), grad.t().matmul(x)


def _operands(*shape):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=generator).to(torch.bfloat16).requires_grad_()


def test_every_bf16_gemm_is_the_float32_product_rounded_once_backward_included():
    x, w = _operands(64, 96), _operands(80, 96)
    q, k = _operands(3, 16, 32), _operands(3, 32, 16)
    bias = _operands(80)
    grad = _operands(64, 80).detach()
    with GemmLog() as kernels, Fp32Gemm():
        y = _Linear.apply(x, w)
        y.backward(grad)
        scores = torch.baddbmm(
            torch.zeros(3, 16, 16, dtype=torch.bfloat16), q, k, beta=0.0, alpha=0.5
        )
        attended = torch.bmm(scores, q)
        projected = torch.nn.functional.linear(x, w, bias)  # addmm
    xf, wf, gf = x.detach().float(), w.detach().float(), grad.float()
    qf, kf, bf = q.detach().float(), k.detach().float(), bias.detach().float()
    # Exact: each is the same float32 operation on the same operands as the mode's, rounded
    # once to bf16 (a scaled or biased GEMM too: a BLAS may add the bias before its last sums).
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (xf @ wf.t()).bfloat16())
    assert torch.equal(x.grad, (gf @ wf).bfloat16())  # the custom backward's GEMMs too
    assert torch.equal(w.grad, (gf.t() @ xf).bfloat16())
    zeros = torch.zeros(3, 16, 16)
    expected_scores = torch.baddbmm(zeros, qf, kf, beta=0.0, alpha=0.5).bfloat16()
    assert torch.equal(scores, expected_scores)
    assert torch.equal(attended, (expected_scores.float() @ qf).bfloat16())
    assert torch.equal(projected, torch.addmm(bf, xf, wf.t()).bfloat16())
    # The kernels that ran show the float32 path (GemmLog), the backward's two GEMMs included.
    assert kernels.gemms == [("mm.default", {torch.float32})] * 3 + [
        ("baddbmm.default", {torch.float32}),
        ("bmm.default", {torch.float32}),
        ("addmm.default", {torch.float32}),
    ]
    # Mixed dtypes go to torch, which refuses them as it does without the mode.
    with Fp32Gemm(), pytest.raises(RuntimeError):
        torch.mm(x.detach(), wf.t())


def test_compiled_casts_are_refused_under_the_mode(monkeypatch):
    """torch.compile does not run under a dispatch mode: the casts would run eager while the
    run recorded them as compiled."""
    from fp8ops.precision.compiled import set_compiled_casts
    from fp8ops.train.cpu_gemm import check_compiled_casts

    cpu = torch.device("cpu")
    check_compiled_casts(cpu, "float32")  # eager casts (the CPU's default): fine
    previous = set_compiled_casts("all")
    try:
        check_compiled_casts(cpu, "native")
        with pytest.raises(Fp8opsError, match="FP8OPS_CPU_BF16_GEMM=native"):
            check_compiled_casts(cpu, "float32")
    finally:
        set_compiled_casts(previous)


def test_the_choice_follows_the_cpu_unless_set(monkeypatch):
    monkeypatch.delenv(CHOICE_VARIABLE, raising=False)
    cpu = torch.device("cpu")
    assert cpu_bf16_gemm(cpu) == ("native" if cpu_has_bf16_gemm() else "float32")
    assert cpu_bf16_gemm(torch.device("cuda", 0)) is None  # a GPU has its own bf16 GEMMs
    for choice in ("native", "float32"):
        monkeypatch.setenv(CHOICE_VARIABLE, choice)
        assert cpu_bf16_gemm(cpu) == choice
    monkeypatch.setenv(CHOICE_VARIABLE, "fp32")
    with pytest.raises(Fp8opsError, match=f"{CHOICE_VARIABLE}='fp32': choose native or float32"):
        cpu_bf16_gemm(cpu)
