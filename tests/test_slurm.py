"""The SLURM launcher: rendering (no cluster needed), and jobs on a real one-node SLURM.

The cluster tests need the local SLURM of ``ci/slurm_start.sh`` (``bash ci/test.sh`` starts it
when it can: root and apt; not ``--fast``); without one they skip. They use the CPU default's
manifest with the small model (tests/support/small_model.py) fine-tuned from the shared small
base, at TP=2 over gloo (two ranks per job), 60 steps:

* SIGUSR1 to the batch script (``scancel --batch --signal=USR1``): the run checkpoints at a step
  boundary, the job requeues itself (``SLURM_RESTART_COUNT=1``), resumes and completes, with the
  losses, weights and FP8 state of an uninterrupted job, bit for bit. Both jobs are submitted by
  ``fp8ops launch slurm``; the uninterrupted one as a chain of two, whose second job finds the run
  complete and does nothing;
* preemption (a job in the ``urgent`` partition: SLURM sends SIGTERM to the ranks): the run
  checkpoints, the job requeues itself explicitly, and the manifest edited meanwhile makes the
  rerun refuse to resume: the job ends FAILED, exit 4, with the diff in its log. This one runs the
  ``srun`` launcher (one task per rank), the first the default, torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.launch import LaunchError, parse_time_limit
from fp8ops.launch.slurm import BATCH_SCRIPT

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ROOT / "launchers"


# -- rendering: fp8ops launch slurm --dry-run -------------------------------------------------------


@pytest.fixture
def eight_rank_manifest(tmp_path) -> Path:
    """The CPU default at TP=2 x DP=4: eight ranks, e.g. 2 nodes x 4 GPUs."""
    return write_derived(
        tmp_path / "eight.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            "topology.tensor_parallel": 2,
            "topology.data_parallel": 4,
            "schedule.micro_batch_size": 2,
        },
    )


def _directives(script: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")
    ]


def test_dry_run_renders_the_directives_and_inputs_from_the_manifest(
    eight_rank_manifest, cli, tmp_path
):
    result = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        2,
        "--gpus-per-node",
        4,
        "--time",
        "04:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--signal-seconds",
        600,
        "--run-dir",
        tmp_path / "run",
        "--sbatch-arg=--qos=high",
        "--dry-run",
    )
    assert result.code == 0, result.err
    script = result.out
    assert _directives(script) == [
        "--job-name=tiny-gpt-cpu",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--time=04:00:00",
        "--partition=gpu",
        "--account=proj",
        "--requeue",
        "--signal=B:USR1@600",
        "--open-mode=append",
        f'--output="{tmp_path / "run"}.slurm-%j.out"',
        f'--chdir="{Path.cwd()}"',
        '--qos="high"',
    ]
    assert f"export FP8OPS_MANIFEST={eight_rank_manifest}\n" in script
    assert f"export FP8OPS_RUN_DIR={tmp_path / 'run'}\n" in script
    assert "export FP8OPS_PROCS_PER_NODE=4\n" in script
    assert "export FP8OPS_LAUNCHER=torchrun\n" in script
    assert "export FP8OPS_REQUEUE=1\n" in script
    # Below the inputs: launchers/train.sbatch, unchanged but for its default directives.
    body = "".join(
        line
        for line in BATCH_SCRIPT.read_text().splitlines(True)[1:]
        if not line.startswith("#SBATCH")
    )
    assert script.endswith(body)
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_dry_run_for_the_srun_launcher_on_cpus(eight_rank_manifest, cli):
    result = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        2,
        "--time",
        "30",
        "--launcher",
        "srun",
        "--cpu",
        "--chain",
        3,
        "--dry-run",
    )
    assert result.code == 0, result.err
    directives = _directives(result.out)
    # 8 ranks over 2 nodes: 4 tasks per node, one CPU each; no GPUs requested
    assert "--ntasks-per-node=4" in directives and "--cpus-per-task=1" in directives
    assert not any(d.startswith("--gpus") for d in directives)
    assert "export FP8OPS_REQUEUE=0\n" in result.out  # a chain's jobs hand over instead


def test_a_world_size_that_differs_from_the_topology_is_refused(eight_rank_manifest, cli):
    result = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        1,
        "--gpus-per-node",
        4,
        "--time",
        "1:00:00",
        "--dry-run",
    )
    assert result.code == LaunchError.exit_code == 2
    assert "topology asks for 8 rank(s)" in result.err and "starts 4" in result.err
    assert "--set topology.data_parallel=2" in result.err  # how to make one that fits


def test_a_pipelined_topology_counts_its_stages_in_the_ranks(tmp_path, cli):
    staged = write_derived(  # TP 2 x PP 2 x DP 2: eight ranks
        tmp_path / "staged.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            "topology.tensor_parallel": 2,
            "topology.pipeline_parallel": 2,
            "topology.data_parallel": 2,
            "schedule.micro_batch_size": 2,
            "capability.enabled": False,
        },
    )
    launch = ("launch", "slurm", staged, "--time", "1:00:00", "--dry-run")
    result = cli(*launch, "--nodes", 1, "--gpus-per-node", 4)
    assert result.code == LaunchError.exit_code
    assert "pipeline_parallel 2" in result.err and "starts 4" in result.err
    assert "--set topology.data_parallel=1" in result.err  # TP x PP = 4 fits four GPUs
    result = cli(*launch, "--nodes", 2, "--gpus-per-node", 4)
    assert result.code == 0, result.err
    assert {"--nodes=2", "--gpus-per-node=4"} <= set(_directives(result.out))


def test_a_tensor_parallel_group_wider_than_a_node_is_warned_about(eight_rank_manifest, cli):
    result = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        8,
        "--gpus-per-node",
        1,
        "--time",
        "1:00:00",
        "--dry-run",
    )
    assert result.code == 0, result.err
    assert "warning: topology.tensor_parallel 2 spans more than one node" in result.err


def test_a_signal_that_would_come_before_the_job_starts_is_refused(eight_rank_manifest, cli):
    result = cli("launch", "slurm", eight_rank_manifest, "--nodes", 2, "--time", "5", "--dry-run")
    assert result.code == 2 and "--signal-seconds 300 is not shorter than --time 5" in result.err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("30:15", 1815),
        ("04:00:00", 14400),
        ("2-00", 172800),
        ("1-02:03", 93780),
        ("1-00:00:05", 86405),
        ("UNLIMITED", None),
    ],
)
def test_slurm_time_limits(text, seconds):
    assert parse_time_limit(text) == seconds


def test_a_malformed_time_limit_is_refused():
    with pytest.raises(LaunchError, match="not a SLURM time limit"):
        parse_time_limit("4h")


@pytest.mark.parametrize("script", ["train.sbatch", "chain.sh"])
def test_the_launchers_are_valid_bash(script):
    done = subprocess.run(
        ["bash", "-n", str(LAUNCHERS / script)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_paths_and_options_with_spaces_are_quoted_in_the_directives(
    eight_rank_manifest, cli, tmp_path, monkeypatch
):
    """sbatch splits an #SBATCH line at whitespace unless the value is in double quotes."""
    work = tmp_path / "my work"
    work.mkdir()
    monkeypatch.chdir(work)  # the job's working directory is where it is launched from
    result = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        2,
        "--gpus-per-node",
        4,
        "--time",
        "1:00:00",
        "--run-dir",
        "my runs/r1 50%",
        "--sbatch-arg=--comment=two words",
        "--dry-run",
    )
    assert result.code == 0, result.err
    directives = _directives(result.out)
    assert f'--chdir="{work}"' in directives
    assert f'--output="{work}/my runs/r1 50%%.slurm-%j.out"' in directives  # % is a pattern
    assert '--comment="two words"' in directives
    quoted = cli(
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        2,
        "--gpus-per-node",
        4,
        "--time",
        "1:00:00",
        '--sbatch-arg=--comment=say "hi" #1 \\ it\'s',
        "--dry-run",
    )
    assert quoted.code == 0, quoted.err
    assert '--comment="say \\"hi\\" #1 \\\\ it\'s"' in _directives(quoted.out)


