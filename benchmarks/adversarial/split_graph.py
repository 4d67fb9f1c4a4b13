"""Split graph views: a server shows the target's neighbourhood a masking graph from one reveal
(or commitment) list and the other honest clients another, then plays who holds and who masks
with what per view to read the target's input (tests/split_graph.py: n = 40, k = 6, t = 5,
c = 2 colluding neighbours of the target; the REAL client state machines).

Both sides are computed live by running tests/split_graph.py as a script: under this
interpreter, and under old main's (`/work/basevenv/bin/python`, whose dpfleet is /work/base)
from a neutral directory in isolated mode, so neither picks up the other's package. Old main
has no d (no reveal may be missing), so there the split is by commitment lists; now both. The
attack "succeeds" when the estimate beats chance on the target's input with c colluders; the
t-colluder run (beyond the threat model) is the positive control that it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD_PYTHON = Path("/work/basevenv/bin/python")
SCRIPT = ROOT / "tests" / "split_graph.py"
CHANCE = 0.05  # share of 64 coordinates guessed right by luck is ~2^-16


def attack_runs(python: str) -> dict:
    """{"n", "k", "t", "c", "runs": {split/colluders/lists: result}} (tests/split_graph.py)."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([python, "-I", str(SCRIPT)], cwd=cwd, capture_output=True,
                              text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(runs: dict) -> dict:
    keep = ("views_differ", "group_sizes", "self_mask_seed_shares", "self_mask_seed_rebuilt",
            "masks_removed", "masks_in_y", "match_fraction", "exact")
    return {name: {k: run[k] for k in keep} for name, run in runs.items()}


def _succeeded(runs: dict, colluders: int) -> bool:
    return any(run["match_fraction"] > CHANCE for name, run in runs.items()
               if run["views_differ"] and name.split("/")[1] == str(colluders))


def run() -> list[dict]:
    if not OLD_PYTHON.exists():
        raise SystemExit(f"{OLD_PYTHON} is missing: old main's behaviour cannot be measured")
    now_out, old_out = attack_runs(sys.executable), attack_runs(str(OLD_PYTHON))
    c, t = now_out["c"], now_out["t"]
    now, old = now_out["runs"], old_out["runs"]
    return [{
        "name": "split_graph_view",
        "succeeded_on_old_main": _succeeded(old, c),
        "succeeds_now": _succeeded(now, c),
        "value": {"n": now_out["n"], "k": now_out["k"], "threshold": t, "colluders": c,
                  "positive_control_t_colluders_now": _succeeded(now, t),
                  "positive_control_t_colluders_old_main": _succeeded(old, t),
                  "now": _summary(now), "old_main": _summary(old)},
    }]


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
