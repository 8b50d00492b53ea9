"""``fp8ops train`` on CUDA, one GPU per rank; and the device plumbing that is testable on a CPU.

On a CPU (always run): ``MicroBatch.to``, the rank's device from ``LOCAL_RANK``, the process group
a GPU rank starts (``"cpu:gloo,cuda:nccl"``, the device set first), Megatron's subgroups
inheriting a multi-backend string, a plain NCCL group refused, and the telemetry collector
reading the FP8 state without copies on the CPU and in one copy from a device.

On a GPU (skipped without CUDA): the small model trained through ``run_training`` with everything
on the GPU (model, FP8 state, optimizer, batches), finite losses, its first loss near the CPU's;
two straight runs and a stop + resume bit-identical; a checkpoint loaded back onto the GPU; the
native ``scaled_mm`` backend; the TE backend where Transformer Engine imports; and TP=2 / DP=2
under torchrun when two GPUs are visible.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fp8ops.data.batches import MicroBatch
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.train import distributed

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
# The GPU tests' bodies hold on the CPU too (they compare with the rank's own device), so a
# change to them can be tried here by setting GPU = HAS_MEGATRON; they prove nothing then.
GPU = torch.cuda.is_available() and HAS_MEGATRON
TWO_GPUS = GPU and torch.cuda.device_count() >= 2
if GPU:
    from fp8ops.megatron.te_backend import te_available

    TE = te_available()
else:
    TE = False
needs_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="needs the megatron extra")
needs_gpu = pytest.mark.skipif(not GPU, reason="needs CUDA and megatron-core")
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs and megatron-core")
needs_te = pytest.mark.skipif(not TE, reason="needs a GPU with Transformer Engine")
# Neither cast switch set in the environment: the casts run as they do by default.
DEFAULT_CASTS = not (
    os.environ.get("FP8OPS_CAST_KERNEL") or os.environ.get("FP8OPS_COMPILED_CASTS")
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parents[1]


# -- on the CPU: batches ----------------------------------------------------------------------


def _batch() -> MicroBatch:
    b, s = 2, 5
    return MicroBatch(
        tokens=torch.arange(b * s).reshape(b, s),
        labels=torch.arange(1, b * s + 1).reshape(b, s),
        loss_mask=torch.ones(b, s),
        position_ids=torch.arange(s).expand(b, s).contiguous(),
        indices=torch.tensor([3, 7]),
    )


def test_a_batch_on_its_own_device_is_the_batch_itself():
    batch = _batch()
    assert batch.to("cpu") is batch
    assert batch.to(torch.device("cpu")) is batch


def test_a_batch_moves_what_the_model_reads_and_keeps_its_indices_on_the_host():
    batch = _batch()
    moved = batch.to("meta")  # a device that exists everywhere
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        tensor = getattr(moved, name)
        assert tensor.device.type == "meta", name
        original = getattr(batch, name)
        assert (tensor.shape, tensor.dtype) == (original.shape, original.dtype)
    assert moved.indices is batch.indices  # indexes host-side records
    assert batch.tokens.device.type == "cpu"  # the original is untouched


# -- on the CPU: the rank's device and its process group ---------------------------------------


def test_without_cuda_a_rank_runs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.rank_device() == torch.device("cpu")


def test_with_cuda_a_rank_runs_on_its_local_rank_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert distributed.rank_device() == torch.device("cuda", 0)  # a plain `fp8ops train`
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.rank_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")  # three ranks on a node with two GPUs
    with pytest.raises(ManifestError, match="local rank 2 but only 2 GPU"):
        distributed.rank_device()


def test_a_gpu_rank_sets_its_device_then_starts_gloo_for_cpu_and_nccl_for_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "rank_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append(("group", backend, kw))
    )
    monkeypatch.delenv("RANK", raising=False)
    distributed._start_process_group()
    assert calls[0] == ("device", torch.device("cuda", 1))
    assert calls[1][:2] == ("group", "cpu:gloo,cuda:nccl")
    assert (calls[1][2]["rank"], calls[1][2]["world_size"]) == (0, 1)

    calls.clear()
    monkeypatch.setenv("RANK", "0")  # under torchrun: env://
    distributed._start_process_group()
    assert calls == [("device", torch.device("cuda", 1)), ("group", "cpu:gloo,cuda:nccl", {})]


def test_a_cpu_rank_starts_plain_gloo(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "rank_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append(("group", backend))
    )
    monkeypatch.delenv("RANK", raising=False)
    distributed._start_process_group()
    assert calls == [("group", "gloo")]


@needs_megatron  # init_distributed imports Megatron's parallel state first
def test_a_gpu_rank_refuses_a_group_without_a_cpu_backend(monkeypatch):
    monkeypatch.setattr(distributed, "rank_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    topology = SimpleNamespace(world_size=1)
    with pytest.raises(Fp8opsError, match="no CPU backend"):
        distributed.init_distributed(topology, source="test")


@needs_megatron
def test_megatron_subgroups_inherit_a_multi_backend_string(tmp_path):
    """What a GPU run relies on, shown with gloo for both devices (no NCCL in a CPU build):
    every group Megatron creates without naming a backend carries the default group's
    device -> backend map, so CPU tensors on the TP, DP and amax groups go over gloo."""
    from fp8ops.manifest import load_manifest
    from fp8ops.megatron import amax_reduction_group
    from fp8ops.megatron.compat import parallel_state

    if dist.is_initialized():
        pytest.skip("another test left a process group running")
    manifest = load_manifest(REPO / "manifests" / "tiny-gpt-cpu.yaml")
    dist.init_process_group(
        "cpu:gloo,cuda:gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ranks = distributed.init_distributed(manifest.topology, source="test")
        assert ranks.device == distributed.rank_device()
        groups = {
            "tp": parallel_state.get_tensor_model_parallel_group(),
            "dp": parallel_state.get_data_parallel_group(),
            "amax": amax_reduction_group(manifest.topology),
        }
        for name, group in groups.items():
            assert dist.get_backend(group) == "cpu:gloo,cuda:gloo", name
            flag = torch.ones(())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            assert flag.item() == 1.0
        dist.barrier()
    finally:
        distributed.shutdown_distributed()  # Megatron's state; the group is the test's
        dist.destroy_process_group()


# -- on a GPU ---------------------------------------------------------------------------------

N = 4  # steps before a stop, and after it


def _losses(run: Path, key: str = "loss") -> list:
    from fp8ops.run import read_metrics

    return [getattr(m, key) for m in read_metrics(run)]


@pytest.fixture(scope="module")
def gpu_manifest(tmp_path_factory) -> Path:
    """The small fine-tuning manifest of 2N steps (evaluate, checkpoint and measure capability
    every N; telemetry every step), on a base pre-trained for two steps on the GPU."""
    if not GPU:
        pytest.skip("needs CUDA and megatron-core")
    from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

    from fp8ops.train import run_training

    tmp = tmp_path_factory.mktemp("gpu")
    schedule = {**SCHEDULE, "schedule.eval_iters": 2}
    base = write_derived(
        tmp / "base.yaml",
        MANIFESTS / "tiny-gpt-cpu-base.yaml",
        {**SMALL_MODEL, **schedule, "schedule.train_steps": 2, "schedule.eval_interval": 2},
    )
    run_training(base, tmp / "base", progress=False)
    return write_derived(
        tmp / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **schedule,
            "model.init_checkpoint": str(tmp / "base" / "final"),
            "data.num_examples": 400,
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": N,
            "schedule.checkpoint_interval": N,
            "capability.items": 8,
            "capability.interval": N,
            "optimizer.lr": 2e-3,
            "telemetry.every_steps": 1,
            "telemetry.error_sample_every": 2,
        },
    )


@pytest.fixture(scope="module")
def gpu_straight(gpu_manifest, tmp_path_factory) -> Path:
    from fp8ops.train import run_training

    run = tmp_path_factory.mktemp("gpu-straight") / "run"
    run_training(gpu_manifest, run, progress=False)
    return run


def _assert_same_training(a: Path, b: Path) -> None:
    from fp8ops.checkpoint import read_meta
    from fp8ops.checkpoint.directory import checkpoint_name
    from fp8ops.telemetry import open_run

    for key in ("step", "loss", "grad_norm", "update_norm", "lr", "skipped"):
        assert _losses(a, key) == _losses(b, key), key
    final_a = read_meta(a / "checkpoints" / checkpoint_name(2 * N))
    final_b = read_meta(b / "checkpoints" / checkpoint_name(2 * N))
    assert final_a.fp8.digests == final_b.fp8.digests
    assert final_a.weights_fingerprint == final_b.weights_fingerprint
    ta, tb = open_run(a), open_run(b)
    for module in ta.modules:
        assert np.array_equal(
            ta.module_history(module).to_numpy(),
            tb.module_history(module).to_numpy(),
            equal_nan=True,
        ), module


@needs_gpu
def test_everything_trains_on_the_gpu(gpu_manifest, tmp_path):
    """Model, FP8 state, optimizer copies and batches on the rank's GPU; a few steps, an
    evaluation and the FP8 agreement check there; the groups split CPU and CUDA traffic."""
    from fp8ops.manifest import load_manifest
    from fp8ops.megatron import amax_reduction_group
    from fp8ops.megatron.compat import parallel_state
    from fp8ops.start import New
    from fp8ops.telemetry.catalogue import COLUMN
    from fp8ops.train import open_trainer
    from fp8ops.train.distributed import init_distributed, shutdown_distributed

    manifest = load_manifest(gpu_manifest)
    ranks = init_distributed(manifest.topology, source="test")
    try:
        on_gpu = ranks.device.type == "cuda"
        if torch.cuda.is_available():
            assert ranks.device == torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            assert torch.cuda.current_device() == ranks.device.index
        for group in (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group(),
            amax_reduction_group(manifest.topology),
        ):
            assert dist.get_backend(group) == ("cpu:gloo,cuda:nccl" if on_gpu else "gloo")
            for device in ("cpu", ranks.device):
                value = torch.ones((), device=device)
                dist.all_reduce(value, group=group)  # gloo, then NCCL
                assert value.item() == 1.0
        trainer = open_trainer(
            New(manifest, [manifest], tmp_path / "run", "test"), ranks, progress=False
        )
        try:
            assert all(p.device == ranks.device for p in trainer.model.parameters())
            assert all(m.device == ranks.device for m in trainer.optimizer.main_params)
            for name, module in trainer.collector.modules.items():
                for tensor in module.fp8_meta.state_dict().values():
                    assert tensor.device == ranks.device, name
            for step in range(2):
                record = trainer.train_step(step)
                assert math.isfinite(record.loss) and math.isfinite(record.grad_norm)
                assert record.peak_memory_mib > 0
                trainer.observe(record)
                row = trainer._telemetry_row.result()  # the row is finished after the step
                assert np.isfinite(row[:, COLUMN["input.scale"]]).all()
                assert np.isfinite(row[:, COLUMN["weight.amax"]]).all()
            optimizer_state = trainer.optimizer.inner.state
            assert all(
                optimizer_state[m]["exp_avg"].device == ranks.device
                for m in trainer.optimizer.main_params
            )
            assert math.isfinite(trainer.evaluator.loss(2, trainer.manifest))
            assert trainer.check_fp8_agreement(2) is not None
            if on_gpu and DEFAULT_CASTS:  # the hand-written kernel, verified before use
                from fp8ops.precision.linear import cast_and_record_status

                gpu = {
                    key: status
                    for key, status in cast_and_record_status()["triton"].items()
                    if str(ranks.device) in key
                }
                assert gpu and set(gpu.values()) == {"compiled"}, gpu
        finally:
            trainer.telemetry.close()
            trainer.run.release()
    finally:
        shutdown_distributed()


@needs_gpu
def test_a_gpu_run_completes_with_finite_losses(gpu_straight):
    from fp8ops.files import read_jsonl

    assert json.loads((gpu_straight / "status.json").read_text())["state"] == "completed"
    assert _losses(gpu_straight, "step") == list(range(1, 2 * N + 1))
    assert all(math.isfinite(loss) for loss in _losses(gpu_straight))
    assert not any(_losses(gpu_straight, "skipped"))
    events = [e["event"] for e in read_jsonl(gpu_straight / "events.jsonl")]
    assert "fp8_state_checked" in events and "weights_saved" in events
    assert all(
        e["agree"]
        for e in read_jsonl(gpu_straight / "events.jsonl")
        if e["event"] == "fp8_state_checked"
    )
    assert (gpu_straight / "capability.jsonl").exists()
    if DEFAULT_CASTS:
        run = json.loads((gpu_straight / "run.json").read_text())
        assert run["fp8_casts"] == "compiled: triton"  # the cast kernel's default on a GPU


@needs_gpu
def test_two_gpu_runs_are_bit_identical(gpu_manifest, gpu_straight, tmp_path):
    """The GPU kernels this model uses are deterministic run to run; without that, the resume
    test below could not tell a resume bug from noise."""
    from fp8ops.train import run_training

    run_training(gpu_manifest, tmp_path / "run", progress=False)
    _assert_same_training(gpu_straight, tmp_path / "run")


@needs_gpu
def test_stop_and_resume_on_the_gpu_equals_the_straight_run(gpu_manifest, gpu_straight, tmp_path):
    from fp8ops.train import resume_training, run_training

    run = tmp_path / "run"
    paused = run_training(gpu_manifest, run, progress=False, stop_at=N)
    assert paused.paused and paused.steps == N
    resume_training(run, progress=False)
    _assert_same_training(gpu_straight, run)


@needs_gpu
def test_a_checkpoint_loads_back_onto_the_gpu(gpu_manifest, tmp_path):
    from fp8ops.start import plan_resume
    from fp8ops.train import open_trainer, run_training
    from fp8ops.train.distributed import init_distributed, shutdown_distributed

    run = tmp_path / "run"
    run_training(gpu_manifest, run, progress=False, stop_at=N)
    plan = plan_resume(run)
    ranks = init_distributed(plan.manifest.topology, source="test")
    try:
        trainer = open_trainer(plan, ranks, progress=False)
        try:
            assert all(p.device == ranks.device for p in trainer.model.parameters())
            for main in trainer.optimizer.main_params:
                assert main.device == ranks.device
                for kind in ("exp_avg", "exp_avg_sq"):
                    assert trainer.optimizer.inner.state[main][kind].device == ranks.device
            for module in trainer.collector.modules.values():
                assert all(t.device == ranks.device for t in module.fp8_meta.state_dict().values())
            fp8 = [m for m in trainer.collector.modules.values() if m.fp8_enabled]
            assert fp8 and all(m.fp8_meta.forward.scale.ne(1).any() for m in fp8)  # restored
        finally:
            if trainer.telemetry is not None:
                trainer.telemetry.close()
            trainer.run.release()
    finally:
        shutdown_distributed()


@needs_gpu
def test_the_first_gpu_loss_is_the_cpus_within_rounding(gpu_manifest, gpu_straight, tmp_path):
    """The same base (saved on the GPU, loaded on the CPU), data and initial FP8 state: step 1's
    loss differs only by summation order and bf16 rounding."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8ops",
            "train",
            str(gpu_manifest),
            "--run-dir",
            str(tmp_path / "cpu"),
            "--set",
            "schedule.train_steps=1",
            "--no-progress",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    cpu, gpu = _losses(tmp_path / "cpu")[0], _losses(gpu_straight)[0]
    assert abs(cpu - gpu) <= 1e-2 * abs(cpu), (cpu, gpu)


