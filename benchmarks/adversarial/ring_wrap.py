"""A dishonest SecAgg co-participant parks the ring sum at the signed wrap (issue 22, hole 1).

The malicious device (knowing every input but the target's, as the DP adversary may) chooses its
ring vector so that the others' sum is 2^(b-1) - 1 in every coordinate; the target's honest,
clipped update then carries each coordinate with q_j > 0 across the wrap. The attack "succeeds"
when the target moves what is released by more than the bound its noise is calibrated to:

- continuous Gaussian after decoding (old main's default with secagg): the release is the decoded
  sum, bound = the discretized sensitivity Delta_s / s; measured: the decoded jump (~2^b / s per
  crossed coordinate) and an attacker's hit rate telling "target in" from "target out";
- discrete Gaussian in the ring (the default now): the release is the ring value (sum + noise)
  mod 2^b, bound = Delta_s in modular L2 distance; measured: that distance, and the same
  attacker's hit rate against Phi(1 / (2 z)), the best any test can do at noise z.

The attack runs under whatever `aggregation.kind = "secagg"` gives by default, with the real
encoding, in-process SecAgg round and DP-FTRL server: on old main via /work/basevenv/bin/python
(dpfleet -> /work/base), now in this process.

    python benchmarks/adversarial/ring_wrap.py [--json]   # one world, this environment
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

BITS, DIM, CLIP, Z, CLIENTS, TRIALS = 32, 1024, 0.5, 1.0, 4, 400
OLD_PYTHON = Path("/work/basevenv/bin/python")


def _ring_distance(a: np.ndarray, b: np.ndarray) -> float:
    modulus = np.int64(1 << BITS)
    diff = (a.astype(np.int64) - b.astype(np.int64)) % modulus
    return float(np.linalg.norm(np.minimum(diff, modulus - diff).astype(np.float64)))


def measure() -> dict:
    """The attack under this environment's default noise for a secagg config (module docstring)."""
    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
    from dpfleet.coordinator.mechanisms import ring_noise
    from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise
    from dpfleet.secagg.encoding import Discretizer
    from dpfleet.secagg.inprocess import run_round
    from dpfleet.secagg.params import plan_round
    from dpfleet.secagg.sums import RingSum

    noise = parse_config({"aggregation": {"kind": "secagg"},
                          "dp": {"noise_multiplier": Z, "clip_norm": CLIP}}).dp.noise
    plan = ring_noise.plan_ring(DIM, CLIP, BITS, CLIENTS, Z, rounds=TRIALS, block_size=DIM)
    ring_clients = plan.ring_clients if noise == "discrete" else CLIENTS
    disc = Discretizer(DIM, CLIP, BITS, ring_clients, seed=9, block_size=DIM)
    rng = np.random.default_rng(3)
    enc = {}
    for u in (1, 2, 3):  # 1: the target, 2 and 3: honest
        x = rng.normal(size=DIM)
        enc[u] = disc.encode(CLIP * x / np.linalg.norm(x), np.random.default_rng([u, 1])).values
    modulus, top = 1 << BITS, (1 << (BITS - 1)) - 1
    others = enc[2].astype(np.int64) + enc[3].astype(np.int64)
    malicious = ((top - others) % modulus).astype(enc[2].dtype)  # others + malicious = top
    q = (enc[1].astype(np.int64) << (64 - BITS)) >> (64 - BITS)

    def ring_sum(target_in: bool) -> RingSum:
        def inputs(u: int) -> np.ndarray:
            if u == 0:
                return malicious
            return enc[u] if (u != 1 or target_in) else np.zeros_like(enc[1])

        setup, _, _ = plan_round(CLIENTS, disc.padded_length, BITS, "complete")
        return RingSum(run_round(setup, inputs).total, BITS, disc.decode)

    sums = {True: ring_sum(True), False: ring_sum(False)}
    cfg = DPFTRLConfig(noise_multiplier=Z, clip_norm=CLIP, report_goal=1, momentum=0.0,
                       sensitivity_factor=disc.norm_inflation)
    base = (sums[False].values.astype(np.int64) + 0) % modulus  # the attacker knows it
    hits = 0
    for trial in range(TRIALS):  # fresh noise each trial (another key); target in / out in turn
        key = bytes([trial % 256, trial // 256]) * 16
        target_in = trial % 2 == 0
        if noise == "discrete":
            residual = TreeNoise(plan.length, ring_noise.ring_nodes(plan, key)).next_residual()
            released = (sums[target_in].values.astype(np.int64) + residual) & (modulus - 1)
            shifted = (((released - base) % modulus) << (64 - BITS)) >> (64 - BITS)
            guess = float(shifted @ q) > 0.5 * float(q @ q)  # the Neyman-Pearson test
        else:
            server = DPFTRLServer(np.zeros(DIM, np.float32), cfg, noise_key=key)
            rotated = disc.rotate(server.step(sums[target_in].decode(sums[target_in].values)))
            guess = np.count_nonzero(rotated[q > 0] < 0) > 0.5 * np.count_nonzero(q > 0)
        hits += guess == target_in
    wrap_jump = modulus / disc.scale
    if noise == "discrete":
        residual = TreeNoise(plan.length, ring_noise.ring_nodes(plan, b"k" * 32)).next_residual()
        noisy = getattr(ring_noise, "noisy_ring", None)
        rel = [noisy(sums[t], residual) for t in (True, False)]
        moved, bound = _ring_distance(*rel), plan.delta_s
        value = {"release": "ring value (sum + discrete noise) mod 2^b",
                 "modular_move_integer_units": moved, "bound_delta_s": bound}
    else:
        decoded = [sums[t].decode(sums[t].values) for t in (True, False)]
        moved, bound = float(np.linalg.norm(decoded[0] - decoded[1])), disc.sensitivity
        value = {"release": "decoded sum + continuous Gaussian",
                 "decoded_jump": moved, "bound_sensitivity": bound,
                 "crossed_coordinates": int(np.count_nonzero(q > 0)),
                 "per_coordinate_jump": wrap_jump,
                 "two_pow_bits_over_scale_times_sqrt_crossed":
                     wrap_jump * math.sqrt(np.count_nonzero(q > 0))}
    best = 0.5 * (1 + math.erf(1 / (2 * Z) / math.sqrt(2)))  # Phi(1 / (2 z))
    value.update(default_noise=noise, two_pow_bits_over_scale=wrap_jump, move_over_bound=moved / bound,
                 attacker_hit_rate=hits / TRIALS, best_hit_rate_at_z=best, trials=TRIALS,
                 bits=BITS, dim=DIM, clip=CLIP, z=Z)
    return {"succeeds": moved > bound * (1 + 1e-9), "value": value}


def run() -> list[dict]:
    now = measure()
    old = None
    if OLD_PYTHON.exists():
        out = subprocess.run([str(OLD_PYTHON), str(Path(__file__).resolve()), "--json"],
                             capture_output=True, text=True, check=True, cwd="/tmp")
        old = json.loads(out.stdout.strip().splitlines()[-1])
    return [{
        "name": "secagg_ring_wrap",
        "succeeded_on_old_main": None if old is None else old["succeeds"],
        "succeeds_now": now["succeeds"],
        "value": {"old_main": None if old is None else old["value"], "now": now["value"]},
    }]


if __name__ == "__main__":
    result = measure()
    print(json.dumps(result) if "--json" in sys.argv else json.dumps(result, indent=2))
