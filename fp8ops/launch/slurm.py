"""``fp8ops launch slurm``: fill in the batch script's inputs from a manifest, check them, submit.

The logic of a SLURM job (start the ranks, turn signals into a checkpoint, requeue, resume) lives
in one place, the batch script ``launchers/train.sbatch``, which users can also submit by hand.
This module renders it for one manifest: ``#SBATCH`` directives for the allocation asked for, the
script's ``FP8OPS_*`` inputs as exports, then the script itself unchanged below them. So
``--dry-run`` shows exactly what runs, and a fix to the script reaches both ways of launching.

Reading order: :class:`SlurmJob` (what a submission is), :func:`plan_job` (from a manifest and the
command line, checked), :func:`render`, :func:`submit`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import load_manifest, manifest_hash

# A link to launchers/train.sbatch, so that the package finds it wherever it is installed from.
BATCH_SCRIPT = Path(__file__).with_name("train.sbatch")
LOG_SUFFIX = ".slurm-%j.out"  # the job log, beside the run directory: RUN_DIR.slurm-JOBID.out

Launcher = Literal["torchrun", "srun"]


class LaunchError(Fp8opsError):
    """A launch that cannot work as asked (exit 2): the message names the option and a fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmJob:
    """One SLURM submission of a manifest. Paths are absolute: the job may start anywhere."""

    manifest: Path
    """The manifest file. Every attempt re-reads it, so an edit between requeues is caught as
    drift by the resume (refused, the job fails) instead of silently training another run."""
    manifest_sha256: str
    """Its hash at submission, recorded in the script's header."""
    name: str
    """The job name: the manifest's name."""
    run_dir: Path
    nodes: int
    procs_per_node: int
    """Ranks per node: one per GPU (or, with ``gpus=False``, CPU processes)."""
    tensor_parallel: int
    """The manifest's; wider than a node, every layer's collectives cross the network."""
    time: str
    """SLURM's time limit, as given (e.g. ``04:00:00``, ``2-00:00:00``, ``30`` minutes)."""
    signal_seconds: int = 300
    """SIGUSR1 comes this long before the time limit: time to finish a step and checkpoint."""
    gpus: bool = True
    """False: no GPUs are requested; the ranks run on CPUs over gloo (the CPU default, CI)."""
    launcher: Launcher = "torchrun"
    """torchrun: one agent per node starts its ranks; srun: one task per rank."""
    partition: str | None = None
    account: str | None = None
    python: str = sys.executable
    """The Python on the compute nodes that has fp8ops installed."""
    requeue: bool = True
    """Requeue after a stop request; False ends the job instead (a chain's next job resumes)."""
    container_image: str | None = None
    """Run the ranks in this container (pyxis/enroot ``srun --container-image``)."""
    container_mounts: str | None = None
    workdir: Path
    """Where the job runs: relative paths inside the manifest are relative to it."""
    output: Path
    """The job's log (``%j``: the job id), appended to by every attempt."""
    sbatch_args: tuple[str, ...] = ()
    """More ``#SBATCH`` options, each as on sbatch's command line (``--qos=high``)."""
    cpus_per_gpu: int | None = None
    """CPUs for each GPU's rank (data loading, the host side of its kernels); None: the
    cluster's default, which may be one CPU for a whole node's torchrun agent and ranks."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def plan_job(
    manifest_path: Path,
    *,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    time: str,
    run_dir: Path | None = None,
    signal_seconds: int = 300,
    gpus: bool = True,
    launcher: Launcher = "torchrun",
    partition: str | None = None,
    account: str | None = None,
    python: str | None = None,
    requeue: bool = True,
    container_image: str | None = None,
    container_mounts: str | None = None,
    sbatch_args: tuple[str, ...] = (),
    workdir: Path | None = None,
    cpus_per_gpu: int | None = None,
) -> SlurmJob:
    """The submission for ``manifest_path`` on ``nodes`` x ``gpus_per_node`` ranks, checked
    against the manifest's topology (default ``gpus_per_node``: what the topology needs)."""
    manifest_path = Path(manifest_path).resolve()
    manifest = load_manifest(manifest_path)
    topology = manifest.topology
    if nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, not {nodes}")
    if gpus_per_node is None:
        gpus_per_node, left = divmod(topology.world_size, nodes)
        if left or not gpus_per_node:
            raise LaunchError(
                f"{manifest_path}: topology needs {topology.world_size} rank(s), which "
                f"{nodes} node(s) cannot share evenly; give --gpus-per-node"
            )
    if gpus_per_node < 1:
        raise LaunchError(f"--gpus-per-node must be at least 1, not {gpus_per_node}")
    world = nodes * gpus_per_node
    if world != topology.world_size:
        raise LaunchError(_world_mismatch(manifest_path, topology, nodes, gpus_per_node))
    limit = parse_time_limit(time)
    if limit is not None and signal_seconds >= limit:
        raise LaunchError(
            f"--signal-seconds {signal_seconds} is not shorter than --time {time} ({limit} s): "
            "the job would be asked to checkpoint and requeue as soon as it starts"
        )
    if cpus_per_gpu is not None and (not gpus or cpus_per_gpu < 1):
        raise LaunchError(
            f"--cpus-per-gpu {cpus_per_gpu}: give a count of at least 1, for a job on GPUs "
            "(with --cpu each node's processes get a CPU each)"
        )
    if launcher not in ("torchrun", "srun"):
        raise LaunchError(f"--launcher must be torchrun or srun, not {launcher!r}")
    for arg in sbatch_args:
        if not arg.startswith("-") or "\n" in arg:
            raise LaunchError(f"--sbatch-arg {arg!r}: give one sbatch option, e.g. --qos=high")
        option, _, value = arg.partition("=")
        if any(c.isspace() for c in option):
            raise LaunchError(f"--sbatch-arg {arg!r}: write the option as --name=value")
        _directive(option, value)  # refuses what an #SBATCH line cannot hold
    workdir = Path(workdir or Path.cwd()).resolve()
    run_dir = (workdir / (run_dir or Path("runs") / manifest.name)).resolve()
    for what, path in (("manifest", manifest_path), ("--run-dir", run_dir), ("workdir", workdir)):
        if "\n" in str(path) or "\r" in str(path):
            raise LaunchError(
                f"{what} {str(path)!r}: a path with a line break cannot go in a batch script"
            )
    return SlurmJob(
        manifest=manifest_path,
        manifest_sha256=manifest_hash(manifest),
        name=manifest.name,
        run_dir=run_dir,
        nodes=nodes,
        procs_per_node=gpus_per_node,
        tensor_parallel=topology.tensor_parallel,
        time=time,
        signal_seconds=signal_seconds,
        gpus=gpus,
        launcher=launcher,
        partition=partition,
        account=account,
        requeue=requeue,
        container_image=container_image,
        container_mounts=container_mounts,
        workdir=workdir,
        cpus_per_gpu=cpus_per_gpu,
        # Next to the run directory, not in it: a new run refuses a directory with files in it.
        output=run_dir.parent / f"{run_dir.name}{LOG_SUFFIX}",
        # In a container the host's interpreter path means nothing: the image's python.
        python=python or ("python" if container_image else sys.executable),
        sbatch_args=tuple(sbatch_args),
    )


