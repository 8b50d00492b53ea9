"""``fp8ops preflight``: the production launch checklist, item by item, with evidence.

``results`` (the items, findings, verdicts), ``target`` (a manifest file or a run directory),
``checks`` (the items that read records: 1, 2, 3, 6, 7), ``rehearsal`` (the items that train:
4, 5, 8, 9), ``checklist`` (running them in order), ``cli`` (the command). See docs/preflight.md.
"""
