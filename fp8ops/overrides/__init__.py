"""Per-layer BF16 overrides through a reviewed, append-only, hash-chained ledger.

Reading order: ``ledger`` (:class:`Ledger` over ``RUN_DIR/overrides.jsonl``: the records, the
state machine, the review rule), ``anchors`` (what a read is held to: the run's revisions and
the ledger's length as its checkpoints saw them), ``chain`` (the file format: sha256-chained
JSON lines and how tampering shows), ``signing`` (SSH-signed records), ``te_debug`` (the overrides as a Transformer Engine debug-API config), ``cli``
(``fp8ops overrides ...``). See ``docs/overrides.md``.

Nothing here imports torch or Megatron.
"""

import importlib

# Loaded on first use (PEP 562): `fp8ops.overrides.cli` is imported by every `fp8ops` command to
# register its sub-commands, and the ledger's own imports (alerts, layers.json) cost a third of
# a second that commands such as a drifted resume's refusal should not pay.
_WHERE = {
    "ALERT_ENGINE": "ledger",
    "LEDGER": "ledger",
    "Ledger": "ledger",
    "LedgerError": "ledger",
    "Override": "ledger",
    "OverrideError": "ledger",
    "Status": "ledger",
    "Trigger": "ledger",
    "default_user": "ledger",
    "te_debug_yaml": "te_debug",
}
__all__ = [
    "ALERT_ENGINE",
    "LEDGER",
    "Ledger",
    "LedgerError",
    "Override",
    "OverrideError",
    "Status",
    "Trigger",
    "default_user",
    "te_debug_yaml",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
