"""A dropout between commit and reveal no longer aborts the attempt, and the room it gives a
dishonest server (withholding up to d reveals to choose among graphs) is bounded and paid for.

The attacks are measured on the values: how often a grinding server pushes a target's
corrupt-neighbour count above c (against the union bound the planner sizes c with), which graph
a real client derives from a withheld reveal set, and whether it shares anything at all when
more than d reveals are missing.
"""

import dataclasses
import math

import numpy as np
import pytest
from reveal_grinding import exceed_rates, grind, slack
from secagg_attacker import MaliciousServer

from dpfleet.secagg import messages as m
from dpfleet.secagg.errors import PolicyError, ProtocolViolationError, ThresholdError
from dpfleet.secagg.graph import choice_bits, corrupt_bound, log_tails, plan_graph
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import RoundSetup, fleet_margins, graph_seed, plan_round
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.setup_wire import decode_setup, encode_setup

TARGET = 0


def _inputs(n, length=32, bits=16, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << bits, (n, length)).astype(np.uint16)


def test_withholding_grinding_is_bounded_by_the_planned_choice():
    """n = 40, k = 6, 20% colluders, d = 2 (G = 781 graphs a withholding server can pick for
    the target). With c sized for one graph (tail <= 2^-4) the grinder beats it in most
    attempts -- which is why the planner pays log2 G bits -- while with c sized for all G
    (2^-(4 + log2 G) per graph) it stays within the union bound; the honest graph within 2^-4."""
    n, k, gamma, d, sigma = 40, 6, 0.2, 2, 4.0
    result = grind(n, k, gamma, d, trials=60, seed=3, target=TARGET)
    assert result["graphs"] == 781
    rates = {row["c"]: row for row in exceed_rates(result)}
    c_one = corrupt_bound(k, 1, gamma, sigma)  # per target: no union over clients here
    c_all = corrupt_bound(k, 1, gamma, sigma + choice_bits(n - 1, d))
    assert (c_one, c_all) == (3, 5)
    assert rates[c_one]["honest_rate"] <= 2 ** -sigma + slack(2 ** -sigma, 60)
    assert rates[c_one]["grinder_rate"] >= 0.5  # grinding works against a c blind to it
    bound = rates[c_all]["union_bound"]
    assert bound <= 2 ** -sigma
    assert rates[c_all]["grinder_rate"] <= bound + slack(bound, 60)


@pytest.mark.parametrize("n", [200, 1000])
def test_planner_sizes_c_for_every_graph_the_server_can_choose(n):
    """plan_graph with d: per graph, n * G * P[Bin(k, 0.05) > c] <= 2^-40 (the union bound over
    clients and the server's choices); with d = 0 the same c would not meet it."""
    d = 5
    plan = plan_graph(n, "harary", 0.1, 0.05, unrevealed=d)
    blind = plan_graph(n, "harary", 0.1, 0.05)
    log_g = choice_bits(n, d)
    assert log_g == pytest.approx(np.log2(sum(math.comb(n, i) for i in range(d + 1))))
    tail = log_tails(plan.k, 0.05)[plan.corrupt + 1] / np.log(2)  # log2 P[Bin > c]
    assert np.log2(n) + log_g + tail <= -40
    blind_tail = log_tails(blind.k, 0.05)[blind.corrupt + 1] / np.log(2)
    assert np.log2(n) + log_g + blind_tail > -40  # the old plan does not cover the choice
    assert plan.k > blind.k and 2 * plan.threshold > plan.k + plan.corrupt
    # the complete graph is the same under every seed: d costs nothing there
    assert plan_graph(60, "complete", unrevealed=30) == plan_graph(60, "complete")


def _withholding_round(d, left_out):
    """A real round whose server leaves `left_out` out of the reveals it forwards (to everyone:
    one consistent graph) and forwards each client the adverts of its neighbours in the graph
    that choice gives; the left-out clients are dropouts to everyone else."""
    setup = RoundSetup(n=40, k=8, threshold=5, length=16, bits=16, corrupt=0, unrevealed=d)
    attack = MaliciousServer(setup, None, _inputs(40, 16))
    chosen = {}

    def reveals(u, opened):
        view = tuple(r for r in opened if r[0] not in left_out)
        chosen["graph"] = setup.graph(graph_seed(attack.ctx, view))
        return view

    def adverts(u, blobs):
        return tuple(attack.adverts[v] for v in sorted(chosen["graph"].neighbours(u))
                     if v not in left_out)

    attack.run_until_masked(reveals=reveals, adverts=adverts)
    return attack, chosen["graph"]


