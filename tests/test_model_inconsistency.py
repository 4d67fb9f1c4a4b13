"""Model inconsistency (Pasquini, Francati and Ateniese, CCS 2022): a server that hands one
device another model than the rest, to read that device's update out of secure aggregation.
Each device binds SHA-256 of the model bytes it received and its round's shared plan into the
SecAgg setup terms (`secagg/round_terms.py`); the attacks, asserted on the values:

- over loopback, a real coordinator hands one device a crafted model together with the setup
  that device expects for it: the round commits with exactly the honest-model devices' sum and
  the victim's update is not in it; the positive control (model hash left out of the terms on
  both sides, as on old main) puts the victim's update in the sum to 1e-6;
- at the protocol level, with the server forwarding every message, the honest peers refuse the
  victim (its commitment does not open under their setup hash), so no masked vector of it ever
  exists and the attacker's estimate of its input is empty; unbound, the sum is its input;
- a device whose downloaded model is not the one its setup binds refuses before sending;
- (hypothesis) equal (inputs' terms, model hash, plan) give equal terms and setup hashes, any
  difference in model, round, attempt, clip bound, noise kind or multiplier or lr distinct
  ones, and the per-device plan fields (device id, training seed) none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_attacker import crafted_model_round
from secagg_attacker import MaliciousServer, fleet, match_fraction

from dpfleet.fleet.participant import DropOut, take_part
from dpfleet.secagg import messages as m
from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.count_bit import terms_digest
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.errors import SecAggError
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import RoundSetup, plan_round
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.round_terms import bind_round, model_digest
from dpfleet.secagg.setup_wire import encode_setup

N, DIM, VICTIM = 8, 24, 2
PLAN = {"round": 4, "attempt": 1, "clip_norm": 0.5, "lr": 1.0, "noise": "discrete",
        "device_id": "d0", "client_seed": 9}


@pytest.mark.slow
def test_a_coordinator_handing_one_device_a_crafted_model_gets_its_update_into_no_sum(tmp_path):
    bound = crafted_model_round(tmp_path / "bound")
    control = crafted_model_round(tmp_path / "control", bind=False)
    for run in (bound, control):
        assert run["rounds"] == ["committed"], run
        assert run["victim_norm"] > 1e4 * run["bound"]  # its update is far above the rounding
    # bound: the committed sum is the honest-model devices' sum; the victim's is not in it
    assert not bound["victim_in_survivors"] and "secagg_done" not in bound["victim_outcomes"]
    assert bound["survivors"] == 4, bound
    assert bound["residual_norm"] <= bound["bound"], bound
    assert bound["residual_minus_victim_norm"] > 0.99 * bound["victim_norm"], bound
    # control: nothing binds the model, and the very same attack puts its update in the sum
    assert control["victim_in_survivors"] and control["survivors"] == 5, control
    assert control["recomputed_error"] == 0.0  # the update recomputed is the one it masked
    assert control["residual_minus_victim_norm"] <= control["bound"], control
    assert control["residual_norm"] > 0.99 * control["victim_norm"], control


def _inputs(rng: np.random.Generator, length: int) -> np.ndarray:
    """The crafted model zeroes every other device's update (Pasquini's dead-layer model); the
    victim, given the honest one, inputs a distinctive ring vector."""
    inputs = np.zeros((N, length), dtype=np.uint32)
    inputs[VICTIM] = rng.integers(1, 2**32, length, dtype=np.uint32)
    return inputs


def test_peers_refuse_a_device_holding_another_model_so_no_sum_contains_its_input():
    rng = np.random.default_rng(3)
    disc = Discretizer(DIM, 0.5, 32, N, 3)
    honest, crafted = (rng.normal(size=DIM).astype("<f4").tobytes() for _ in range(2))
    keys = fleet(N)

    def setup_for(model: bytes | None) -> RoundSetup:
        terms = terms_digest(disc, None)
        if model is not None:
            terms = bind_round(terms, model_digest(model), PLAN)
        setup, _, _ = plan_round(N, disc.padded_length, 32, "complete", signed=True,
                                 identity_keys=keys, terms=terms)
        return setup

    others = setup_for(crafted)
    victims = dataclasses.replace(others, terms=setup_for(honest).terms)  # same session
    assert victims.setup_hash != others.setup_hash
    inputs = _inputs(rng, others.length)

    # the server runs one round with everyone and forwards every message: the victim refuses
    # the first one (it is not under its setup hash, nor are the others' commitments), so the
    # others' sum forms without it, and no masked vector of the victim ever exists
    attack = MaliciousServer(others, keys, inputs, ClientPolicy(), setups={VICTIM: victims})
    attack.run_until_masked()
    assert set(attack.masked) == set(range(N)) - {VICTIM} and set(attack.rejected) == {VICTIM}
    estimate = attack.estimate(VICTIM, {"self_mask": [], "mask_key": []})
    assert match_fraction(estimate, inputs[VICTIM]) < 0.01
    # a server relaying between the two setups (each message re-headed for its recipient):
    # the victim's reveal opens no commitment for an honest peer, theirs none for the victim,
    # so every client refuses the key broadcast and nobody masks anything
    assert _relay_across_setups(others, victims, keys) == set(range(N))

    # control: nothing binds the model (old main), one setup for all: the sum IS the input
    unbound = setup_for(None)
    report = run_round(unbound, lambda u: inputs[u], identities=keys)
    recovered = report.total - inputs[np.arange(N) != VICTIM].sum(axis=0, dtype=np.uint32)
    assert match_fraction(recovered, inputs[VICTIM]) == 1.0


def _relay_across_setups(others: RoundSetup, victims: RoundSetup, keys) -> set[int]:
    """Commit and key phases with every message re-headed under its recipient's setup hash
    (the most a server can do to merge two setups); the clients that refused."""
    pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    clients = {u: SecAggClient(victims if u == VICTIM else others, u, keys[u], ClientPolicy(),
                               pinned) for u in range(N)}
    fixed = tuple(sorted((u, m.decode(c.start()[0].data).commitment) for u, c in clients.items()))
    adverts, refused = {}, set()
    for u, c in clients.items():
        adverts[u] = c.handle(m.encode(m.SeedCommitments(c.context, m.SERVER, u, fixed)))[0].data
    reveals = tuple(sorted((u, m.decode(a).reveal) for u, a in adverts.items()))
    for u, c in clients.items():
        blobs = tuple(adverts[v] for v in sorted(adverts) if v != u)  # complete graph
        try:
            c.handle(m.encode(m.KeyBroadcast(c.context, m.SERVER, u, reveals, blobs)))
        except SecAggError:
            refused.add(u)
    return refused


class _Blobs:
    """The coordinator's blob store as a device sees it (content-addressed), recording sends."""

    key = None

    def __init__(self, *blobs: bytes):
        self.blobs = {hashlib.sha256(b).hexdigest(): b for b in blobs}
        self.sent: list = []

    async def blob(self, sha: str) -> bytes:
        return self.blobs[sha]

    async def secagg_send(self, *args):
        self.sent.append(args)


