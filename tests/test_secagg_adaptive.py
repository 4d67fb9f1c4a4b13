"""Adaptive clipping under secure aggregation: each device's clipped bit is one more exactly
encoded coordinate of the vector it masks (`secagg/count_bit.py`).

- the count the server unmasks is exactly the number of set bits among the devices whose update
  is in the sum, with dropouts before and after the masked input (hypothesis);
- an honest-but-curious server reading one device's masked vector guesses its bit at chance,
  while the unmasked vector gives it away every time;
- a setup whose length drops or adds a slot, or that binds other terms, is refused by the
  device before it sends anything; a server that hands one device another threshold (to read
  its bit from a count where everyone else's bit is known) cannot get it into the sum, while the
  same attack on unbound thresholds recovers the bit every time (positive control);
- `simulate` with plain and with secure aggregation (research noise seed, no dropouts) gives the
  same per-round counts, the same clip-norm trajectory and the same epsilon.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from secagg_attacker import MaliciousServer
from service_fleet import tiny_cfg

from dpfleet.coordinator.engine.adaptive_clipping import QuantileClipEstimator, clipped_bit
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.fleet.participant import DropOut, take_part
from dpfleet.secagg.aggregator import SecAggAggregator
from dpfleet.secagg.count_bit import (
    append_bit,
    check_layout,
    input_length,
    split_count,
    terms_digest,
)
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.errors import ProtocolViolationError
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.messages import SERVER, MaskedInput, decode
from dpfleet.secagg.params import RoundSetup, plan_round
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.round_terms import bind_round, model_digest
from dpfleet.secagg.setup_wire import decode_setup, encode_setup

DIM = 24


def _deltas(rng: np.random.Generator, n: int, clip: float = 1.0) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        x = rng.normal(size=DIM)
        out.append(x * (clip * rng.uniform(0.2, 1.0) / np.linalg.norm(x)))
    return out


def _bit_round(n: int, bits: list[int], seed: int, dropouts=None, intercept=None):
    """One unsigned in-process round whose inputs are encoded deltas plus the clipped bit."""
    rng = np.random.default_rng(seed)
    deltas = _deltas(rng, n)
    disc = Discretizer(DIM, 1.0, 32, n, seed)
    setup, _, _ = plan_round(n, input_length(disc, 0.5), 32, "complete")
    inputs = {}

    def encode(u: int) -> np.ndarray:
        inputs[u] = append_bit(disc.encode(deltas[u], rng).values, bits[u])
        return inputs[u]

    report = run_round(setup, encode, dropouts=dropouts, intercept=intercept)
    return disc, deltas, inputs, report


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_the_count_is_exactly_the_bits_of_the_devices_in_the_sum(data):
    n = data.draw(st.integers(8, 12), label="n")
    bits = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n), label="bits")
    order = data.draw(st.permutations(range(n)), label="order")
    before = sorted(order[: data.draw(st.integers(0, 1))])  # drop before their masked input
    after = sorted(order[2: 2 + data.draw(st.integers(0, 1))])  # drop right after sending it
    disc, deltas, _, report = _bit_round(n, bits, data.draw(st.integers(0, 2**31)),
                                         dropouts={"mask": before, "unmask": after})
    survivors = list(report.survivors)
    assert survivors == sorted(set(range(n)) - set(before))  # a device after masking stays in
    ring, count, out_of_range = split_count(report.total, disc.padded_length, len(survivors), 32)
    assert count == sum(bits[u] for u in survivors) and not out_of_range
    exact = np.sum([deltas[u] for u in survivors], axis=0)
    error = float(np.linalg.norm(disc.decode(ring) - exact))
    assert error <= disc.quantization_bound(len(survivors))  # the slot never touches the model


def test_the_aggregator_counts_its_survivors_only_with_simulated_dropouts():
    rng = np.random.default_rng(4)
    deltas = _deltas(rng, 12, clip=0.5)
    bits = [int(b) for b in rng.integers(0, 2, 12)]
    agg = SecAggAggregator(clip_norm=0.5, assumed_dropout=0.25).aggregate(
        deltas, 9, bits=bits, dropouts={"mask": [1, 4, 10]})
    assert len(agg.survivors) == 9
    assert agg.clipped_count == sum(bits[u] for u in agg.survivors)
    assert agg.clipped_count != sum(bits) or sum(bits[u] for u in agg.info["dropped"]) == 0
    exact = np.sum([deltas[u] for u in agg.survivors], axis=0)
    assert np.linalg.norm(agg.total - exact) <= agg.info["quantization_bound"]
    assert agg.ring.values.size == agg.info["padded_length"]  # the count is not in the ring sum


def test_a_curious_server_reads_the_bit_from_a_masked_vector_at_chance_only():
    seen: dict[tuple[int, int], int] = {}
    truth: dict[tuple[int, int], int] = {}
    plain: dict[tuple[int, int], int] = {}
    rounds, n = 30, 8
    bit_rng = np.random.default_rng(123)
    for r in range(rounds):
        bits = [int(b) for b in bit_rng.integers(0, 2, n)]

        def intercept(phase, sender, recipient, wire, r=r):
            if phase == "mask" and recipient == SERVER:  # a client's masked input
                message = decode(wire)
                assert isinstance(message, MaskedInput)
                seen[(r, sender)] = int(message.vector[-1])
            return [wire]

        _, _, inputs, _ = _bit_round(n, bits, 1000 + r, intercept=intercept)
        for u in range(n):
            truth[(r, u)], plain[(r, u)] = bits[u], int(inputs[u][-1])
    assert set(seen) == set(truth)
    half = 1 << 31
    guesses = {"parity": lambda v: v & 1, "low half": lambda v: int(v < half),
               "equals one": lambda v: int(v == 1)}
    trials = len(truth)
    bound = 4 * math.sqrt(0.25 / trials)  # 4 sd of a fair coin's accuracy: false alarm < 1e-4
    for name, guess in guesses.items():
        masked_acc = np.mean([guess(seen[k]) == truth[k] for k in truth])
        unmasked_acc = np.mean([guess(plain[k]) == truth[k] for k in truth])
        assert abs(masked_acc - 0.5) <= bound, (name, masked_acc)
        if name != "low half":  # every bit is in the low half unmasked: that rule guesses 1
            assert unmasked_acc == 1.0, name


def _setup_for(n: int, disc: Discretizer, threshold: float | None, length: int | None = None,
               terms: bytes | None = None) -> RoundSetup:
    setup, _, _ = plan_round(n, length or input_length(disc, threshold), 32, "complete",
                             terms=terms_digest(disc, threshold) if terms is None else terms)
    return setup


def test_a_device_checks_the_slot_and_the_bound_terms_before_anything_else():
    disc = Discretizer(DIM, 0.5, 32, 6, 77)
    good = _setup_for(6, disc, 0.37)
    check_layout(good, disc, 0.37)
    check_layout(_setup_for(6, disc, None), disc, None)
    refused = [
        (_setup_for(6, disc, 0.37, length=disc.padded_length), 0.37),  # slot silently dropped
        (_setup_for(6, disc, 0.37, length=disc.padded_length + 2), 0.37),  # a second slot
        (_setup_for(6, disc, None), 0.37),  # a setup without the slot for a device with C^t
        (_setup_for(6, disc, 0.37), None),  # a slot the device was not told how to fill
        (_setup_for(6, disc, 0.38), 0.37),  # another threshold bound
        (_setup_for(6, disc, 0.37, terms=b""), 0.37),  # nothing bound
        (_setup_for(6, Discretizer(DIM, 0.6, 32, 6, 77), 0.37), 0.37),  # another clip norm
    ]
    for setup, threshold in refused:
        with pytest.raises(ProtocolViolationError):
            check_layout(setup, disc, threshold)
    wire = encode_setup(good)
    assert decode_setup(wire).setup_hash == good.setup_hash
    assert decode_setup(encode_setup(_setup_for(6, disc, None, terms=b""))).terms == b""
    flipped = bytearray(wire)
    flipped[-1] ^= 1  # one bit of the bound terms (unsigned: they end the wire form)
    assert decode_setup(bytes(flipped)).setup_hash != good.setup_hash
    with pytest.raises(ProtocolViolationError):
        decode_setup(wire[:-1])


PLAN = json.dumps({"round": 1, "attempt": 1, "clip_norm": 0.5}).encode()
MODEL = np.zeros(DIM, "<f4").tobytes()
BLOBS = {hashlib.sha256(b).hexdigest(): b for b in (PLAN, MODEL)}


def _bound(disc: Discretizer, threshold: float | None) -> bytes:
    """The terms a device computes for PLAN and MODEL (`round_terms`, model consistency)."""
    return bind_round(terms_digest(disc, threshold), model_digest(MODEL), json.loads(PLAN))


class _SilentLink:
    """Stands in for `fleet.link.CoordinatorLink` in a refusal test: it records whatever the
    device would send and serves only the plan and model (which the setup must bind)."""

    key = None

    def __init__(self):
        self.sent: list = []

    async def secagg_send(self, *args):
        self.sent.append(args)

    async def blob(self, sha):
        return BLOBS[sha]


def _assignment(setup: RoundSetup, disc: Discretizer, threshold: float | None) -> dict:
    sha = {v: k for k, v in BLOBS.items()}
    return {"round": 1, "attempt": 1, "position": 0, "devices": [f"d{u}" for u in range(setup.n)],
            "aggregation": "secagg", "plan_sha256": sha[PLAN], "model_sha256": sha[MODEL],
            "secagg": {"setup": encode_setup(setup).hex(),
                       "discretizer": {"length": disc.length, "clip_norm": disc.clip_norm,
                                       "bits": disc.bits, "clients": disc.clients,
                                       "seed": disc.seed},
                       "count_threshold": threshold}}


def test_a_device_refuses_a_setup_that_drops_or_reinterprets_the_slot_and_sends_nothing():
    disc = Discretizer(DIM, 0.5, 32, 6, 78)

    def stop(phase):
        raise DropOut("stop at the first message (the setup was accepted)")

    def outcome(setup, threshold):
        link = _SilentLink()
        out = asyncio.run(take_part(link, _assignment(setup, disc, threshold), np.zeros(1),
                                    policy=ClientPolicy.lenient(), before_phase=stop))
        assert link.sent == []
        return out.kind

    def bound(threshold, **kw):
        return _setup_for(6, disc, threshold, terms=_bound(disc, threshold), **kw)

    assert outcome(bound(0.42), 0.42) == "dropped"  # control: accepted
    assert outcome(bound(None), None) == "dropped"
    assert outcome(bound(0.42, length=disc.padded_length), 0.42) == "refused_setup"
    assert outcome(bound(0.42), None) == "refused_setup"
    assert outcome(bound(1e9), 0.42) == "refused_setup"
    assert outcome(_setup_for(6, disc, 0.42), 0.42) == "refused_setup"  # the model not bound


def test_a_server_cannot_isolate_one_bit_by_handing_out_different_thresholds():
    """The attack: every device but the target gets C^t = infinity (bit 1, known), so the count
    minus n - 1 is the target's bit. With the thresholds bound in the setup the target holds
    another setup hash and never gets into the sum; with nothing bound (control) the attack
    reads the target's bit exactly, every time."""
    n, target, trials = 8, 3, 12
    rng = np.random.default_rng(5)
    recovered_unbound, target_bits = [], []
    for trial in range(trials):
        disc = Discretizer(DIM, 1.0, 32, n, trial)
        deltas = _deltas(rng, n)
        norms = [float(np.linalg.norm(d)) for d in deltas]
        threshold = float(np.median(norms))
        given = {u: (threshold if u == target else math.inf) for u in range(n)}
        bits = [clipped_bit(norms[u], given[u]) for u in range(n)]
        target_bits.append(bits[target])
        inputs = np.stack([append_bit(disc.encode(deltas[u], rng).values, bits[u])
                           for u in range(n)])

        # bound: the others' setup binds infinity, the target's binds its own threshold
        others = _setup_for(n, disc, math.inf)
        mine = RoundSetup(n=others.n, k=others.k, threshold=others.threshold,
                          length=others.length, bits=others.bits, corrupt=others.corrupt,
                          session_id=others.session_id, terms=terms_digest(disc, threshold))
        attack = MaliciousServer(others, None, inputs, setups={target: mine})
        # the target's commitment is left out of the others' view, so they go on without it
        attack.run_until_masked(
            commitments=lambda u, fixed: tuple(c for c in fixed if c[0] != target))
        assert target not in attack.masked and target in attack.rejected
        assert len(attack.masked) == n - 1  # the others' sum forms, without the target's bit

        # control: the same per-device thresholds with nothing bound
        setup, _, _ = plan_round(n, input_length(disc, threshold), 32, "complete")
        report = run_round(setup, lambda u, inputs=inputs: inputs[u])
        _, count, _ = split_count(report.total, disc.padded_length, n, 32)
        recovered_unbound.append(count - (n - 1))
    assert recovered_unbound == target_bits
    assert 0 < sum(target_bits) < trials  # both bit values were attacked


