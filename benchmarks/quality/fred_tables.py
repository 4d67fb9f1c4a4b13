"""Markdown tables for FRED.md from fred_quality_<embedder>.json and fred_training.json.

    python benchmarks/quality/fred_tables.py --embedder glove
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import scipy.stats

HERE = Path(__file__).parent


def ci(values) -> str:
    v = np.asarray(values, np.float64)
    half = scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else np.nan
    return f"{v.mean():+.4f} ± {half:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embedder", default="glove")
    args = ap.parse_args()
    q = json.loads((HERE / f"fred_quality_{args.embedder}.json").read_text())
    print("| candidate | non-private FD | DP FreD user level | DP FreD sample level |")
    print("|---|---|---|---|")
    for cand, row in q["table1"].items():
        u, s = row["dp_user"], row["dp_sample"]
        print(f"| {cand} | {row['non_private']:.4f} | {u['mean']:.4f} ± {u['ci95']:.4f} | "
              f"{s['mean']:.4f} ± {s['ci95']:.4f} |")
    print()
    ys = list(q["fig2"]["non_private"]["by_y"])
    print("| Y | " + " | ".join(ys) + " |")
    print("|---|" + "---|" * len(ys))
    for key, f in q["fig2"].items():
        cells = [f"{f['by_y'][y]['mean']:.3f}±{f['by_y'][y]['ci95']:.3f}" for y in ys]
        print(f"| {key} | " + " | ".join(cells) + " |")
    print()
    for key, f in q["fig2"].items():
        d = f["diff_99_minus_100"]
        print(f"- {key}: mean strictly decreasing {f['mean_strictly_decreasing']}, trials strictly "
              f"decreasing {f['trials_strictly_decreasing']}/{d['n']}, Spearman per trial "
              f"{min(f['spearman_per_trial']):.3f}..{max(f['spearman_per_trial']):.3f}; FreD(99) - FreD(100) "
              f"= {d['mean']:+.4f} ± {d['ci95']:.4f}; max(100) < min(99): "
              f"{f['paper_criterion_max100_below_min99']}")
    path = HERE / "fred_training.json"
    if not path.is_file():
        return
    t = json.loads(path.read_text())
    acc = {}
    for r in t["rows"]:
        acc.setdefault(r["candidate"], {})[r["seed"]] = 100 * r["accuracy"]
    seeds = sorted(set.intersection(*(set(v) for v in acc.values())))
    print(f"\nseeds {seeds}; setting {t['setting']}; machine {t['machine']}")
    print("| pre-trained on | accuracy % (mean ± 95% CI) |")
    print("|---|---|")
    for cand, v in acc.items():
        print(f"| {cand} | {ci([v[s] for s in seeds])} |")
    print("\n| paired difference (pp) | mean ± 95% CI |")
    print("|---|---|")
    for a, b in itertools.combinations(acc, 2):
        print(f"| {b} - {a} | {ci([acc[b][s] - acc[a][s] for s in seeds])} |")


if __name__ == "__main__":
    main()