def test_cpus_per_gpu_sizes_each_task(eight_rank_manifest, cli):
    """A torchrun task is a node's agent with all its ranks; an srun task is one rank."""
    common = (
        "launch",
        "slurm",
        eight_rank_manifest,
        "--nodes",
        2,
        "--gpus-per-node",
        4,
        "--time",
        "1:00:00",
        "--cpus-per-gpu",
        8,
        "--dry-run",
    )
    torchrun = _directives(cli(*common).out)
    assert "--gpus-per-node=4" in torchrun and "--cpus-per-task=32" in torchrun
    srun = _directives(cli(*common, "--launcher", "srun").out)
    assert "--ntasks-per-node=4" in srun and "--cpus-per-task=8" in srun
    assert not any(
        d.startswith("--cpus-per-task") for d in _directives(cli(*common[:-3], "--dry-run").out)
    )
    refused = cli(*common, "--cpu")
    assert (
        refused.code == 2
        and "--cpus-per-gpu 8: give a count of at least 1, for a job on GPUs" in refused.err
    )


def test_a_tensor_parallel_group_across_a_node_boundary_is_warned_about(tmp_path, cli):
    """TP 4 on nodes of 6 ranks: the second group (ranks 4-7) has a foot on each node."""
    manifest = write_derived(
        tmp_path / "twelve.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            "topology.tensor_parallel": 4,
            "topology.data_parallel": 3,
            "schedule.micro_batch_size": 2,
            "schedule.global_batch_size": 24,
        },
    )
    result = cli(
        "launch",
        "slurm",
        manifest,
        "--nodes",
        2,
        "--gpus-per-node",
        6,
        "--time",
        "1:00:00",
        "--dry-run",
    )
    assert result.code == 0, result.err
    assert "warning: topology.tensor_parallel 4 spans more than one node" in result.err


