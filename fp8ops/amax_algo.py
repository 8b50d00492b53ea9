"""The names of amax compute algorithms (``precision.amax_compute_algo``) and their parser.

Outside ``fp8ops.precision`` on purpose: the manifest validates these names, and loading a
manifest must not import torch (a drifted resume is refused before torch loads). The algorithms
themselves run in ``fp8ops.precision.scaling``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ALLOWED_ALGOS = "'max', 'most_recent', 'quantile:Q' (0 < Q <= 1) or 'trimmed_max:K' (K >= 1)"


@dataclass(frozen=True)
class AmaxAlgo:
    """A parsed ``amax_compute_algo``.

    ``kind`` is "max" or "most_recent" (TE's fused kernel) or "quantile" / "trimmed_max"
    (window statistics on TE's callable path).
    """

    name: str
    kind: str
    q: float | None = None
    k: int | None = None

    @property
    def fused(self) -> bool:
        """True when TE would run this algorithm in its fused kernel."""
        return self.kind in ("max", "most_recent")


def parse_amax_algo(name: str) -> AmaxAlgo:
    """Parse an ``amax_compute_algo`` name, raising ``ValueError`` naming what is allowed."""
    if not isinstance(name, str):
        raise ValueError(f"must be a string: {_ALLOWED_ALGOS}")
    if name in ("max", "most_recent"):
        return AmaxAlgo(name=name, kind=name)
    quantile = re.fullmatch(r"quantile:([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", name)
    if quantile:
        q = float(quantile.group(1))
        if not 0.0 < q <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        return AmaxAlgo(name=name, kind="quantile", q=q)
    trimmed = re.fullmatch(r"trimmed_max:([0-9]+)", name)
    if trimmed:
        k = int(trimmed.group(1))
        if k < 1:
            raise ValueError(f"trimmed_max needs K >= 1, got {k}")
        return AmaxAlgo(name=name, kind="trimmed_max", k=k)
    raise ValueError(f"unknown amax_compute_algo {name!r}; allowed: {_ALLOWED_ALGOS}")
