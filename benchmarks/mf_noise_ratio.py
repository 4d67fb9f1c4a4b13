"""Noise of optimised BLT and banded strategies relative to dpfleet's online binary tree.

For a mechanism with prefix-sum decoder B and sensitivity sens (in clip-norm units), rho-zCDP needs
noise std sigma = sens / sqrt(2 rho) per z coordinate, so the noise std on prefix sum t is
sens * ||B_t|| / sqrt(2 rho). The ratio sqrt(loss_mf / loss_tree), loss = error * sens^2 with
error the max ("max") or mean ("mean", RMSE^2) over rounds of ||B_t||^2, is therefore the ratio of
the effective noise multipliers on the released prefix sums at equal zCDP (independent of rho).
The tree's sens^2 is `tree_sensitivity_squared` with nodes "all" (dpfleet account's default) and
"prefix" (exact for the streaming tree); participation: separation `gap` (MinS = gap - 1), at most
k = ceil(n / gap) participations (the most the separation allows), plus the planner's choice from
issue 23 (60 rounds, MinS 2, MaxP 15) and a few capped k (MaxP below the separation's limit).
Writes benchmarks/results/mf_noise_ratio.json.
Run: OMP_NUM_THREADS=1 python benchmarks/mf_noise_ratio.py
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from dpfleet.coordinator.mechanisms.mf_optimize import optimize_banded, optimize_blt, tree_loss

OUT = Path(__file__).resolve().parent / "results" / "mf_noise_ratio.json"


def main() -> None:
    grid = [(n, gap, math.ceil(n / gap)) for n in (60, 120, 2000) for gap in (1, 3, 10)]
    grid.insert(1, (60, 3, 15))
    # participation capped below what the separation allows (the timers' MaxP), Gboard-like MinS
    grid += [(120, 10, 6), (2000, 10, 20), (2000, 100, 20), (2000, 100, 5)]
    rows = []
    load_before = os.getloadavg()
    for n, gap, k in grid:
        row = {"n": n, "gap": gap, "min_separation": gap - 1, "k": k}
        t0 = time.perf_counter()
        for reduction in ("max", "mean"):
            tree_all = tree_loss(n, gap, k, reduction, nodes="all")
            tree_prefix = tree_loss(n, gap, k, reduction, nodes="prefix")
            blt = min((optimize_blt(n, gap, k, buffers=d, reduction=reduction) for d in (1, 2, 3, 4)),
                      key=lambda r: r.loss)
            band = optimize_banded(n, gap, k, reduction=reduction)
            row[reduction] = {
                "tree_loss_all": tree_all, "tree_loss_prefix": tree_prefix,
                "blt_loss": blt.loss, "blt_buffers": len(blt.params["theta"]), "blt": blt.params,
                "banded_loss": band.loss, "bands": len(band.params["coef"]),
                "blt_vs_tree_all": math.sqrt(blt.loss / tree_all),
                "blt_vs_tree_prefix": math.sqrt(blt.loss / tree_prefix),
                "banded_vs_tree_all": math.sqrt(band.loss / tree_all),
                "banded_vs_tree_prefix": math.sqrt(band.loss / tree_prefix),
            }
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        m, a = row["max"], row["mean"]
        print(f"n={n:5d} gap={gap:2d} k={k:4d}  noise ratio vs tree(all/prefix): "
              f"BLT max {m['blt_vs_tree_all']:.3f}/{m['blt_vs_tree_prefix']:.3f} "
              f"rmse {a['blt_vs_tree_all']:.3f}/{a['blt_vs_tree_prefix']:.3f} ({m['blt_buffers']} buf); "
              f"banded({m['bands']}) max {m['banded_vs_tree_all']:.3f}/{m['banded_vs_tree_prefix']:.3f} "
              f"rmse {a['banded_vs_tree_all']:.3f}/{a['banded_vs_tree_prefix']:.3f}  "
              f"[{row['seconds']:.1f} s]")
    result = {"threads": os.environ.get("OMP_NUM_THREADS"), "load_before": load_before,
              "load_after": os.getloadavg(), "rows": rows}
    OUT.write_text(json.dumps(result, indent=1, allow_nan=False))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
