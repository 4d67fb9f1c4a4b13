"""Model inconsistency (Pasquini et al., CCS 2022): the coordinator hands one device a crafted
model (with the setup that device expects for it) and the others the honest one, to read its
update out of the SecAgg sum. Run live over loopback with the real service, devices, signed
SecAgg and training (`tests/model_attacker.py`), now and on old main's real code
(`$DPFLEET_OLD_PYTHON`, default /work/basevenv/bin/python, whose dpfleet is old main; tests
from `$DPFLEET_OLD_TREE`, default /work/base). Without that environment, old main is stood in
for by the positive control (the model hash left out of the setup terms on both sides).

The attack succeeds when the committed sum minus the honest-model devices' updates is the
victim's update (to within the encoding's quantization bound)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
OLD_PYTHON = Path(os.environ.get("DPFLEET_OLD_PYTHON", "/work/basevenv/bin/python"))
OLD_TREE = Path(os.environ.get("DPFLEET_OLD_TREE", "/work/base"))
_RUN = """
import json, pathlib, sys, tempfile
sys.path[:0] = [{old_tests!r}, {tests!r}]  # old main's test helpers, then the attacker module
import torch
torch.set_num_threads(1)
from model_attacker import crafted_model_round
print(json.dumps(crafted_model_round(pathlib.Path(tempfile.mkdtemp()))))
"""


def _on_old_main() -> dict | None:
    if not OLD_PYTHON.exists() or not (OLD_TREE / "tests").is_dir():
        return None
    code = _RUN.format(old_tests=str(OLD_TREE / "tests"), tests=str(TESTS))
    done = subprocess.run([str(OLD_PYTHON), "-c", code], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"the attack on old main failed to run:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _succeeded(v: dict) -> bool:
    """The victim's update came out of the sum: residual = its update, to the rounding."""
    return bool(v.get("committed") and v.get("victim_in_survivors")
                and v["residual_minus_victim_norm"] <= v["bound"] < 1e-3 * v["victim_norm"])


def _shown(v: dict) -> dict:
    keys = ("victim_outcomes", "survivors", "victim_norm", "residual_norm",
            "residual_minus_victim_norm", "bound")
    return {k: v.get(k) for k in keys}


def run() -> list[dict]:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from model_attacker import crafted_model_round

    with tempfile.TemporaryDirectory() as root:
        now = crafted_model_round(Path(root) / "now")
        old, measured = _on_old_main(), "old main's code"
        if old is None:
            old, measured = crafted_model_round(Path(root) / "control", bind=False), \
                "positive control (model hash left out of the terms)"
    return [{
        "name": "model_inconsistency",
        "succeeded_on_old_main": _succeeded(old),
        "succeeds_now": _succeeded(now),
        "value": {"now": _shown(now), "old_main": _shown(old), "old_main_measured_by": measured,
                  "meaning": "residual = committed sum - honest-model devices' updates; the "
                             "attack reads the victim when residual - victim's update <= bound"},
    }]


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
