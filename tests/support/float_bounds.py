"""How far apart two computations of one float may land when they add the same terms in another
order: for tests comparing a norm computed from pieces (data-parallel slices, pipeline stages)
with the same norm computed whole, where equality would hold on one machine's kernels and not
on another's."""

from __future__ import annotations

UNIT_ROUNDOFF = 2.0**-53  # float64's: a rounded operation is within this, relatively


def reordered_norm_rel_tol(terms: int) -> float:
    """The relative tolerance for two L2 norms of the same ``terms`` float32 values, each the
    square root of a float64 sum of their squares added in an order of its own (fp8ops'
    ``global_norm`` and the distributed optimizer's norm).

    The squares are exact in float64 (24 significant bits, squared). A sum of n non-negative
    terms, added in any order, lies within (n - 1) u / (1 - (n - 1) u) of the exact sum, u the
    unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, section 4.2); two such
    sums lie within twice that of each other, and the square root halves a relative difference
    and rounds once more. 2 n u bounds it all: a worst case that no order of additions exceeds,
    and still far below what a norm missing or counting twice any gradient would show.
    """
    return 2 * terms * UNIT_ROUNDOFF
