"""Launching training on clusters: SLURM jobs that checkpoint, requeue and resume by themselves.

The batch script is ``launchers/train.sbatch`` (docs/slurm.md); :mod:`fp8ops.launch.slurm`
renders it for a manifest and submits it (``fp8ops launch slurm``). No torch needed.
"""

from fp8ops.launch.slurm import LaunchError, SlurmJob, parse_time_limit, plan_job, render, submit

__all__ = ["LaunchError", "SlurmJob", "parse_time_limit", "plan_job", "render", "submit"]
