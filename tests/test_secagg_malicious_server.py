"""A malicious server driving the real client state machines cannot rebuild an input.

Every test runs the attack end to end (`secagg_attacker.MaliciousServer`) and asserts on the
attacker's best reconstruction of the target's input: it must match the true input in about
2^-16 of the coordinates (chance), not merely raise. A positive control with more colluders
than the threshold is sized for shows the same attack code does recover an input exactly when
the threat model is exceeded, so the negative results are not an artefact of the harness.
"""

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from secagg_attacker import MaliciousServer, match_fraction

from dpfleet.secagg import crypto
from dpfleet.secagg import messages as m
from dpfleet.secagg.client import SK_SHARE
from dpfleet.secagg.errors import (
    AuthenticationError,
    PolicyError,
    ProtocolViolationError,
    RoundMismatchError,
    ThresholdError,
)
from dpfleet.secagg.params import RoundSetup, graph_seed, plan_round
from dpfleet.secagg.policy import ClientPolicy

LENGTH, BITS = 256, 16
CHANCE = 0.01  # 2^-16 per coordinate by luck; 1% leaves a wide margin at 256 coordinates
TARGET = 0


def _inputs(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << BITS, (n, LENGTH)).astype(np.uint16)


def _setup(n, signed):
    setup, keys, _ = plan_round(n, LENGTH, BITS, graph="harary", dropout=0.1, signed=signed)
    return setup, keys


def _colluding_neighbours(attack, count):
    return set(sorted(attack.graph.neighbours(TARGET))[:count])


SIZES = [10, 50, *(pytest.param(n, marks=pytest.mark.slow) for n in (100, 200))]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("with_colluders", [False, True])
def test_split_view_recovers_nothing(n, signed, with_colluders):
    """Two survivor lists (target alive / target dropped) to two halves of the honest
    clients, plus up to c colluding neighbours of the target that sign and answer both."""
    setup, keys = _setup(n, signed)
    inputs = _inputs(n)
    attack = MaliciousServer(setup, keys, inputs, ClientPolicy.for_setup(setup))
    attack.run_until_masked()
    colluders = _colluding_neighbours(attack, setup.corrupt if with_colluders else 0)
    collected = attack.split_view(TARGET, colluders)
    estimate = attack.estimate(TARGET, collected)
    assert TARGET in attack.masked  # the attacker holds y_u; only the masks protect it
    assert match_fraction(estimate, inputs[TARGET]) < CHANCE
    # the colluders' signatures are genuine: what stops the attack is the threshold, not a
    # signature the harness got wrong
    assert not [e for e in attack.rejected.values() if isinstance(e, AuthenticationError)]
    # the honest clients answered at most one list each: never t shares of both secrets
    assert min(len(collected["self_mask"]), len(collected["mask_key"])) < setup.threshold


@pytest.mark.parametrize("signed", [True, False])
def test_positive_control_more_colluders_than_the_threshold_allows(signed):
    """Beyond the threat model (t colluding neighbours) the very same attack recovers the
    input exactly: the harness can succeed, so its failures above are real."""
    setup, keys = _setup(50, signed)
    inputs = _inputs(50)
    attack = MaliciousServer(setup, keys, inputs, ClientPolicy.for_setup(setup))
    attack.run_until_masked()
    collected = attack.split_view(TARGET, _colluding_neighbours(attack, setup.threshold))
    np.testing.assert_array_equal(attack.estimate(TARGET, collected), inputs[TARGET])


