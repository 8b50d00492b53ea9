"""Training: ``fp8ops train`` and ``fp8ops resume``, and the parts a run is built from.

Reading order: ``startup`` (a start plan becomes ranks that train it), ``trainer`` (the loop),
``evaluation`` (held-out loss and capability between steps), ``degrade`` (what a Degrade alert
does: a proposal, or under a policy a switch to BF16), ``ending`` (the ways a run ends),
``inputs`` (tokenizer, data, capability items), ``optimizer`` (float32 main weights, clipping,
the learning-rate schedule), ``distributed_optimizer`` (the same, sharded over data parallel),
``distributed`` (process groups), ``signals`` (stop requests), ``progress`` (what a run
prints), ``cpu_gemm`` (bf16 GEMMs on CPUs without them), ``export`` (a checkpoint's weights as a
weights checkpoint), ``cli`` (the commands).

Only the command layer imports this package: the other packages read and write runs through
``fp8ops.run`` and decide how runs start in ``fp8ops.start``.

Attributes load on first use (PEP 562): every ``fp8ops`` command imports ``train.cli``.
"""

import importlib

__all__ = ["open_trainer", "resume_training", "run_training", "start"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.startup"), name)