def test_a_device_refuses_a_setup_binding_another_model_than_it_downloaded():
    disc = Discretizer(DIM, 0.5, 32, N, 4)
    plan = json.dumps(PLAN).encode()
    honest, crafted = np.zeros(DIM, "<f4").tobytes(), np.ones(DIM, "<f4").tobytes()
    setup, _, _ = plan_round(N, disc.padded_length, 32, "complete",
                             terms=bind_round(terms_digest(disc, None), model_digest(honest), PLAN))

    def stop(phase):
        raise DropOut("the setup was accepted: stop before the first message")

    def outcome(model: bytes) -> str:
        link = _Blobs(plan, model)
        job = {"round": 4, "attempt": 1, "position": 0, "devices": [f"d{u}" for u in range(N)],
               "aggregation": "secagg", "plan_sha256": hashlib.sha256(plan).hexdigest(),
               "model_sha256": hashlib.sha256(model).hexdigest(),
               "secagg": {"setup": encode_setup(setup).hex(), "count_threshold": None,
                          "discretizer": {"length": disc.length, "clip_norm": disc.clip_norm,
                                          "bits": disc.bits, "clients": disc.clients,
                                          "seed": disc.seed}}}
        out = asyncio.run(take_part(link, job, np.zeros(1), policy=ClientPolicy.lenient(),
                                    before_phase=stop))
        assert link.sent == []
        return out.kind

    assert outcome(honest) == "dropped"  # control: the bound model is accepted
    assert outcome(crafted) == "refused_setup"


# ------------------------------------------------------------------ property: what is bound

FIELDS = {  # each bound field and a strategy for its values
    "model": st.binary(min_size=32, max_size=32),
    "round": st.integers(1, 10**6),
    "attempt": st.integers(1, 50),
    "clip_norm": st.floats(1e-6, 1e3),
    "noise": st.sampled_from(["gaussian", "discrete"]),
    "noise_multiplier": st.floats(0.0, 100.0),
    "lr": st.floats(1e-6, 10.0),
    "inputs": st.binary(min_size=32, max_size=32),
}


def _bound_terms(values: dict, device: tuple[str, int]) -> tuple[bytes, bytes]:
    plan = {k: values[k] for k in FIELDS if k not in ("model", "inputs")}
    plan["device_id"], plan["client_seed"] = device
    terms = bind_round(values["inputs"], values["model"], plan)
    setup = RoundSetup(n=5, k=4, threshold=3, length=8, bits=32, session_id=bytes(32), terms=terms)
    return terms, setup.setup_hash


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries(FIELDS), st.sampled_from([None, *FIELDS]), st.data(),
       st.tuples(st.text(max_size=8), st.integers(0, 2**31)),
       st.tuples(st.text(max_size=8), st.integers(0, 2**31)))
def test_any_difference_in_what_is_bound_gives_another_setup_hash(values, changed, data, dev_a,
                                                                  dev_b):
    other = dict(values)
    if changed is not None:
        other[changed] = data.draw(FIELDS[changed].filter(lambda v: v != values[changed]))
    a, b = _bound_terms(values, dev_a), _bound_terms(other, dev_b)
    if changed is None:  # per-device fields (id, training seed) change nothing
        assert a == b
    else:
        assert a[0] != b[0] and a[1] != b[1]
