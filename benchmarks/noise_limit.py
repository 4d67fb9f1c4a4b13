"""Where the main job stops learning as the noise on each round's averaged update grows.

The main job (examples/shakespeare_cifg.toml: 1,277 Shakespeare clients, 20 rounds, pretrained
CIFG, clip 2, momentum 0.5) with only dp.target_epsilon changed: the planner keeps report goal
M = 319 and raises the noise multiplier z, so z / M (the noise std on a round's averaged update,
in clip norms) grows as eps shrinks. Held-out accuracy against the unigram baseline locates the
z / M at which a run learns nothing: `result_warnings.NOISE_PER_REPORT_LIMIT`, the plan-time
warning. One seed per point (fresh secret noise). Writes benchmarks/results/noise_limit.json.
Run: python benchmarks/noise_limit.py [EPS ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from dpfleet.coordinator.run import run
from dpfleet.coordinator.run_privacy.config_plan import load_run_config
from dpfleet.public.public_init import pretrain_on_public

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "noise_limit.json"
EPS = (2.0, 1.0, 0.7, 0.5, 0.3, 0.1, 0.03)


def measure(eps: float, out: Path) -> dict:
    cfg, plan = load_run_config(ROOT.parent / "examples" / "shakespeare_cifg.toml",
                                {"dp.target_epsilon": eps})
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = run(cfg, out, overwrite=True, progress=False, log=lambda s: None,
                 pretrain=pretrain_on_public, plan=plan)
    z, m = result.privacy["noise_multiplier"], result.privacy["report_goal"]
    return {"target_epsilon": eps, "noise_multiplier": z, "report_goal": m, "z_over_m": z / m,
            "accuracy": result.accuracy, "unigram_accuracy": result.unigram_accuracy,
            "perplexity": result.perplexity, "below_unigram": result.accuracy <= result.unigram_accuracy,
            "seconds": time.perf_counter() - start, "load_1min": load}


def main() -> None:
    eps = [float(e) for e in sys.argv[1:]] or list(EPS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(e, Path(tmp) / f"eps{e:g}") for e in eps]
    OUT.write_text(json.dumps({"rows": rows, "note": "one seed per point; main job config, "
                               "only dp.target_epsilon changed"}, indent=2) + "\n")
    for r in rows:
        print(f"eps {r['target_epsilon']:g}: z / M {r['z_over_m']:.4f}, accuracy {r['accuracy']:.4f} "
              f"(unigram {r['unigram_accuracy']:.4f})")


if __name__ == "__main__":
    main()
