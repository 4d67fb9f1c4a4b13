"""Epsilon of DP-FTRL when every device participates at most once.

For single participation, `dp-accounting` has the exact piece: the RDP of one epoch of tree
aggregation (`SingleEpochTreeAggregationDpEvent`, Kairouz et al. 2021) under the
replace-one ("special") neighbouring relation. This reproduces paper 000's figures
(T = 1600, delta = 1e-6: z = 8.83 -> eps 1.77; z = 1.13 -> eps 18.71).
"""

from __future__ import annotations

import math

import dp_accounting
from dp_accounting import rdp


def single_participation_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """(eps, delta)-DP of `rounds` tree-aggregation steps, each device in at most one."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    event = dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier, rounds)
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(event)
    return float(acc.get_epsilon(delta))
