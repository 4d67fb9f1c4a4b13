"""Behaviour before / after issue 31's privacy core: the same released models and eps, bit for bit.

Why: the refactor that put every mechanism behind one object and every privacy figure behind one
accountant must not change what a run releases or claims. This runs a small grid, tree / banded /
blt x plain / secagg x fixed / adaptive clipping, in research mode (`dp.noise_seed`, so the noise
is the same across code versions), and records for each run the hash of every released model (the
release log's `released`), the final checkpoint's theta hash, and privacy.json's zCDP and eps.
Run it on two commits ON ONE MACHINE (another CPU gives other float bits, and another optimised
BLT strategy, on both sides alike) and compare the JSON files. An old commit runs from a worktree
laid out as installed (the docs hook's `package_tree`), first on PYTHONPATH and as the cwd:

    git worktree add --detach /tmp/old OLD_COMMIT
    python3 -c "import runpy, pathlib; runpy.run_path('docs/_hooks/package_tree.py')['package_tree'](
        pathlib.Path('/tmp/old'), pathlib.Path('/tmp/old_pkg'))"
    cd /tmp/old_pkg && PYTHONPATH=$PWD python3 "$OLDPWD/benchmarks/privacy_core_parity.py" --label before
    cd -
    python3 benchmarks/privacy_core_parity.py --label after
    python3 benchmarks/privacy_core_parity.py --compare before after

A difference is printed per run and field; the exit status is 1 when any differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
BASE = {
    "rounds": 6, "eval_every": 6, "seed": 7, "checkpoint_every": 2,
    "data": {"dataset": "shakespeare", "max_clients": 40, "eval_examples": 60, "max_examples": 8},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 8},
    "participation": {"mode": "uniform", "min_separation": 1, "max_participation": 2},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "noise_seed": 11,
           "clip_count_stddev": 2.0, "momentum": 0.9},
}
FIELDS = ("zcdp", "epsilon", "epsilon_rdp", "sensitivity_squared", "min_separation",
          "max_participation", "noise_mechanism")


def grid() -> list[tuple[str, dict]]:
    out = []
    for mechanism in ("tree", "banded", "blt"):
        for aggregation in ("plain", "secagg"):
            for adaptive in (False, True):
                name = f"{mechanism}-{aggregation}-{'adaptive' if adaptive else 'fixed'}"
                cfg = json.loads(json.dumps(BASE))
                cfg["dp"].update(mechanism=mechanism, adaptive_clipping=adaptive)
                cfg["aggregation"] = {"kind": aggregation}
                out.append((name, cfg))
    return out


def run_one(cfg: dict, out: Path) -> dict:
    from safetensors.numpy import load_file

    from dpfleet.coordinator.config import parse_config

    try:
        from dpfleet.coordinator.engine.simulation import run_simulation
    except ImportError:  # a commit before coordinator/ had subpackages (the "before" side)
        from dpfleet.coordinator.simulation import run_simulation

    result = run_simulation(parse_config(cfg), out, progress=False, log=lambda s: None)
    releases = [json.loads(line) for line in (out / "releases.jsonl").read_text().splitlines()
                if line.strip()]
    theta = load_file(str(out / "checkpoint" / "server_state.safetensors"))["theta"]
    privacy = result.privacy
    return {"released": [r["released"] for r in releases if "released" in r],
            "final_theta_sha256": hashlib.sha256(theta.tobytes()).hexdigest(),
            "metrics_epsilon": [m["epsilon"] for m in result.metrics],
            **{k: privacy.get(k) for k in FIELDS}}


def machine() -> dict:
    """Float bits (and an optimised BLT strategy) differ between CPUs: compare runs of one machine."""
    import dpfleet.coordinator

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return {"cpu": cpu, "code": str(Path(dpfleet.coordinator.__file__).parent)}


def measure(label: str) -> Path:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in grid():
            t0 = time.perf_counter()
            rows[name] = run_one(cfg, Path(tmp) / name)
            print(f"{name:28s} eps {rows[name]['epsilon']:.6g}  theta {rows[name]['final_theta_sha256'][:12]}"
                  f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    path = RESULTS / f"privacy_core_parity_{label}.json"
    path.write_text(json.dumps({"config": BASE, "machine": machine(), "runs": rows}, indent=1))
    print(f"wrote {path}")
    return path


def compare(a: str, b: str) -> int:
    left, right = (json.loads((RESULTS / f"privacy_core_parity_{x}.json").read_text())["runs"]
                   for x in (a, b))
    differ = 0
    for name in left:
        for key in left[name]:
            if left[name][key] != right.get(name, {}).get(key):
                differ += 1
                print(f"{name}: {key} differs: {left[name][key]!r} vs {right.get(name, {}).get(key)!r}")
    print(f"{len(left)} runs, {differ} differing fields")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    measure(args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
