"""Memory-mapped client populations: same rows as the lists, O(cohort) reads, generated = labelled."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.client_data import ClientData
from dpfleet.edge.client_store import build_store, generated, open_store
from dpfleet.errors import DpfleetError


def make_clients(sizes, width=6, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    return [ClientData(f"user{i}", rng.integers(0, vocab, (n, width)).astype(np.int32))
            for i, n in enumerate(sizes)]


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 20), min_size=1, max_size=12), seed=st.integers(0, 1000),
       vocab=st.sampled_from([50, 40_000]))
def test_store_returns_every_clients_own_rows(tmp_path_factory, sizes, seed, vocab):
    clients = make_clients(sizes, vocab=vocab, seed=seed)
    store = build_store(clients, vocab, tmp_path_factory.mktemp("cache"), "test")
    assert len(store) == len(clients)
    for i in np.random.default_rng(seed).permutation(len(clients)):
        np.testing.assert_array_equal(store.examples(int(i)), clients[i].examples)
        assert store.user(int(i)) == clients[i].user
    assert store.rows.dtype == (np.int16 if vocab < 32768 else np.int32)


def test_reopen_and_damaged_store(tmp_path):
    clients = make_clients([3, 1, 4])
    store = build_store(clients, 300, tmp_path, "test")
    folder = tmp_path / next(p.name for p in tmp_path.iterdir())
    again = open_store(folder)
    np.testing.assert_array_equal(again.examples(2), clients[2].examples)
    np.save(folder / "offsets.npy", np.array([0, 3, 4], dtype=np.int64))  # one client lost
    with pytest.raises(DpfleetError, match="disagree"):
        open_store(folder)
    assert store.meta["generated"] is False


def test_generated_population_cycles_real_clients_and_says_so(tmp_path):
    clients = make_clients([2, 5, 3])
    big = generated(build_store(clients, 300, tmp_path, "test"), 1_000_000)
    assert len(big) == 1_000_000
    assert big.meta["generated"] is True and big.meta["cycled_from"] == 3
    cohort = big.clients([0, 4, 999_999])
    np.testing.assert_array_equal(cohort[1].examples, clients[1].examples)  # 4 % 3 == 1
    np.testing.assert_array_equal(cohort[2].examples, clients[0].examples)  # 999999 % 3 == 0
    assert cohort[1].user == "user1#1" and cohort[0].user == "user0#0"  # copies are labelled
    with pytest.raises(IndexError):
        big.examples(1_000_000)
    with pytest.raises(DpfleetError):
        generated(big, 0)


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(DpfleetError, match="no clients"):
        build_store([], 10, tmp_path, "test")
    mixed = make_clients([2]) + make_clients([2], width=7)
    with pytest.raises(DpfleetError, match="same width"):
        build_store(mixed, 300, tmp_path, "test")
    with pytest.raises(DpfleetError, match="not a complete client store"):
        open_store(tmp_path / "nothing")