# ------------------------------------------------------------------ simulate: plain vs secagg

ROUNDS = 6
ADAPTIVE_DP = {"adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [3],
               "clip_lr": 0.5, "target_quantile": 0.5}


def _counting(monkeypatch) -> list[tuple[int, int]]:
    """Records every (count, reported) the estimator is fed (spy, test only)."""
    seen, update_count = [], QuantileClipEstimator.update_count

    def spy(self, below, reported):
        seen.append((below, reported))
        return update_count(self, below, reported)

    monkeypatch.setattr(QuantileClipEstimator, "update_count", spy)
    return seen


def test_simulate_with_secagg_gives_the_plain_counts_clip_trajectory_and_epsilon(
        tmp_path, monkeypatch):
    runs = {}
    for kind in ("plain", "secagg"):
        counts = _counting(monkeypatch)
        # the same (continuous, research-seeded) model noise in both, so only the aggregation
        # differs (secagg's default, ring noise, draws other noise: the models would diverge)
        cfg = tiny_cfg(rounds=ROUNDS, eval_every=ROUNDS, dp={**ADAPTIVE_DP, "noise": "gaussian"},
                       aggregation={"kind": kind})
        result = run_simulation(cfg, tmp_path / kind, progress=False, log=lambda s: None)
        runs[kind] = (list(counts), result)
        monkeypatch.undo()
    (plain_counts, plain), (secure_counts, secure) = runs["plain"], runs["secagg"]
    assert len(plain_counts) == ROUNDS
    assert secure_counts == plain_counts
    assert len({c for c, _ in plain_counts}) > 1  # the counts vary: the comparison can fail
    for a, b in zip(plain.metrics, secure.metrics, strict=True):
        assert a["clip"] == pytest.approx(b["clip"], rel=1e-9)
        assert a["clip_estimate"] == pytest.approx(b["clip_estimate"], rel=1e-9)
        assert b["aggregation"]["aggregation"] == "secagg"
    assert plain.metrics[-1]["clip"] != plain.metrics[0]["clip"]  # the restart adopted C^t
    assert secure.privacy["epsilon"] == plain.privacy["epsilon"]
    assert math.isfinite(plain.privacy["epsilon"])


