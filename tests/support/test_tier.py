"""Which tier of the suite runs: the fast one (``FP8OPS_TEST_TIER=fast``, which
``ci/test.sh --fast`` sets beside ``-m "not slow"``) or the full suite (anything else; CI's).

Property tests take their example counts from :func:`examples`, so the fast tier runs a tenth of
each and the full suite every one."""

from __future__ import annotations

import os

FAST = os.environ.get("FP8OPS_TEST_TIER") == "fast"


def examples(full: int) -> int:
    """Hypothesis' ``max_examples`` for a property test whose full count is ``full``."""
    return max(20, full // 10) if FAST else full