def test_a_client_refuses_a_per_client_setup_with_a_lower_threshold():
    """The server hands the target a setup with t lowered (and c = 0 so it still validates):
    the device's policy refuses it before it derives or sends anything."""
    n = 10
    setup, keys = _setup(n, signed=True)
    weaker = dataclasses.replace(setup, corrupt=0, threshold=setup.k // 2 + 1)
    assert weaker.threshold < setup.threshold
    inputs = _inputs(n)
    attack = MaliciousServer(setup, keys, inputs, ClientPolicy.for_setup(setup),
                             setups={TARGET: weaker})
    assert isinstance(attack.rejected[TARGET], PolicyError)
    attack.run_until_masked()
    estimate = attack.estimate(TARGET, attack.split_view(TARGET, set()))
    assert match_fraction(estimate, inputs[TARGET]) < CHANCE


@pytest.mark.parametrize("weaker", ["clients", "degree", "unsigned", "identity"])
def test_local_policy_and_pinned_keys_refuse_a_weaker_setup(weaker):
    setup, keys = _setup(50, signed=True)
    policy = ClientPolicy.for_setup(setup)
    pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    impostor = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    changed = {
        "clients": lambda: dataclasses.replace(setup, n=20, k=19, threshold=11, corrupt=1,
                                               identities={u: pinned[u] for u in range(20)}),
        "degree": lambda: dataclasses.replace(setup, k=8, threshold=6, corrupt=2),
        "unsigned": lambda: dataclasses.replace(setup, identities=None),
        "identity": lambda: dataclasses.replace(setup, identities={**pinned, 3: impostor}),
    }[weaker]()
    attack = MaliciousServer(setup, keys, _inputs(50), policy, setups={TARGET: changed})
    assert isinstance(attack.rejected[TARGET], PolicyError)


def test_signed_key_substitution_recovers_nothing():
    """The server swaps every neighbour's advert for one carrying its own X25519 keys."""
    setup, keys = _setup(50, signed=True)
    inputs = _inputs(50)
    mallory = Ed25519PrivateKey.generate()

    def substitute(u, blobs):
        if u != TARGET:
            return blobs
        return tuple(m.encode(dataclasses.replace(
            m.decode(b), c_public=_x25519(), s_public=_x25519()), mallory) for b in blobs)

    attack = MaliciousServer(setup, keys, inputs, ClientPolicy.for_setup(setup))
    attack.run_until_masked(adverts=substitute)
    assert isinstance(attack.rejected[TARGET], AuthenticationError)
    estimate = attack.estimate(TARGET, attack.split_view(TARGET, set()))
    assert match_fraction(estimate, inputs[TARGET]) < CHANCE


def test_unsigned_mode_does_not_resist_key_substitution():
    """Documented limit (THREAT_MODEL.md): without identity keys a server that substitutes
    adverts can read the target's shares. This is why signed mode is the default for
    anything that leaves one process; the test keeps the limit visible."""
    setup, keys = _setup(10, signed=False)
    inputs = _inputs(10)
    mallory_keys = {}

    def substitute(u, blobs):
        if u != TARGET:
            return blobs
        out = []
        for b in blobs:
            advert = m.decode(b)
            c_key, s_key = _x25519_pair(), _x25519_pair()
            mallory_keys[advert.sender] = (c_key, s_key)
            out.append(m.encode(dataclasses.replace(
                advert, c_public=c_key[1], s_public=s_key[1])))
        return tuple(out)

    attack = MaliciousServer(setup, keys, inputs)
    attack.run_until_masked(adverts=substitute)
    assert TARGET in attack.share_keys  # accepted the keys: no signatures to check
    # The target's sealed shares are readable by the server, which holds the c keys: both of
    # its secrets come out and pass their own checks.
    seed_shares, key_shares = [], []
    for v, sealed in attack.share_keys[TARGET].shares:
        shared = crypto.exchange(mallory_keys[v][0][0], attack.clients[TARGET]._c_public)
        key = crypto.share_key(shared, attack.ctx, TARGET, v)
        plain = crypto.open_sealed(key, sealed, crypto.share_aad(attack.ctx, TARGET, v))[8:]
        key_shares.append((v + 1, plain[:SK_SHARE]))
        seed_shares.append((v + 1, plain[SK_SHARE:]))
    t = setup.threshold
    seed = crypto.reconstruct_secret(seed_shares, t, crypto.SEED_BYTES)
    assert crypto.seed_commitment(attack.ctx, TARGET, seed) == attack.share_keys[
        TARGET].commitment
    sk = crypto.reconstruct_secret(key_shares, t, crypto.KEY_BYTES)
    assert crypto.public_bytes(X25519PrivateKey.from_private_bytes(sk)) == m.decode(
        attack.adverts[TARGET]).s_public


def _x25519_pair():
    return crypto.generate_keypair()


def _x25519():
    return _x25519_pair()[1]


def test_adverts_replayed_from_an_earlier_attempt_recover_nothing():
    """Attempt 1 runs under one session id; the server replays its signed adverts (whose
    secrets it may have learnt there) into attempt 2 with the same parameters."""
    setup, keys = _setup(50, signed=True)
    inputs = _inputs(50)
    first = MaliciousServer(setup, keys, inputs, ClientPolicy.for_setup(setup))
    first.run_until_masked()
    retry = dataclasses.replace(setup, session_id=RoundSetup.__dataclass_fields__[
        "session_id"].default_factory())
    assert retry.setup_hash != setup.setup_hash

    def replay(u, blobs):
        return tuple(first.adverts[m.decode(b).sender] for b in blobs) if u == TARGET else blobs

    second = MaliciousServer(retry, keys, inputs, ClientPolicy.for_setup(retry))
    second.run_until_masked(adverts=replay)
    assert isinstance(second.rejected[TARGET], RoundMismatchError)
    estimate = second.estimate(TARGET, second.split_view(TARGET, set()))
    assert match_fraction(estimate, inputs[TARGET]) < CHANCE


def test_graph_seed_grinding_is_refused():
    """Colluders (30% of a sparse round) would like to choose their randomness after seeing
    the honest reveals, to put t of them around the target. The server finds such reveals
    easily -- but they do not open the commitments fixed before, so the target refuses."""
    n, k = 40, 4
    setup = RoundSetup(n=n, k=k, threshold=3, length=LENGTH, bits=BITS)
    colluders = set(range(1, n, 3))
    inputs = _inputs(n)
    attack = MaliciousServer(setup, None, inputs)
    rng = np.random.default_rng(7)

    def grind(u, opened):
        if u != TARGET:
            return opened
        for _ in range(2000):
            fake = {c: rng.bytes(32) for c in colluders}
            trial = tuple((v, fake.get(v, r)) for v, r in opened)
            around = setup.graph(graph_seed(attack.ctx, trial)).neighbours(TARGET)
            if len(around & colluders) >= setup.threshold:
                grind.found = True
                return trial
        return opened

    grind.found = False
    attack.run_until_masked(reveals=grind)
    assert grind.found  # grinding would have worked had the seed been the server's to pick
    assert isinstance(attack.rejected[TARGET], ProtocolViolationError)
    estimate = attack.estimate(TARGET, attack.split_view(TARGET, colluders))
    assert match_fraction(estimate, inputs[TARGET]) < CHANCE


def test_a_commitment_list_without_the_targets_own_is_refused():
    """Otherwise the server could leave the target's randomness out of its graph seed."""
    setup, keys = _setup(10, signed=True)
    attack = MaliciousServer(setup, keys, _inputs(10), ClientPolicy.for_setup(setup))

    def drop_target(u, fixed):
        return tuple((v, c) for v, c in fixed if v != TARGET) if u == TARGET else fixed

    attack.run_until_masked(commitments=drop_target)
    assert isinstance(attack.rejected[TARGET], ProtocolViolationError)


def test_too_few_committed_clients_abort():
    setup = RoundSetup(n=6, k=5, threshold=4, length=8, bits=8)
    attack = MaliciousServer(setup, None, np.zeros((6, 8), np.uint8))
    attack.run_until_masked(commitments=lambda u, fixed: fixed[:4] if u == 0 else fixed)
    assert isinstance(attack.rejected[0], (ThresholdError, ProtocolViolationError))