def test_a_client_takes_up_to_d_missing_reveals_and_refuses_more():
    """d = 2: two withheld reveals give the target the graph the server chose (the client's
    own neighbours are exactly that graph's); a third is refused before it shares anything."""
    attack, graph = _withholding_round(2, {5, 9})
    assert set(attack.rejected) == {5, 9}  # their own reveals are missing: they stop
    assert attack.clients[TARGET].neighbours == graph.neighbours(TARGET)
    assert TARGET in attack.share_keys and TARGET in attack.masked
    attack, _ = _withholding_round(2, {5, 9, 11})
    assert isinstance(attack.rejected[TARGET], ProtocolViolationError)
    assert TARGET not in attack.share_keys and TARGET not in attack.masked
    assert attack.clients[TARGET].phase == "advertised"  # nothing shared, nothing masked


@pytest.mark.parametrize("graph", ["harary", "complete"])
def test_commit_to_reveal_dropouts_up_to_d_complete_with_the_exact_sum(graph):
    """Old main aborted the attempt on the first committed client that did not reveal."""
    n, length, bits = 60, 24, 16
    k = 12 if graph == "harary" else n - 1
    setup = RoundSetup(n=n, k=k, threshold=k // 2 + 2, length=length, bits=bits, corrupt=2,
                       unrevealed=3)
    inputs = _inputs(n, length, bits, seed=4)
    gone = {"advertise": {2, 17, 40}, "share": {8}, "mask": {33}}
    report = run_round(setup, inputs.__getitem__, dropouts=gone)
    survivors = set(range(n)) - {2, 17, 40, 8, 33}
    assert set(report.survivors) == survivors
    expected = inputs[sorted(survivors)].astype(np.int64).sum(axis=0) % (1 << bits)
    np.testing.assert_array_equal(report.total, expected)


def test_more_than_d_non_revealers_abort_before_anything_is_shared():
    setup = RoundSetup(n=60, k=12, threshold=8, length=8, bits=16, corrupt=2, unrevealed=3)
    shared = []

    def watch(phase, sender, recipient, data):
        if phase == "share" and sender != m.SERVER:
            shared.append(sender)
        return [data]

    report = run_round(setup, lambda u: np.zeros(8, np.uint16),
                       dropouts={"advertise": {1, 2, 3, 4}}, intercept=watch, raise_on_abort=False)
    assert isinstance(report.aborted, ThresholdError) and "did not reveal" in str(report.aborted)
    assert shared == [] and report.total.size == 0


def test_policy_refuses_more_room_to_withhold_than_configured():
    """A server handing a device a sparse setup with a larger d (more graphs to choose among)
    than the device's own config plans is refused before the device sends anything."""
    setup, _, _ = plan_round(200, 8, 16, "harary", unrevealed=2)
    policy = ClientPolicy.for_setup(setup)  # unsigned here: the check is about d alone
    policy.check(setup, 0, None, None)
    with pytest.raises(PolicyError, match="unrevealed 20 > 2"):
        policy.check(dataclasses.replace(setup, unrevealed=20), 0, None, None)
    # on the complete graph the seed changes nothing, so no d is refused there
    complete, _, _ = plan_round(30, 8, 16, "complete", unrevealed=9)
    ClientPolicy(require_signed=False).check(complete, 0, None, None)


def test_d_is_bound_in_the_setup_hash_and_on_the_wire():
    setup, _, _ = plan_round(50, 8, 16, "harary", unrevealed=4)
    assert dataclasses.replace(setup, unrevealed=5).setup_hash != setup.setup_hash
    assert decode_setup(encode_setup(setup)) == setup
    plain = dataclasses.replace(setup, unrevealed=0)  # d = 0 hashes and encodes as before
    assert encode_setup(plain)[4] == 1 and decode_setup(encode_setup(plain)) == plain


def test_fleet_margins_cover_the_over_selection():
    """The service's d: never more than the over-selection can lose (more missing reveals
    leave too few survivors for the goal anyway), never less than one phase's 2^-20 tail."""
    assert fleet_margins(100, 100) == (0.1, 0)  # no over-selection: any dropout fails anyway
    dropout, d = fleet_margins(170, 100)
    assert dropout == pytest.approx(70 / 170) and 0 < d <= 70
    p = 1 - (1 - dropout) ** (1 / 6)
    assert np.exp(log_tails(170, p)[d + 1]) <= 2 ** -20 < np.exp(log_tails(170, p)[d])
    assert fleet_margins(26, 20)[1] == 6  # examples/fleet.toml: all six over-selected