@needs_te
def test_the_te_backend_trains_and_resumes_as_its_straight_run(gpu_manifest, tmp_path):
    """``precision.backend: te`` through the trainer: Megatron's TE spec under TE's autocast,
    telemetry read from TE's own ``fp8_meta``, and a stop + resume, which loads TE's state
    through TE's own loader past TE 2.18's refusal of pickled state (``te_state.py``), equal
    to the straight run. The base was trained with fp8ops' own layers (Megatron's local spec):
    it loads under Megatron's shared checkpoint keys and verifies by them (checkpoint/weights.py)."""
    from fp8ops.files import read_jsonl
    from fp8ops.telemetry import open_run
    from fp8ops.train import resume_training, run_training

    te = {"precision.backend": "te"}
    straight = tmp_path / "straight"
    run_training(gpu_manifest, straight, assignments=te, progress=False)
    assert all(math.isfinite(loss) for loss in _losses(straight))
    info = json.loads((straight / "run.json").read_text())
    assert info["fp8_casts"] == "transformer_engine" and info["model"]["init_verified"]
    telemetry = open_run(straight)
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    assert qkv in telemetry.modules
    assert telemetry.module_history(qkv, "input.scale").iloc[-1, 0] != 1.0  # TE's scale, updated

    events = [e["event"] for e in read_jsonl(straight / "events.jsonl")]
    assert "capability_failed" not in events  # its forwards are padded for TE's FP8 GEMMs
    assert read_jsonl(straight / "capability.jsonl")

    run = tmp_path / "run"
    paused = run_training(gpu_manifest, run, assignments=te, progress=False, stop_at=N)
    assert paused.paused
    resume_training(run, progress=False)
    _assert_same_training(straight, run)
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ  # on for fp8ops' load only


