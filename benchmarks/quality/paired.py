"""Paired differences over seeds, as the quality notes report them.

Runs of one seed share their clients and (before the public stage) their noise draws, so the
per-seed difference removes most of the seed-to-seed spread. A difference is reported as its
mean, a 95% t-interval from the sample sd (ddof = 1, n - 1 degrees of freedom), and how many
seeds went each way, counted exactly: "4 of 5" is never rounded to "every seed".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpfleet.coordinator.sweep import t_interval


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Summary of a - b over paired seeds (same order)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = len(d)
    if n == 0:
        raise ValueError("no paired seeds")
    mean = float(d.mean())
    half = t_interval([float(x) for x in d])[1]  # the sweeps' 95% interval: one definition
    half = math.nan if half is None else half
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half],
            "up": int((d > 0).sum()), "down": int((d < 0).sum()), "tied": int((d == 0).sum())}


def format_difference(s: dict, digits: int = 2) -> str:
    """'+0.12 [-0.34, +0.58], 3 up / 2 down of 5' (the interval only when n > 1)."""
    f = f"{{:+.{digits}f}}"
    text = f.format(s["mean"])
    if s["n"] > 1:
        text += f" [{f.format(s['ci95'][0])}, {f.format(s['ci95'][1])}]"
    counts = f"{s['up']} up / {s['down']} down"
    if s["tied"]:
        counts += f" / {s['tied']} tied"
    return f"{text}, {counts} of {s['n']}"