def test_the_service_and_fleet_count_the_bits_inside_signed_secagg_like_simulate(
        tmp_path, monkeypatch):
    """Real sockets: `service serve` with signed SecAgg+ and devices of fleet/participant.py
    that mask their bit with their update. Every committed count is the set bits of exactly the
    devices in the sum (from what each device trained), and the counts, clip norms and epsilon
    equal `simulate`'s with plain aggregation (same config, research noise seed)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from service_fleet import capture_sums, fleet_data, run_devices

    from dpfleet.fleet.participant import local_policy
    from dpfleet.service.server import shutdown, start

    rounds = 4
    dp = {**ADAPTIVE_DP, "restart_rounds": [2], "noise": "gaussian"}  # as simulate's plain run
    service = {"overselect": 0.0, "report_deadline_s": 30.0, "secagg_phase_deadline_s": 10.0}
    secure = tiny_cfg(rounds=rounds, eval_every=rounds, dp=dp, service=service,
                      aggregation={"kind": "secagg", "signed": True, "graph": "harary"})
    counts = _counting(monkeypatch)
    plain = run_simulation(tiny_cfg(rounds=rounds, eval_every=rounds, dp=dp),
                           tmp_path / "sim", progress=False, log=lambda s: None)
    plain_counts = list(counts)
    monkeypatch.undo()

    users, examples = fleet_data(secure, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}

    async def main():
        running = await start(secure, tmp_path / "state", log=lambda s: None, poll_s=2.0)
        sums = capture_sums(running.driver.engine)
        policy = lambda n: local_policy(secure.dp.report_goal, "harary",  # noqa: E731
                                        secure.aggregation.corruption, n)
        devices = asyncio.create_task(run_devices(running.url, keys, examples, pinned=pinned,
                                                  policy=policy))
        await asyncio.wait_for(asyncio.shield(running.task), 240)
        outcomes = await asyncio.wait_for(devices, 30)
        metrics, privacy = running.driver.engine.metrics, None
        await shutdown(running)
        return sums, outcomes, metrics, privacy

    sums, outcomes, metrics, _ = asyncio.run(main())
    assert len(sums) == rounds
    for plan, agg in sums:
        done = {d: o for d, outs in outcomes.items() for r, _, o in outs
                if r == plan.round + 1 and o.kind == "secagg_done"}
        in_sum = [plan.device_ids[u] for u in agg.survivors]
        assert sorted(in_sum) == sorted(done)
        assert agg.clipped_count == sum(clipped_bit(done[d].update.norm, plan.count_threshold)
                                        for d in in_sum)
    assert [(agg.clipped_count, len(agg.survivors)) for _, agg in sums] == plain_counts
    for a, b in zip(plain.metrics, metrics, strict=True):
        assert a["clip"] == pytest.approx(b["clip"], rel=1e-9)
        assert a["clip_estimate"] == pytest.approx(b["clip_estimate"], rel=1e-9)
        assert a["epsilon"] == b["epsilon"]


def test_discrete_noise_with_adaptive_clipping_gives_the_model_z_delta_and_counts_in_secagg(
        tmp_path, monkeypatch):
    """dp.noise = "discrete": the ring's integer noise is the model's share z_delta (the
    clipped counts get the coordinator's Gaussian sigma_b, as with plain aggregation), and the
    decoded noise follows the clip norm a restart adopts."""
    from dpfleet.coordinator.accounting.zcdp import model_noise_multiplier
    from dpfleet.coordinator.engine.round_engine import discrete_plan

    discrete = {**ADAPTIVE_DP, "noise": "discrete"}
    cfg = tiny_cfg(rounds=ROUNDS, eval_every=ROUNDS, dp=discrete, aggregation={"kind": "secagg"})
    fixed = tiny_cfg(rounds=ROUNDS, eval_every=ROUNDS, dp={"noise": "discrete"},
                     aggregation={"kind": "secagg"})
    z, z_delta = cfg.dp.noise_multiplier, model_noise_multiplier(1.0, 1.0)
    adaptive_plan, fixed_plan = discrete_plan(cfg, 5000), discrete_plan(fixed, 5000)
    # sigma = z * Delta_s in each plan's own integer units (the ring layout differs with sigma)
    assert adaptive_plan.sigma / adaptive_plan.delta_s == pytest.approx(z_delta, rel=1e-3)
    assert fixed_plan.sigma / fixed_plan.delta_s == pytest.approx(z, rel=1e-3)
    assert z_delta > 1.1 * z  # the model's noise really is larger: the test can fail

    counts = _counting(monkeypatch)
    result = run_simulation(cfg, tmp_path / "discrete", progress=False, log=lambda s: None)
    assert [reported for _, reported in counts] == [m["clients"] for m in result.metrics]
    first, last = result.metrics[0], result.metrics[-1]
    assert last["clip"] != first["clip"]
    assert last["noise_std"] / first["noise_std"] == pytest.approx(last["clip"] / first["clip"])
