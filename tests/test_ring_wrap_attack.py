"""Attack: a dishonest SecAgg co-participant parks the ring sum at the signed wrap.

Nobody range-checks a device's masked input, so a malicious device (the DP adversary: it knows
every input but the target's) can choose its ring vector so that the others' sum sits at
2^(b-1) - 1 in every coordinate. The target's honest, clipped vector q then carries every
coordinate with q_j > 0 across the wrap: the *decoded* sum jumps by about 2^b / s there. With
the old default (continuous Gaussian added after decoding) the target's influence on the release
is that jump, ~sqrt(d'/2) 2^b / s, far beyond the sensitivity the noise is calibrated for.

With the noise in the ring (`dp.noise = "discrete"`, now the default with SecAgg) the released
quantity is the ring value (sum + noise) mod 2^b, decoded afterwards as post-processing. In the
ring the target moves that value by q, at most Delta_s in modular L2 distance, whatever the
malicious vector is: exactly the sensitivity the discrete Gaussian is calibrated to. The tests
run the real encoding, the real in-process SecAgg round and the real DP-FTRL server, and assert
on the values; the property test covers every malicious ring vector.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.mechanisms.ring_noise import noisy_ring, plan_ring, ring_distance, ring_nodes
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import plan_round
from dpfleet.secagg.sums import RingSum

BITS, DIM, CLIP, Z, KEY = 32, 1024, 0.5, 1.0, b"k" * 32
MALICIOUS, TARGET, HONEST = 0, 1, (2, 3)


def world(target_sends_update: bool):
    """One real SecAgg round: device 0 malicious (parks the others' sum at the signed wrap),
    device 1 the target (its clipped update, or zeros: the zero-out neighbour), 2 and 3 honest.
    Returns (ring sum, discretizer, the target's encoded update as signed integers)."""
    plan = plan_ring(DIM, CLIP, BITS, 4, Z, rounds=4, block_size=DIM)
    disc = Discretizer(DIM, CLIP, BITS, plan.ring_clients, seed=9, block_size=DIM)
    rng = np.random.default_rng(3)
    xs = {u: rng.normal(size=DIM) for u in (TARGET, *HONEST)}
    enc = {u: disc.encode(CLIP * x / np.linalg.norm(x), np.random.default_rng([u, 1])).values
           for u, x in xs.items()}
    modulus, top = 1 << BITS, (1 << (BITS - 1)) - 1
    others = sum(enc[u].astype(np.int64) for u in HONEST)
    malicious = ((top - others) % modulus).astype(np.uint32)  # others + malicious = top

    def inputs(u: int) -> np.ndarray:
        if u == MALICIOUS:
            return malicious
        if u == TARGET and not target_sends_update:
            return np.zeros(disc.padded_length, np.uint32)
        return enc[u]

    setup, _, _ = plan_round(4, disc.padded_length, BITS, "complete")
    report = run_round(setup, inputs)
    assert len(report.survivors) == 4
    q = (enc[TARGET].astype(np.int64) << 32) >> 32  # two's complement -> signed
    return RingSum(report.total, BITS, disc.decode), disc, plan, q


def server(ring_plan=None) -> DPFTRLServer:
    """A one-round DP-FTRL server whose theta after a step IS the noised sum (lr 1, no momentum,
    m = 1); the same key in both worlds, so both get the same noise draw."""
    cfg = DPFTRLConfig(noise_multiplier=Z, clip_norm=CLIP, report_goal=1, momentum=0.0)
    return DPFTRLServer(np.zeros(DIM, np.float32), cfg, noise_key=KEY, ring=ring_plan)


def test_old_default_release_jumps_by_the_ring_modulus_over_the_scale():
    """Gaussian after decoding (the old default, still `dp.noise = "gaussian"`): the target's
    update moves each crossed coordinate of the release by 2^b / s, not by its q_j / s."""
    ring_a, disc, _, q = world(True)
    ring_b, _, _, _ = world(False)
    released = [server().step(disc.decode(r.values)).astype(np.float64) for r in (ring_a, ring_b)]
    jump = disc.rotate(released[0] - released[1])  # rotated domain: one entry per ring coordinate
    crossed = q > 0
    expected = (q - crossed * float(1 << BITS)) / disc.scale
    np.testing.assert_allclose(jump, expected, atol=1e-5)
    wrap_jump = (1 << BITS) / disc.scale
    assert np.abs(jump[crossed]).min() > 0.8 * wrap_jump  # every crossed coordinate: ~2^b / s
    size = float(np.linalg.norm(jump))
    assert size > 0.9 * wrap_jump * np.sqrt(crossed.sum()) and crossed.sum() > DIM // 3
    assert size > 20 * disc.sensitivity  # what the Gaussian noise was calibrated for


def test_ring_noise_moves_the_released_ring_value_by_at_most_the_bound():
    """The default with SecAgg: the same attack moves the released ring value (sum + noise mod
    2^b, the thing decoding post-processes) by exactly q: modular L2 distance <= Delta_s."""
    ring_a, disc, plan, q = world(True)
    ring_b, _, _, _ = world(False)
    residual = TreeNoise(plan.length, ring_nodes(plan, KEY)).next_residual()
    released = [noisy_ring(r, residual) for r in (ring_a, ring_b)]
    moved = ring_distance(released[0], released[1], BITS)
    assert moved == np.linalg.norm(q)  # the target's own integer vector, not a wrap of 2^b
    assert moved <= plan.delta_s == disc.rounding_bound
    # the DP-FTRL server releases exactly the decoding of that ring value
    theta = server(plan).step(ring_a).astype(np.float64)
    np.testing.assert_allclose(theta, disc.decode(released[0]), atol=1e-5)
    # and the ring value's noise is the calibrated discrete Gaussian: sigma >= z Delta_s
    assert float(plan.sigma_sq) >= (Z * plan.delta_s) ** 2


@settings(deadline=None, max_examples=60)
@given(malicious=hnp.arrays(np.uint32, 64, elements=st.integers(0, 2**32 - 1)),
       x=hnp.arrays(np.float64, 64, elements=st.floats(-1, 1)),
       norm=st.floats(0, 1), position=st.integers(0, 5))
def test_any_malicious_vector_leaves_one_device_within_its_bound(malicious, x, norm, position):
    """For every malicious co-participant ring vector and every honest update within the clip,
    the released ring values with and without the honest update are <= Delta_s apart (modular
    L2), at every tree position."""
    dim, clip = 64, 0.3
    plan = plan_ring(dim, clip, BITS, 3, Z, rounds=8, block_size=dim)
    disc = Discretizer(dim, clip, BITS, plan.ring_clients, seed=position, block_size=dim)
    if np.linalg.norm(x) > 0:
        x = x * (norm * clip / np.linalg.norm(x))
    q = disc.encode(x, np.random.default_rng(position)).values
    tree = TreeNoise(plan.length, ring_nodes(plan, KEY))
    for _ in range(position):
        tree.next_residual()
    residual = tree.next_residual()
    with_update = RingSum((malicious + q).astype(np.uint32), BITS, disc.decode)  # mod 2^32
    without = RingSum(malicious, BITS, disc.decode)
    moved = ring_distance(noisy_ring(with_update, residual), noisy_ring(without, residual), BITS)
    assert moved <= disc.rounding_bound == plan.delta_s
