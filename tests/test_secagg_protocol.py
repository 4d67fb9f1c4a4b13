"""The protocol end to end: exact sums under dropouts in every phase, clean aborts, and the
sans-I/O interface driven by hand."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dpfleet.secagg import messages as m
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


def _oracle(graph, t, fate, signed, slack):
    """Which clients end up in the sum (None: the round must abort), from the protocol's rules:
    more than t commit; all but at most `slack` committers reveal (else the attempt aborts: no
    more graphs to choose among than c is sized for); prune clients with < t live neighbours
    after keys and after shares, need t at each step, and t returned shares for every client
    that shared its secrets."""
    n = len(fate)
    order = {p: i for i, p in enumerate(PHASES)}

    def sends(phase):
        return {u for u in range(n) if fate[u] is None or order[fate[u]] > order[phase]}

    def prune(alive):
        alive = set(alive)
        while weak := {u for u in alive if len(graph.neighbours(u) & alive) < t}:
            alive -= weak
        return alive

    committed, revealed = sends("commit"), sends("advertise")
    if len(committed) <= t or len(committed - revealed) > slack:
        return None
    p1 = prune(revealed)
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
def rounds(draw, sizes=(2, 9), per_phase=None, non_revealers=0, spread=None, most_corrupt=None):
    """A round and each client's fate (the phase it vanishes before, None: stays): each client
    drops with probability about 1/4 (`per_phase` None), or a set of up to `per_phase` clients
    per phase and 1..`non_revealers` between commit and reveal; c up to `most_corrupt` (None:
    all the split-view rule allows), t at most `spread` above the least that rule allows."""
    n = draw(st.integers(*sizes))
    kind = draw(st.sampled_from(["complete", "harary"] if n >= 4 else ["complete"]))
    k = n - 1 if kind == "complete" else draw(st.sampled_from(range(2, n - 1, 2)))
    signed = draw(st.sampled_from([False, False, False, True]))
    phases = [p for p in PHASES if signed or p != "consistency"]
    if per_phase is None:
        fates = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(phases))
        fate = draw(st.lists(fates, min_size=n, max_size=n))
    else:
        fate = [None] * n
        for phase in reversed(phases):  # a client vanishes before the first phase it is in
            most = non_revealers if phase == "advertise" else per_phase
            for u in draw(st.sets(st.integers(0, n - 1), min_size=int(phase == "advertise"),
                                  max_size=most)):
                fate[u] = phase
    corrupt = draw(st.integers(0, min((k - 1) // 2, k if most_corrupt is None else most_corrupt)))
    return {
        "n": n,
        "k": k,
        "corrupt": corrupt,
        "threshold": draw(st.integers((k + corrupt) // 2 + 1, k if spread is None else min(
            k, (k + corrupt) // 2 + 1 + spread))),
        "length": draw(st.integers(1, 300)),
        "bits": draw(st.integers(1, 32)),
        "signed": signed,
        "unrevealed": draw(st.integers(0, 3)),  # d: committed clients that may not reveal
        "fate": fate,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=200, deadline=None)
@given(rounds())
@pytest.mark.slow
def test_exact_sum_with_dropouts_in_every_phase(r):
    _check_round(r)


@settings(max_examples=80, deadline=None)
@given(rounds(sizes=(12, 24), per_phase=1, non_revealers=3, spread=1, most_corrupt=1))
@pytest.mark.slow
def test_exact_sum_with_commit_to_reveal_dropouts(r):
    """Larger rounds, up to one dropout in every other phase and 1-3 committed clients that never
    reveal:
    summed whenever at most d of them (any number on the complete graph) and t remain."""
    _check_round(r)


def _check_round(r):
    """Dropouts in any phase, commit-to-reveal included (up to d on a sparse graph, any number
    on the complete one): the exact sum over the survivors whenever the protocol's rules leave
    t; otherwise a refusal with no sum, and no client's two secrets both handed out."""
    n, t, fate = r["n"], r["threshold"], r["fate"]
    keys = {u: Ed25519PrivateKey.generate() for u in range(n)} if r["signed"] else None
    identities = {u: k.public_key().public_bytes_raw() for u, k in keys.items()} if keys else None
    setup = RoundSetup(n=n, k=r["k"], threshold=t, length=r["length"], bits=r["bits"],
                       corrupt=r["corrupt"], identities=identities, unrevealed=r["unrevealed"])
    inputs = _inputs(r["seed"], n, r["length"], r["bits"], setup.dtype)
    dropouts = {p: {u for u, f in enumerate(fate) if f == p} for p in PHASES}
    released = {"self_mask": {}, "mask_key": {}}  # owner -> holders that returned that share
    shared = []  # clients that sent their secret shares

    def watch(phase, sender, recipient, data):
        if phase == "share" and sender != SERVER:
            shared.append(sender)
        if phase == "unmask" and sender != SERVER:
            for kind, pairs in (("self_mask", m.decode(data).self_mask),
                                ("mask_key", m.decode(data).mask_key)):
                for owner, _ in pairs:
                    released[kind].setdefault(owner, set()).add(sender)
        return [data]

    report = run_round(setup, inputs.__getitem__, keys, dropouts, watch, raise_on_abort=False)
    # the graph is the clients' commit-and-reveal result; any seed would do for the oracle
    graph = report.graph or Graph(n, r["k"])
    expected = _oracle(graph, t, fate, r["signed"], setup.reveal_slack)
    missing = sum(f == "advertise" for f in fate)
    event("aborted" if expected is None else "summed")
    event(f"{'summed' if expected is not None else 'aborted'} with a commit-to-reveal dropout"
          if missing else "no commit-to-reveal dropout")
    both = [w for w in released["self_mask"] if len(released["self_mask"][w]) >= t
            and len(released["mask_key"].get(w, ())) >= t]
    assert both == []  # never both of one client's secrets
    if expected is None:
        assert isinstance(report.aborted, ThresholdError) and report.total.size == 0
        if missing > setup.reveal_slack:  # refused at the reveal: no client shared anything
            assert shared == []
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


