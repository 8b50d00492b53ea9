"""Per-layer BF16 overrides through a reviewed, append-only, hash-chained ledger.

Reading order: ``ledger`` (:class:`Ledger` over ``RUN_DIR/overrides.jsonl``: the records, the
state machine, the review rule), ``chain`` (the file format: sha256-chained JSON lines and how
tampering shows), ``te_debug`` (the overrides as a Transformer Engine debug-API config), ``cli``
(``fp8ops overrides ...``). See ``docs/overrides.md``.

Nothing here imports torch or Megatron.
"""

from fp8ops.overrides.ledger import (
    ALERT_ENGINE,
    LEDGER,
    Ledger,
    LedgerError,
    Override,
    OverrideError,
    Status,
    Trigger,
    default_user,
)
from fp8ops.overrides.te_debug import te_debug_yaml

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
