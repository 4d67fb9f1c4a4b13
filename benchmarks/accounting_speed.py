"""Speed of the exact tree-sensitivity DP: every row of paper 002 Tables 1-2 and stress cases.

Each case is timed cold (the result cache cleared), best of `--repeat` runs. The issue's bar:
the slowest Table 1 row (pt-BR, T = 3600) within 2 s. Saves results/accounting_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from dpfleet.coordinator.mechanisms.tree_sensitivity import _sensitivity, tree_sensitivity_squared

# (label, rounds, MaxP, MinS)
TABLE1 = [("de-DE", 930, 4, 212), ("en-GB", 980, 4, 226), ("fr-FR", 1280, 5, 180),
          ("it-IT", 1620, 5, 303), ("pt-PT", 530, 8, 54), ("es-ES", 1900, 3, 526),
          ("es-ES*", 1750, 4, 349), ("en-US", 2800, 7, 371), ("en-US*", 1360, 2, 622),
          ("pt-BR", 3600, 3, 909), ("en-IN", 1290, 6, 170), ("es-MX", 1980, 5, 343),
          ("es-AR", 640, 5, 90)]
TABLE2 = [("OTF de-DE", 1170, 5, 206), ("OTF fr-FR", 1300, 4, 290), ("OTF ru-RU", 870, 3, 327),
          ("OTF pt-PT", 430, 7, 54)]
STRESS = [("every round", 4096, 4096, 0), ("MinS 1", 4096, 2048, 1), ("MinS 4", 3000, 600, 4),
          ("MinS 9", 10000, 1000, 9), ("MinS 99", 10000, 100, 99), ("MinS 4999", 20000, 4, 4999)]


def time_case(rounds: int, maxp: int, mins: int, nodes: str, repeat: int) -> tuple[int, float]:
    best = float("inf")
    for _ in range(repeat):
        _sensitivity.cache_clear()
        start = time.perf_counter()
        s = tree_sensitivity_squared(rounds, maxp, mins, nodes=nodes)
        best = min(best, time.perf_counter() - start)
    return s, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                              / "accounting_speed.json"))
    args = parser.parse_args()
    rows = []
    for group, cases in (("table1", TABLE1), ("table2", TABLE2), ("stress", STRESS)):
        for label, rounds, maxp, mins in cases:
            for nodes in ("all", "prefix"):
                s, seconds = time_case(rounds, maxp, mins, nodes,
                                       1 if group == "stress" else args.repeat)
                rows.append({"group": group, "case": label, "rounds": rounds, "max_participation":
                             maxp, "min_separation": mins, "nodes": nodes,
                             "sensitivity_squared": s, "seconds": round(seconds, 4)})
                print(f"{group:7} {label:12} T={rounds:<6} MaxP={maxp:<5} MinS={mins:<5} "
                      f"{nodes:6} S={s:<10} {seconds * 1e3:9.1f} ms", flush=True)
    table1 = [r for r in rows if r["group"] == "table1" and r["nodes"] == "all"]
    slowest = max(table1, key=lambda r: r["seconds"])
    pt_br = next(r for r in table1 if r["rounds"] == 3600)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "table1_total_seconds": round(sum(r["seconds"] for r in table1), 4),
        "table1_slowest": slowest,
        "pt_br_T3600_seconds": pt_br["seconds"],
        "pt_br_within_2s": pt_br["seconds"] <= 2.0,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"pt-BR (T=3600): {pt_br['seconds'] * 1e3:.1f} ms; Table 1 total "
          f"{result['table1_total_seconds'] * 1e3:.1f} ms; wrote {out}")


if __name__ == "__main__":
    main()
