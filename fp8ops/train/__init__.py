"""Training: ``fp8ops train`` (``trainer.py``) and the parts it is built from.

Reading order: ``trainer`` (the command and the loop), ``distributed`` (process groups),
``optimizer`` (float32 main weights, clipping, the learning-rate schedule), ``weights`` (the base
checkpoint a run starts from and the weights it ends with), ``run_dir`` (what a run writes),
``environment`` (versions recorded with a run).
"""

from fp8ops.train.launch import resume_training, run_training

__all__ = ["resume_training", "run_training"]