def _fake_commands(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH starts with ``tmp_path/bin`` holding the given scripts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


# Records each call (its arguments, and the drift and after-Stop reasons it would hand the job) and
# prints an id.
FAKE_SBATCH = """n=$(( $(cat "$CALLS" 2>/dev/null | wc -l) + 1 ))
echo "$* | drift=${FP8OPS_ACCEPT_DRIFT:-}${FP8OPS_AFTER_STOP:+ | stop=$FP8OPS_AFTER_STOP}" >> "$CALLS"
echo "$(( 100 + n ));cluster"
"""


def test_a_chain_waits_link_by_link_and_accepts_drift_in_its_first_link_only(tmp_path):
    env = _fake_commands(tmp_path, sbatch=FAKE_SBATCH)
    env.update(
        CALLS=str(tmp_path / "calls"), FP8OPS_ACCEPT_DRIFT="lr lowered", FP8OPS_AFTER_STOP="a spike"
    )
    done = subprocess.run(
        [
            "bash",
            str(LAUNCHERS / "chain.sh"),
            "3",
            "--dependency=afterok:77",
            "--time=10",
            "train.sbatch",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["101", "102", "103"]
    assert (tmp_path / "calls").read_text().splitlines() == [
        "--parsable --dependency=afterok:77 --time=10 train.sbatch | drift=lr lowered | stop=a spike",
        "--parsable --dependency=afterany:101 --time=10 train.sbatch | drift=",
        "--parsable --dependency=afterany:102 --time=10 train.sbatch | drift=",
    ]
    # sbatch takes it abbreviated too, and as a separate word or -d: the first link only.
    for given in (
        ["--depend=afterok:5"],
        ["--dep", "afterok:5"],
        ["-d", "afterok:5"],
        ["-dafterok:5"],
    ):
        (tmp_path / "calls").unlink()
        subprocess.run(
            ["bash", str(LAUNCHERS / "chain.sh"), "2", *given, "--time=10", "train.sbatch"],
            env=env,
            capture_output=True,
            check=True,
        )
        second = (tmp_path / "calls").read_text().splitlines()[1]
        assert second == "--parsable --dependency=afterany:101 --time=10 train.sbatch | drift=", (
            given
        )


def test_launch_slurm_chain_hands_the_drift_reason_to_its_first_job_only(
    eight_rank_manifest, tmp_path, monkeypatch
):
    from fp8ops.launch.slurm import plan_job, submit

    env = _fake_commands(tmp_path, sbatch=FAKE_SBATCH)
    for key in ("PATH",):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("FP8OPS_ACCEPT_DRIFT", "lr lowered")
    monkeypatch.setenv("FP8OPS_AFTER_STOP", "a spike")
    job = plan_job(eight_rank_manifest, nodes=2, gpus_per_node=4, time="1:00:00", workdir=tmp_path)
    assert submit(job, chain=2) == ["101", "102"]
    given = [line.split("| ", 1)[1] for line in (tmp_path / "calls").read_text().splitlines()]
    assert given == ["drift=lr lowered | stop=a spike", "drift="]


def test_a_requeued_attempt_does_not_accept_drift_again(tmp_path):
    """train.sbatch with fake srun and scontrol: the training step's command line, per attempt."""
    env = _fake_commands(
        tmp_path,
        srun='echo "$*" | tr "\\n" " " >> "$CALLS"; echo >> "$CALLS"\n',
        scontrol="echo localhost\n",
    )
    env.update(
        CALLS=str(tmp_path / "calls"),
        FP8OPS_MANIFEST="m.yaml",
        FP8OPS_RUN_DIR=str(tmp_path / "run"),
        FP8OPS_LAUNCHER="srun",
        FP8OPS_ACCEPT_DRIFT="lr lowered",
        FP8OPS_AFTER_STOP="a spike",
        SLURM_JOB_ID="7",
    )
    for attempt in ("0", "1"):
        done = subprocess.run(
            ["bash", str(LAUNCHERS / "train.sbatch")],
            capture_output=True,
            text=True,
            check=False,
            env={**env, "SLURM_RESTART_COUNT": attempt},
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    first, requeue = (tmp_path / "calls").read_text().splitlines()
    train = f"-m fp8ops train m.yaml --resume --run-dir {tmp_path / 'run'}"
    assert first.rstrip().endswith(f"{train} --accept-drift lr lowered --after-stop a spike")
    assert requeue.rstrip().endswith(train)  # no --accept-drift, no --after-stop


def test_a_job_that_does_not_resume_a_stopped_run_says_it_is_still_halted(tmp_path):
    """train.sbatch with a fake srun whose ranks refuse the resume (exit 3, no status written),
    as they do for a run a Stop alert halted that nothing answers: a chain's next job."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "stopped", "step": 6}, indent=2))
    env = _fake_commands(tmp_path, srun="exit 3\n", scontrol="echo localhost\n")
    env.update(
        FP8OPS_MANIFEST="m.yaml",
        FP8OPS_RUN_DIR=str(run),
        FP8OPS_LAUNCHER="srun",
        SLURM_JOB_ID="7",
        SLURM_RESTART_COUNT="0",
    )
    done = subprocess.run(
        ["bash", str(LAUNCHERS / "train.sbatch")],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the run is still halted by its Stop alert" in done.stdout, done.stdout
    assert 'FP8OPS_AFTER_STOP="why"' in done.stdout
    assert "training failed (exit 3)" in done.stdout  # and the drift hint, for a drift refusal


# -- a real SLURM -------------------------------------------------------------------------------------

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
# Seconds, against a hang only: a job here takes about a minute (two attempts, for a requeued
# one), and beside a full suite on two loaded cores more.
JOB_TIMEOUT = 600


@pytest.fixture(scope="module")
def cluster():
    """Skip unless a SLURM controller answers and is ci/slurm_start.sh's local one (test jobs
    on a real cluster would not see this machine's files; FP8OPS_SLURM_TESTS=1 insists)."""
    if shutil.which("sbatch") is None:
        pytest.skip("no SLURM here (sbatch not on PATH); as root: bash ci/slurm_start.sh")
    ping = subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False
    )
    if "UP" not in ping.stdout:
        said = (ping.stdout.strip() or ping.stderr.strip() or "nothing").splitlines()[0]
        pytest.skip(f"the SLURM controller does not answer ({said}); as root: ci/slurm_start.sh")
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=True
    )
    name = re.search(r"^ClusterName\s*=\s*(\S+)", config.stdout, re.MULTILINE)
    if (name and name.group(1)) != "localci" and os.environ.get("FP8OPS_SLURM_TESTS") != "1":
        pytest.skip(
            f"SLURM cluster {name and name.group(1)!r} is not ci/slurm_start.sh's local "
            "one; FP8OPS_SLURM_TESTS=1 submits the test jobs to it anyway"
        )
    submitted: list[str] = []
    yield submitted
    if submitted:  # whatever a failed test left behind
        subprocess.run(["scancel", *submitted], capture_output=True, check=False)


@pytest.fixture(scope="module")
def finetune(cluster, request, tmp_path_factory) -> Path:
    """The CPU default with the small model at TP=2, 60 steps, logging each step and
    checkpointing only when asked to stop and at the end, from the shared small base (asked for
    once a cluster answers: without one the base is not needed)."""
    base = request.getfixturevalue("small_base")
    return write_derived(
        tmp_path_factory.mktemp("slurm") / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "schedule.eval_iters": 2,
            "model.init_checkpoint": str(base / "final"),
            "data.num_examples": 400,
            "topology.tensor_parallel": 2,
            "schedule.train_steps": 60,
            "schedule.eval_interval": 30,
            "schedule.checkpoint_interval": 100,
        },
    )


def _launch(cluster: list[str], manifest: Path, run_dir: Path, *args: object) -> list[str]:
    """``fp8ops launch slurm`` as a user runs it; the job ids it prints."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8ops",
            "launch",
            "slurm",
            str(manifest),
            "--cpu",
            # An hour: SLURM signals the time limit's checkpoint 300 s before it, which must not
            # reach a job here however slow the machine (a minute each when quiet).
            "--time",
            "60",
            "--run-dir",
            str(run_dir),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert ids and all(i.isdigit() for i in ids), done.stdout
    cluster.extend(ids)
    return ids


def _job(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True
    )
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def _log(run_dir: Path, job_id: str) -> str:
    path = Path(f"{run_dir}.slurm-{job_id}.out")
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for_end(job_id: str, run_dir: Path) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job["JobState"] in TERMINAL:
            return job
        time.sleep(0.5)
    pytest.fail(
        f"job {job_id} still {job['JobState']} after {JOB_TIMEOUT} s; its log ends:\n"
        + _log(run_dir, job_id)[-3000:]
    )


def _wait_for_steps(run_dir: Path, steps: int, job_id: str) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if _job(job_id)["JobState"] in TERMINAL:
            break
        time.sleep(0.2)
    pytest.fail(
        f"{run_dir} did not log {steps} steps; job {job_id}'s log ends:\n"
        + _log(run_dir, job_id)[-3000:]
    )


@pytest.mark.slow
def test_sbatch_accepts_a_script_whose_paths_hold_spaces(cluster, tmp_path, monkeypatch):
    """The rendered directives as the real sbatch parses them (--test-only: nothing runs)."""
    work = tmp_path / "my work"
    work.mkdir()
    monkeypatch.chdir(work)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8ops",
            "launch",
            "slurm",
            str(MANIFESTS / "tiny-gpt-cpu.yaml"),
            "--cpu",
            "--time",
            "10",
            "--run-dir",
            "my runs/r1",
            "--sbatch-arg=--comment=two words",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    test = subprocess.run(
        ["sbatch", "--test-only"],
        input=done.stdout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr


@pytest.mark.slow
def test_sbatch_reads_paths_with_hashes_quotes_and_backslashes_as_written(cluster, tmp_path):
    """A held job (it never runs): scontrol shows the working directory and log path sbatch
    read from the rendered directives. (A % in the log's path is written %%, which sbatch turns
    back into %; scontrol's display expands patterns itself, so it is checked as rendered, in
    test_paths_and_options_with_spaces_are_quoted_in_the_directives.)"""
    from fp8ops.launch.slurm import plan_job, render

    work = tmp_path / "a#b it's \\ c"
    work.mkdir()
    job = plan_job(
        MANIFESTS / "tiny-gpt-cpu.yaml", time="10", gpus=False, workdir=work, run_dir=Path("r#1")
    )
    held = subprocess.run(
        ["sbatch", "--parsable", "--hold"],
        input=render(job),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = held.stdout.strip().split(";")[0]
    cluster.append(job_id)
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, check=False)
    assert f"WorkDir={work}\n" in shown, shown
    assert f"StdOut={work}/r#1.slurm-{job_id}.out\n" in shown, shown


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_result(
    cluster, finetune, tmp_path
):
    from fp8ops.checkpoint import CheckpointDir, read_meta
    from fp8ops.files import read_jsonl
    from fp8ops.run import read_metrics, read_status

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    chain = _launch(cluster, finetune, straight, "--chain", 2)
    (job,) = _launch(cluster, finetune, stopped)
    _wait_for_steps(stopped, 3, job)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)

    ended = _wait_for_end(job, stopped)
    log = _log(stopped, job)
    assert (ended["JobState"], ended["Restarts"], ended["ExitCode"]) == ("COMPLETED", "1", "0:0"), (
        log
    )
    # One assertion per line, each showing the log: a requeue by preemption (another job in the
    # 'urgent' partition) also ends COMPLETED after one restart, without these lines.
    assert "SIGUSR1: asked the run to checkpoint" in log, log
    assert f"requeued job {job}" in log, log
    assert "SLURM_RESTART_COUNT=1" in log, log
    assert re.search(r"exitcode\s*: 75 ", log)  # torchrun's report of the stop, then ours:
    assert "(exitcode 75) is the ranks stopping after that checkpoint, as asked" in log
    # Rank 0's line for every step (log_interval 1), the first attempt's then the requeued one's.
    logged = [int(s) for s in re.findall(r"^step (\d+)/60  loss \d", log, re.MULTILINE)]
    assert logged == list(range(1, 61)), log
    interrupted = [e for e in read_jsonl(stopped / "events.jsonl") if e["event"] == "interrupted"]
    assert len(interrupted) == 1, log
    step = interrupted[0]["step"]
    assert 3 <= step < 60
    assert read_meta(stopped / "checkpoints" / interrupted[0]["checkpoint"]).reason.startswith(
        "requested: "
    )
    resumed = [e for e in read_jsonl(stopped / "events.jsonl") if e["event"] == "resumed"]
    assert [(e["step"], e["drift"]) for e in resumed] == [(step, [])]
    assert read_status(stopped).state == "completed"

    for job_id in chain:
        ended = _wait_for_end(job_id, straight)
        assert (ended["JobState"], ended["Restarts"]) == ("COMPLETED", "0"), _log(straight, job_id)
    assert "run complete" in _log(straight, chain[0])
    assert "nothing to" in _log(straight, chain[1])  # the chain's second job: already complete

    a, b = read_metrics(straight), read_metrics(stopped)
    # Exact: one configuration launched alike, the same arithmetic across the checkpoint.
    assert [m.step for m in a] == [m.step for m in b] == list(range(1, 61))
    for key in ("loss", "grad_norm"):
        assert [getattr(m, key) for m in a] == [getattr(m, key) for m in b], key
    final_a, final_b = (read_meta(CheckpointDir(r).latest()) for r in (straight, stopped))
    assert final_a.step == final_b.step == 60
    assert final_a.fp8.digests == final_b.fp8.digests  # every module's scales and histories
    assert final_a.weights_fingerprint == final_b.weights_fingerprint


@pytest.mark.slow
def test_preemption_requeues_and_a_manifest_edited_meanwhile_fails_the_job(
    cluster, finetune, tmp_path
):
    from fp8ops.run import read_status

    manifest = shutil.copy(finetune, tmp_path / "finetune.yaml")
    run = tmp_path / "run"
    (job,) = _launch(cluster, manifest, run, "--launcher", "srun")
    _wait_for_steps(run, 3, job)
    # Edited while the job runs: the next attempt reads the file again.
    write_derived(tmp_path / "edited.yaml", manifest, {"optimizer.lr": 1e-3}).replace(manifest)
    # A job that needs every CPU of the node, in the partition that may preempt: SLURM sends
    # SIGTERM to our ranks, which checkpoint; the batch script then requeues the job itself, or,
    # if the checkpoint outlasts the partition's GraceTime (10 s; on a loaded machine it can),
    # SLURM requeues it at the end of the grace (PreemptMode=REQUEUE). Either way it runs again.
    cpus = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, check=True
    )
    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=urgent",
            f"--cpus-per-task={cpus.stdout.split()[0]}",
            f"--output={tmp_path / 'urgent.out'}",
            "--wrap",
            "sleep 1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cluster.append(urgent)

    ended = _wait_for_end(job, run)
    log = _log(run, job)
    assert (ended["JobState"], ended["Restarts"], ended["ExitCode"]) == ("FAILED", "1", "4:0"), log
    status = read_status(run)  # the refused attempt left the run as the preemption did
    assert (status.state, status.reason) == ("interrupted", "SIGTERM")
    assert f"checkpoint {status.checkpoint} at step {status.step} (SIGTERM)" in log
    assert f"requeued job {job}" in log or "not requeued by this script" in log, log
    assert "SLURM_RESTART_COUNT=1" in log
    assert "refusing to resume" in log
    assert re.search(r"manifest +optimizer\.lr: 0\.002 -> 0\.001", log), log[-3000:]
    assert "training failed (exit 4)" in log