def test_more_committed_clients_than_d_that_do_not_reveal_abort_the_attempt():
    """On a sparse graph with d = 0 (old main's rule, for every graph): otherwise the server
    could drop reveals at will and choose among more graphs than c is sized for. On the
    complete graph, which no seed changes, the same dropout is survived."""
    sparse = RoundSetup(n=8, k=4, threshold=3, length=4, bits=8)
    report = run_round(sparse, lambda u: np.zeros(4, np.uint8), dropouts={"advertise": {3}},
                       raise_on_abort=False)
    assert isinstance(report.aborted, ThresholdError) and "did not reveal" in str(report.aborted)
    complete = RoundSetup(n=8, k=7, threshold=5, length=4, bits=8)
    report = run_round(complete, lambda u: np.ones(4, np.uint8), dropouts={"advertise": {3}})
    assert report.survivors == (0, 1, 2, 4, 5, 6, 7)
    np.testing.assert_array_equal(report.total, np.full(4, 7, np.uint8))
    # dropping before committing is fine: the client is simply not part of the graph seed
    report = run_round(sparse, lambda u: np.ones(4, np.uint8), dropouts={"commit": {3}})
    assert 3 not in report.survivors and len(report.survivors) >= 3
    np.testing.assert_array_equal(report.total, np.full(4, len(report.survivors), np.uint8))


def test_a_bare_client_refuses_unsigned_mode():
    """Signed mode is the default outside one process: a device that builds its client without
    saying otherwise refuses an unsigned setup."""
    with pytest.raises(PolicyError, match="signed"):
        SecAggClient(RoundSetup(n=4, k=3, threshold=2, length=6, bits=8), 0)