@needs_gpu
def test_the_native_fp8_gemm_trains(gpu_manifest, gpu_straight, tmp_path):
    from fp8ops.precision.scaled_mm import scaled_mm_unsupported
    from fp8ops.train import run_training

    reason = scaled_mm_unsupported(distributed.rank_device())
    if reason is not None:
        pytest.skip(f"torch._scaled_mm cannot run here: {reason}")
    run = tmp_path / "run"
    run_training(gpu_manifest, run, assignments={"precision.backend": "scaled_mm"}, progress=False)
    losses = _losses(run)
    assert all(math.isfinite(loss) for loss in losses)
    emulated = _losses(gpu_straight)[0]
    assert abs(losses[0] - emulated) <= 1e-2 * abs(emulated), (losses[0], emulated)


@needs_two_gpus
@pytest.mark.parametrize("layout", ["tensor_parallel", "data_parallel"])
def test_two_ranks_on_two_gpus(gpu_manifest, tmp_path, layout):
    """TP=2 (Megatron's collectives and the amax reduction over NCCL) and DP=2 (the gradient
    sum over NCCL, token counts and losses over gloo) under torchrun, one GPU per rank."""
    from fp8ops.files import read_jsonl

    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fp8ops",
            "train",
            str(gpu_manifest),
            "--run-dir",
            str(run),
            "--set",
            f"topology.{layout}=2",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert all(math.isfinite(loss) for loss in _losses(run))
    checks = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "fp8_state_checked"]
    assert checks and all(e["agree"] and e["ranks"] == 2 for e in checks)
