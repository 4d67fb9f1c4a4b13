"""An upper bound on the tree's worst-case S in one pass over its levels, for plans at scale.

Why: the exact dynamic program (`tree_sensitivity`) grows fast with MaxP and MinS. At a
production size (10^5 rounds) it took 4.4 s at MaxP 1,000, 76 s at 4,000 and 242 s at 7,693, and
`dpfleet plan -N 1e6 -T 1e5` has rows up to MaxP 25,000: the planner hung. A plan only needs the
noise that meets its target, and a larger S only makes that noise larger (the plan more private
than its target), so above `EXACT_MAX_PARTICIPATION` the planner plans on this bound and says so.

The bound. S(pattern) is the sum over levels h of the sum over the released nodes n at level h of
c_n^2, c_n the device's participations inside n (`tree_sensitivity`'s docstring). The nodes of one
level are disjoint blocks of 2^h rounds, so for every pattern with at most P participations at
least MinS + 1 rounds apart:

    c_n <= cap_h = min(P, ceil(2^h / (MinS + 1)))   and   sum over n of c_n <= P.

Over that polytope the convex sum of c_n^2 is largest at a vertex: as many nodes full as P allows
(q = min(nodes_h, P // cap_h)) and one more holding the rest r, so the level gives at most
q cap_h^2 + r^2. The worst pattern's S is at most the sum of these levels' maxima. It is exact at
MaxP 1, and at the large MaxP where the solver is slow it is within 1% of the exact S: at the
rows of a plan for N 10^6, T 10^5 it was 1.0000x to 1.0071x the S of the densest pattern, a lower
bound on the exact S (1.0011x at MinS 12, MaxP 7,693; 1.0071x at MinS 62, MaxP 1,588). At small
MaxP it is 2-5% above (up to 1.7x at a few rounds), where the exact program is fast and used.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfleet.coordinator.mechanisms.tree_sensitivity import tree_pieces, validate_arguments

# the planner's switch: the exact program up to this MaxP (4.4 s at 10^5 rounds), the bound above
EXACT_MAX_PARTICIPATION = 1000


def level_nodes(pieces: Sequence[tuple[int, int]], level: int, nodes: str) -> int:
    """Released nodes at `level` of the forest: every dyadic block ("all"), or only the left
    children and the roots ("prefix")."""
    count = 0
    for _, height in pieces:
        if height > level:
            count += 1 << (height - level - (nodes == "prefix"))
        elif height == level:
            count += 1
    return count


def tree_sensitivity_bound(rounds: int, max_participation: int = 1, min_separation: int | None = None,
                           restarts: Sequence[int] | None = None, *, nodes: str = "all") -> int:
    """An upper bound on `tree_sensitivity_squared` with the same arguments (module docstring)."""
    rounds, max_participation, min_separation = validate_arguments(rounds, max_participation,
                                                                   min_separation, nodes)
    gap = min_separation + 1
    most = min(max_participation, -(-rounds // gap))  # what MinS allows over the rounds
    pieces = tree_pieces(rounds, restarts)
    total = 0
    for level in range(max(h for _, h in pieces) + 1):
        cap = min(most, -(-(1 << level) // gap))
        count = level_nodes(pieces, level, nodes)
        full = min(count, most // cap)
        rest = min(most - full * cap, cap) if full < count else 0
        total += full * cap * cap + rest * rest
    return total
