"""``fp8ops launch slurm``: submit a manifest's training as a SLURM job (or print the script).

Thin, as ``fp8ops/cli.py`` is: :func:`fp8ops.launch.slurm.plan_job` checks, ``render`` or
``submit`` does the rest. Job ids go to stdout, one per line, so scripts can capture them; what a
human wants to know goes to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fp8ops.launch.slurm import Launcher, plan_job, render, submit

launch_app = typer.Typer(
    help="Run training on a cluster: SLURM jobs that checkpoint, requeue and resume.",
    no_args_is_help=True,
)


@launch_app.command("slurm")
def slurm(
    manifest: Annotated[Path, typer.Argument(help="A manifest YAML file.", show_default=False)],
    time: Annotated[
        str,
        typer.Option(
            help="Time limit per attempt, as sbatch takes it (e.g. 04:00:00, 2-00:00:00).",
            show_default=False,
        ),
    ],
    nodes: Annotated[int, typer.Option(help="Nodes.")] = 1,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            help="Ranks per node, one per GPU (default: what the manifest's topology "
            "needs, spread over --nodes).",
            show_default=False,
        ),
    ] = None,
    partition: Annotated[str | None, typer.Option(show_default=False)] = None,
    account: Annotated[str | None, typer.Option(show_default=False)] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(help="The run directory (default: runs/NAME).", show_default=False),
    ] = None,
    signal_seconds: Annotated[
        int,
        typer.Option(
            help="Ask the run to checkpoint and requeue this long before the time limit "
            "(a step plus a checkpoint must fit)."
        ),
    ] = 300,
    launcher: Annotated[
        str,
        typer.Option(
            help="torchrun: one agent per node (c10d rendezvous); srun: one task per rank."
        ),
    ] = "torchrun",
    cpu: Annotated[
        bool,
        typer.Option(
            "--cpu", help="Request no GPUs: the ranks run on CPUs over gloo (the CPU default; CI)."
        ),
    ] = False,
    python: Annotated[
        str | None,
        typer.Option(
            help="Python with fp8ops on the compute nodes (default: this one; 'python' "
            "in a container).",
            show_default=False,
        ),
    ] = None,
    container_image: Annotated[
        str | None,
        typer.Option(help="Run the ranks in this image (pyxis/enroot).", show_default=False),
    ] = None,
    container_mounts: Annotated[
        str | None,
        typer.Option(help="pyxis --container-mounts, e.g. /data:/data.", show_default=False),
    ] = None,
    chain: Annotated[
        int,
        typer.Option(
            min=1,
            help="Submit this many jobs, each starting when the previous "
            "ends (afterany) and resuming the run.",
        ),
    ] = 1,
    dependency: Annotated[
        str | None,
        typer.Option(help="sbatch --dependency for the (first) job.", show_default=False),
    ] = None,
    requeue: Annotated[
        bool | None,
        typer.Option(
            "--requeue/--no-requeue",
            help="Requeue the job after a stop request "
            "(default: yes, unless --chain: then the next job resumes).",
            show_default=False,
        ),
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="One more sbatch option, as on its command line (repeatable), e.g. "
            "--sbatch-arg=--qos=high.",
            show_default=False,
        ),
    ] = None,
    cpus_per_gpu: Annotated[
        int | None,
        typer.Option(
            help="CPUs for each GPU's rank (--cpus-per-task of the script's tasks; default: "
            "the cluster's, which may be one CPU per node).",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the batch script; submit nothing.")] = False,
) -> None:
    """Submit MANIFEST's training as a SLURM job that resumes by itself.

    Before the time limit (--signal-seconds) and on preemption the run checkpoints at a step
    boundary and the job requeues; every attempt resumes from the latest checkpoint, locked to
    its manifest (an edited manifest is refused: the job fails with the diff in its log).
    Prints the job id. The script is launchers/train.sbatch; see docs/slurm.md.
    """
    job = plan_job(
        manifest,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        time=time,
        run_dir=run_dir,
        signal_seconds=signal_seconds,
        gpus=not cpu,
        launcher=_launcher(launcher),
        partition=partition,
        account=account,
        python=python,
        requeue=chain == 1 if requeue is None else requeue,
        container_image=container_image,
        container_mounts=container_mounts,
        sbatch_args=tuple(sbatch_arg or ()),
        cpus_per_gpu=cpus_per_gpu,
    )
    if job.procs_per_node % job.tensor_parallel and job.nodes > 1:
        # Megatron runs it, but slowly: a tensor-parallel group (consecutive ranks) that does not
        # fit in one node, because it is wider or because the node's ranks do not divide by it.
        print(
            f"warning: topology.tensor_parallel {job.tensor_parallel} spans more than one node "
            f"({job.procs_per_node} ranks each): every layer's collectives cross the network",
            file=sys.stderr,
        )
    if dry_run:
        sys.stdout.write(render(job))
        return
    ids = submit(job, chain=chain, dependency=dependency)
    for job_id in ids:
        print(job_id)
    print(
        f"submitted {job.name}: {' -> '.join(ids)}, {job.nodes} node(s) x {job.procs_per_node} "
        f"rank(s); run {job.run_dir}; log {str(job.output).replace('%j', ids[0])}",
        file=sys.stderr,
    )


def _launcher(name: str) -> Launcher:
    if name not in ("torchrun", "srun"):
        raise typer.BadParameter(f"{name!r}: choose torchrun or srun", param_hint="--launcher")
    return name  # type: ignore[return-value]