def _world_mismatch(path: Path, topology, nodes: int, per_node: int) -> str:
    world = nodes * per_node
    message = (
        f"{path}: topology asks for {topology.world_size} rank(s) (tensor_parallel "
        f"{topology.tensor_parallel} x pipeline_parallel {topology.pipeline_parallel} x "
        f"data_parallel {topology.data_parallel}), but --nodes {nodes} x --gpus-per-node "
        f"{per_node} starts {world}"
    )
    model_parallel = topology.tensor_parallel * topology.pipeline_parallel
    if world % model_parallel == 0:
        message += (
            f"; for this allocation derive a manifest with data_parallel {world // model_parallel}"
            f": fp8ops manifest derive {path} --set topology.data_parallel="
            f'{world // model_parallel} --reason "{world} GPUs" --out NEW.yaml'
        )
    return message


# SLURM's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(text: str) -> int | None:
    """Seconds in a SLURM time limit (None: unlimited). Raises :class:`LaunchError` on a
    format sbatch would refuse."""
    if text.strip().lower() in ("unlimited", "infinite", "-1"):
        return None
    match = _TIME.match(text.strip())
    if not match:
        raise LaunchError(
            f"--time {text!r}: not a SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
            "or D-HH:MM:SS)"
        )
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(first), int(second or 0), int(third or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    return int(first) * 60 + int(second or 0)  # MM[:SS]


def render(job: SlurmJob) -> str:
    """The batch script for ``job``: its directives and inputs, then launchers/train.sbatch."""
    # A torchrun task is a node's agent and all its ranks; an srun task is one rank. On CPUs each
    # rank gets a CPU; on GPUs --cpus-per-gpu each, or the cluster's default when not given.
    ranks_per_task = job.procs_per_node if job.launcher == "torchrun" else 1
    cpus_per_rank = job.cpus_per_gpu if job.gpus else 1
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={1 if job.launcher == 'torchrun' else job.procs_per_node}",
        *([f"--gpus-per-node={job.procs_per_node}"] if job.gpus else []),
        *([f"--cpus-per-task={cpus_per_rank * ranks_per_task}"] if cpus_per_rank else []),
        f"--time={job.time}",
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        "--requeue",
        f"--signal=B:USR1@{job.signal_seconds}",
        "--open-mode=append",
        # sbatch expands %-patterns in --output: a % of the path itself is written %%.
        _directive("--output", str(job.run_dir).replace("%", "%%") + LOG_SUFFIX),
        _directive("--chdir", job.workdir),
        *(_directive(*arg.partition("=")[::2]) if "=" in arg else arg for arg in job.sbatch_args),
    ]
    inputs = {
        "FP8OPS_MANIFEST": job.manifest,
        "FP8OPS_RUN_DIR": job.run_dir,
        "FP8OPS_PROCS_PER_NODE": job.procs_per_node,
        "FP8OPS_LAUNCHER": job.launcher,
        "FP8OPS_PYTHON": job.python,
        "FP8OPS_REQUEUE": int(job.requeue),
        "FP8OPS_CONTAINER_IMAGE": job.container_image,
        "FP8OPS_CONTAINER_MOUNTS": job.container_mounts,
    }
    header = [
        "#!/bin/bash",
        "# Rendered by `fp8ops launch slurm` from launchers/train.sbatch, which follows the exports",
        f"# unchanged. Manifest {job.manifest} (sha256 {job.manifest_sha256[:12]} at submission),",
        f"# {job.nodes} node(s) x {job.procs_per_node} {'GPU' if job.gpus else 'CPU'} rank(s).",
        *(f"#SBATCH {d}" for d in directives),
        *(f"export {k}={shlex.quote(str(v))}" for k, v in inputs.items() if v is not None),
    ]
    return "\n".join(header) + "\n" + _script_body()


