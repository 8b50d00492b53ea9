"""``fp8ops compare``: FP8 candidates judged against a reference run by release gates.

Reading order: ``comparison`` (:func:`~fp8ops.compare.comparison.compare`: load, judge,
write), ``runs`` (the inputs and one :class:`RunRecords` per run directory, comparability),
``layers`` (per-module telemetry summaries), ``gates`` (each gate, the worst bucket and layer,
the cause), ``verdict`` (the verdict record: verdict.json), ``report`` (report.html and the
PNGs), ``cli`` (the command). ``docs/compare.md`` explains the
gates and how to read a failure.

Nothing here imports torch or Megatron; nothing is imported by ``fp8ops --help`` but ``cli``.
"""
