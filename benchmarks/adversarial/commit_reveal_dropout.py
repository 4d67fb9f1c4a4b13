"""Issue 22, hole 3: a device that commits to its graph-seed randomness and then vanishes (or a
dishonest device that does so on purpose) aborted the whole SecAgg attempt on old main. Now up
to d committed devices may go unrevealed (any number on the complete graph); the price is that
a server withholding reveals chooses among G graphs, which the plan pays for in c.

Both rows are computed live: the probe below runs under this interpreter and under old main's
(`/work/basevenv/bin/python`, whose dpfleet is /work/base), from a neutral directory so that
neither picks up the other's package; the grinding measurement uses tests/reveal_grinding.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD_PYTHON = Path("/work/basevenv/bin/python")

# Runs on old and new main alike (d is passed only where RoundSetup has it).
PROBE = r"""
import json
import numpy as np
from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.errors import SecAggError
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.messages import SERVER, KeyBroadcast, SeedCommitments, decode, encode
from dpfleet.secagg.params import RoundSetup, graph_seed
from dpfleet.secagg.policy import ClientPolicy

D = 2
def setup(n, k, t, c):
    extra = {"unrevealed": D} if "unrevealed" in RoundSetup.__dataclass_fields__ else {}
    return RoundSetup(n=n, k=k, threshold=t, length=32, bits=16, corrupt=c, **extra)

out = {"d": D if "unrevealed" in RoundSetup.__dataclass_fields__ else 0, "rounds": {}}
for name, s, gone in (("harary", setup(40, 8, 6, 2), {3, 17}), ("complete", setup(12, 11, 7, 2), {1, 4, 9})):
    inputs = np.random.default_rng(5).integers(0, 1 << 16, (s.n, 32)).astype(np.uint16)
    report = run_round(s, inputs.__getitem__, dropouts={"advertise": gone}, raise_on_abort=False)
    row = {"n": s.n, "k": s.k, "t": s.threshold, "non_revealers": len(gone),
           "aborted": report.aborted is not None, "reason": str(report.aborted or "")[:90]}
    if report.aborted is None:
        expected = inputs[list(report.survivors)].astype(np.int64).sum(axis=0) % (1 << 16)
        row["survivors"] = len(report.survivors)
        row["exact_sum"] = bool(np.array_equal(report.total.astype(np.int64), expected))
    out["rounds"][name] = row

# a server forwards the reveals of all committed clients but one (and the adverts of the
# target's neighbours in the graph that gives): does a real client take it?
s = setup(40, 8, 6, 2)
ctx = s.setup_hash
clients = [SecAggClient(s, u, policy=ClientPolicy.lenient()) for u in range(s.n)]
commits = [decode(c.start()[0].data) for c in clients]
fixed = tuple(sorted((m.sender, m.commitment) for m in commits))
wires = {u: clients[u].handle(encode(SeedCommitments(ctx, SERVER, u, fixed)))[0].data
         for u in range(s.n)}
withheld = 5
reveals = tuple((u, decode(w).reveal) for u, w in sorted(wires.items()) if u != withheld)
around = s.graph(graph_seed(ctx, reveals)).neighbours(0)
blobs = tuple(wires[v] for v in sorted(around) if v != withheld)
try:
    clients[0].handle(encode(KeyBroadcast(ctx, SERVER, 0, reveals, blobs)))
    out["client_takes_one_withheld_reveal"], out["refusal"] = True, ""
except SecAggError as exc:
    out["client_takes_one_withheld_reveal"], out["refusal"] = False, f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe(python: str) -> dict:
    """The probe's findings under `python` (run from a temporary directory, isolated mode)."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([python, "-I", "-c", PROBE], cwd=cwd, capture_output=True,
                              text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def grinding(trials: int = 1000) -> dict:
    """A server grinding over which (at most d = 2) reveals to withhold, n = 40, k = 6, 20%
    colluders: how often it puts more than c corrupt neighbours around the target, for c sized
    for one graph (2^-4) and for all G graphs (2^-(4 + log2 G)), against the union bound."""
    sys.path.insert(0, str(ROOT / "tests"))
    from reveal_grinding import exceed_rates, grind, slack

    from dpfleet.secagg.graph import choice_bits, corrupt_bound

    n, k, gamma, d, sigma = 40, 6, 0.2, 2, 4.0
    result = grind(n, k, gamma, d, trials, seed=11)
    rates = {row["c"]: row for row in exceed_rates(result)}
    c_one = corrupt_bound(k, 1, gamma, sigma)
    c_all = corrupt_bound(k, 1, gamma, sigma + choice_bits(n - 1, d))
    return {"n": n, "k": k, "colluder_fraction": gamma, "d": d, "graphs_to_choose": result["graphs"],
            "trials": trials, "c_sized_for_one_graph": c_one, "c_sized_for_all": c_all,
            "grinder_rate_above_c_one": rates[c_one]["grinder_rate"],
            "honest_rate_above_c_one": rates[c_one]["honest_rate"],
            "grinder_rate_above_c_all": rates[c_all]["grinder_rate"],
            "union_bound_at_c_all": rates[c_all]["union_bound"],
            "expected_rate_above_c_all": expected_rate(n - 1, k, gamma, c_all, result["graphs"]),
            "sampling_slack": slack(rates[c_all]["union_bound"], trials)}


def expected_rate(others: int, k: int, gamma: float, c: int, graphs: int) -> float:
    """The grinder's exact success rate if its candidate graphs are independent: each puts a
    uniform k-subset of the others around the target; m of them collude w.p. Bin(others, gamma)."""
    total = 0.0
    for m in range(others + 1):
        above = sum(math.comb(m, j) * math.comb(others - m, k - j)
                    for j in range(c + 1, k + 1)) / math.comb(others, k)
        total += (math.comb(others, m) * gamma**m * (1 - gamma) ** (others - m)
                  * (1 - (1 - above) ** graphs))
    return total


def run() -> list[dict]:
    now = probe(sys.executable)
    old = probe(str(OLD_PYTHON)) if OLD_PYTHON.exists() else None
    if old is None:
        raise SystemExit(f"{OLD_PYTHON} is missing: old main's behaviour cannot be measured")
    measured = grinding()
    beaten = measured["grinder_rate_above_c_all"] > (measured["union_bound_at_c_all"]
                                                     + measured["sampling_slack"])
    return [
        {"name": "commit_reveal_dropout",
         "succeeded_on_old_main": any(r["aborted"] for r in old["rounds"].values()),
         "succeeds_now": any(r["aborted"] for r in now["rounds"].values()),
         "value": {"old_main": old["rounds"], "now": now["rounds"], "d_now": now["d"]}},
        {"name": "reveal_withholding_grinding",
         # old main gave the server no choice: a withheld reveal made every client refuse
         "succeeded_on_old_main": old["client_takes_one_withheld_reveal"],
         "succeeds_now": beaten,
         "value": {"old_main_client_takes_a_withheld_reveal": old["client_takes_one_withheld_reveal"],
                   "old_main_refusal": old["refusal"],
                   "now_client_takes_a_withheld_reveal": now["client_takes_one_withheld_reveal"],
                   **measured}},
    ]


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
