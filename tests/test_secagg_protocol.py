"""The protocol end to end: exact sums under dropouts in every phase, clean aborts, and the
sans-I/O interface driven by hand."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.errors import PolicyError, ThresholdError
from dpfleet.secagg.graph import Graph
from dpfleet.secagg.inprocess import PHASES, run_round
from dpfleet.secagg.messages import SERVER
from dpfleet.secagg.params import RoundSetup, plan_round
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.server import SecAggServer


def _inputs(seed, n, length, bits, dtype):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << bits, size=(n, length), dtype=np.uint64).astype(dtype)


def _plain_sum(inputs, survivors, bits):
    total = inputs[list(survivors)].astype(np.uint64).sum(axis=0) % (1 << bits)
    return total.astype(inputs.dtype)


def _oracle(graph, t, fate, signed):
    """Which clients end up in the sum (None: the round must abort), from the protocol's rules:
    more than t commit; every committer reveals (else the attempt aborts: no grinding); prune
    clients with < t live neighbours after keys and after shares, need t at each step, and t
    returned shares for every client that shared its secrets."""
    n = len(fate)
    order = {p: i for i, p in enumerate(PHASES)}

    def sends(phase):
        return {u for u in range(n) if fate[u] is None or order[fate[u]] > order[phase]}

    def prune(alive):
        alive = set(alive)
        while weak := {u for u in alive if len(graph.neighbours(u) & alive) < t}:
            alive -= weak
        return alive

    committed = sends("commit")
    if len(committed) <= t or sends("advertise") != committed:
        return None
    p1 = prune(committed)
    p2 = prune(p1 & sends("share"))
    u3 = p2 & sends("mask")
    responders = u3 & sends("consistency") if signed else u3
    u5 = responders & sends("unmask")
    if min(len(p1), len(p2), len(u3), len(responders), len(u5)) < t:
        return None
    if any(len(graph.neighbours(w) & u5) < t for w in p2):
        return None
    return u3


@st.composite
def rounds(draw):
    n = draw(st.integers(2, 9))
    kind = draw(st.sampled_from(["complete", "harary"] if n >= 4 else ["complete"]))
    k = n - 1 if kind == "complete" else draw(st.sampled_from(range(2, n - 1, 2)))
    signed = draw(st.sampled_from([False, False, False, True]))
    fates = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(
        [p for p in PHASES if signed or p != "consistency"]))
    corrupt = draw(st.integers(0, (k - 1) // 2))
    return {
        "n": n,
        "k": k,
        "corrupt": corrupt,
        "threshold": draw(st.integers((k + corrupt) // 2 + 1, k)),
        "length": draw(st.integers(1, 300)),
        "bits": draw(st.integers(1, 32)),
        "signed": signed,
        "fate": draw(st.lists(fates, min_size=n, max_size=n)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=200, deadline=None)
@given(rounds())
def test_exact_sum_with_dropouts_in_every_phase(r):
    n, t, fate = r["n"], r["threshold"], r["fate"]
    keys = {u: Ed25519PrivateKey.generate() for u in range(n)} if r["signed"] else None
    identities = {u: k.public_key().public_bytes_raw() for u, k in keys.items()} if keys else None
    setup = RoundSetup(n=n, k=r["k"], threshold=t, length=r["length"], bits=r["bits"],
                       corrupt=r["corrupt"], identities=identities)
    inputs = _inputs(r["seed"], n, r["length"], r["bits"], setup.dtype)
    dropouts = {p: {u for u, f in enumerate(fate) if f == p} for p in PHASES}
    report = run_round(setup, inputs.__getitem__, keys, dropouts, raise_on_abort=False)
    # the graph is the clients' commit-and-reveal result; any seed would do for the oracle
    graph = report.graph or Graph(n, r["k"])
    expected = _oracle(graph, t, fate, r["signed"])
    event("aborted" if expected is None else "summed")
    if expected is None:
        assert isinstance(report.aborted, ThresholdError)
        return
    assert report.aborted is None
    assert set(report.survivors) == expected
    assert report.rejections == []
    np.testing.assert_array_equal(report.total, _plain_sum(inputs, expected, r["bits"]))


@pytest.mark.parametrize("graph", ["complete", "harary"])
def test_eighty_clients_with_thirty_percent_dropout(graph):
    setup, _, plan = plan_round(80, 300, bits=20, graph=graph, dropout=0.3)
    # with 30% dropout the split-view rule 2t > k + c leaves no 2^-20 dropout margin for any
    # k < 80, so both plans fall back to the complete graph with c = ceil(0.05 n) and say so
    assert (plan.k, plan.corrupt, plan.bounded) == (79, 4, False)
    assert 2 * plan.threshold > plan.k + plan.corrupt
    inputs = _inputs(1, 80, 300, 20, setup.dtype)
    dropped = list(range(0, 80, 4)) + [1, 2, 3, 5]  # 24 clients, after sharing their keys
    report = run_round(setup, inputs.__getitem__, dropouts={"mask": dropped})
    assert set(report.survivors) == set(range(80)) - set(dropped)
    np.testing.assert_array_equal(report.total, _plain_sum(inputs, report.survivors, 20))


def test_abort_below_threshold_tells_clients_and_yields_nothing():
    setup = RoundSetup(n=5, k=4, threshold=4, length=10, bits=16)
    server = SecAggServer(setup)
    clients = [SecAggClient(setup, u, policy=ClientPolicy.lenient()) for u in range(5)]
    commitments = []
    for c in clients:
        commitments += server.handle(c.start()[0].data)
    adverts = [r for o in commitments for r in clients[o.recipient].handle(o.data)]
    broadcast = [o for r in adverts for o in server.handle(r.data)]
    replies = [r for o in broadcast for r in clients[o.recipient].handle(o.data)]
    forwards = [o for r in replies for o in server.handle(r.data)]
    for c in clients:
        c.provide_input(np.ones(10, dtype=np.uint16))
    for o in forwards[:3]:  # two clients vanish before masking
        assert server.handle(clients[o.recipient].handle(o.data)[0].data) == []
    notices = server.close_phase()
    assert server.phase == "aborted" and {o.recipient for o in notices} == {0, 1, 2}
    with pytest.raises(ThresholdError):
        server.result()
    for o in notices:
        assert clients[o.recipient].handle(o.data) == []
        assert clients[o.recipient].phase == "aborted"
        _assert_wiped(clients[o.recipient])


def _assert_wiped(client):
    """No secret left on a finished or aborted client: key pairs, seeds, shares, input."""
    assert client._c_key is None and client._s_key is None
    assert client._seed == b"" and client._reveal == b""
    assert client._held == {} and client._c_shared == {} and client._input is None


def test_sans_io_machines_driven_by_hand():
    """The same objects a network shell would drive: bytes in, addressed bytes out."""
    setup = RoundSetup(n=4, k=3, threshold=2, length=6, bits=8)
    server = SecAggServer(setup)
    clients = [SecAggClient(setup, u, policy=ClientPolicy.lenient()) for u in range(4)]
    inputs = np.arange(24, dtype=np.uint8).reshape(4, 6)
    outbox = [o for c in clients for o in c.start()]
    while server.phase not in ("done", "aborted"):
        inbox = [o for msg in outbox for o in server.handle(msg.data)]
        assert all(o.recipient != SERVER for o in inbox)
        outbox = []
        for o in inbox:
            client = clients[o.recipient]
            if client.phase == "shared":
                client.provide_input(inputs[o.recipient])
            outbox += client.handle(o.data)
    assert server.survivors == (0, 1, 2, 3)
    np.testing.assert_array_equal(server.result(), inputs.sum(axis=0, dtype=np.uint8))
    assert all(c.phase == "done" for c in clients)
    for c in clients:
        _assert_wiped(c)


def test_pruning_drops_clients_whose_secrets_could_not_be_rebuilt():
    # Harary k=2 ring of 6, t=2: if client 0 never sends its shares, its two neighbours are
    # left with one live neighbour each, and pruning unravels the whole ring: a clean abort.
    setup = RoundSetup(n=6, k=2, threshold=2, length=4, bits=8)
    with pytest.raises(ThresholdError):
        run_round(setup, lambda u: np.zeros(4, np.uint8), dropouts={"share": {0}})


def test_a_committed_client_that_does_not_reveal_aborts_the_attempt():
    """Otherwise the server could drop reveals at will and choose among many graphs."""
    setup = RoundSetup(n=8, k=7, threshold=5, length=4, bits=8)
    report = run_round(setup, lambda u: np.zeros(4, np.uint8), dropouts={"advertise": {3}},
                       raise_on_abort=False)
    assert isinstance(report.aborted, ThresholdError) and "did not reveal" in str(report.aborted)
    # dropping before committing is fine: the client is simply not part of the graph seed
    report = run_round(setup, lambda u: np.ones(4, np.uint8), dropouts={"commit": {3}})
    assert report.survivors == (0, 1, 2, 4, 5, 6, 7)
    np.testing.assert_array_equal(report.total, np.full(4, 7, np.uint8))


def test_a_bare_client_refuses_unsigned_mode():
    """Signed mode is the default outside one process: a device that builds its client without
    saying otherwise refuses an unsigned setup."""
    with pytest.raises(PolicyError, match="signed"):
        SecAggClient(RoundSetup(n=4, k=3, threshold=2, length=6, bits=8), 0)
