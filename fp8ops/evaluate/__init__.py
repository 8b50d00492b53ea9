"""Evaluation beyond the held-out loss (``docs/evaluation.md``).

* ``capability.py``: greedy answers to held-out task items, exact match per bucket (torch, and
  Megatron's schedule under pipeline parallelism);
* ``records.py``: what that writes to the run directory and how to read it back (no torch).

Nothing is imported here, so reading records never pulls in torch.
"""