def _directive(option: str, value: object) -> str:
    r"""``--option="value"`` for an ``#SBATCH`` line. sbatch's directive parser splits at
    whitespace, ends the line at an unquoted ``#``, and reads ``'`` as a quote and ``\`` as an
    escape, so the value goes in double quotes with ``\`` and ``"`` escaped. A line break cannot
    be written at all: refused."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise LaunchError(f"{option}={text!r}: an #SBATCH line cannot hold a line break")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'{option}="{escaped}"'


def _script_body() -> str:
    """launchers/train.sbatch without its shebang and its own (default) directives."""
    lines = BATCH_SCRIPT.read_text().splitlines(keepends=True)
    return "".join(line for line in lines[1:] if not line.startswith("#SBATCH"))


# Reasons an operator gave for what they saw at submission, for the chain's first job only.
FIRST_LINK_ONLY = ("FP8OPS_ACCEPT_DRIFT", "FP8OPS_AFTER_STOP")


def submit(job: SlurmJob, *, chain: int = 1, dependency: str | None = None) -> list[str]:
    """Submit ``job`` (``chain`` > 1: that many jobs, each starting when the one before it ends,
    whatever its state, and resuming its run). Returns the job ids."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError(
            "sbatch is not on PATH: run this on a SLURM login node (--dry-run prints the script)"
        )
    if chain < 1:
        raise LaunchError(f"--chain must be at least 1, not {chain}")
    job.output.parent.mkdir(parents=True, exist_ok=True)  # sbatch does not create it
    script = render(job)
    ids: list[str] = []
    for _ in range(chain):
        after = f"afterany:{ids[-1]}" if ids else dependency
        command = [sbatch, "--parsable", *([f"--dependency={after}"] if after else [])]
        # sbatch hands its environment to the job: an accepted drift's reason is for the drift
        # seen at submission, which the first link records as a revision; later links resume
        # locked to it, and refuse new drift. Going on after a Stop is for the Stop seen now.
        env = {k: v for k, v in os.environ.items() if not (ids and k in FIRST_LINK_ONLY)}
        done = subprocess.run(
            command, input=script, capture_output=True, text=True, check=False, env=env
        )
        if done.returncode != 0:
            submitted = f" (submitted before it: {', '.join(ids)})" if ids else ""
            raise LaunchError(f"sbatch failed{submitted}: {done.stderr.strip() or done.stdout}")
        ids.append(done.stdout.strip().split(";")[0])  # "ID" or "ID;CLUSTER"
    return ids
