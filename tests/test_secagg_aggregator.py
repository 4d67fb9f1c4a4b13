"""The round engine's view: SecAggAggregator returns the plain sum within the proven bound."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.engine.aggregation import Aggregator, PlainAggregator
from dpfleet.errors import DpfleetError
from dpfleet.secagg.aggregator import SecAggAggregator
from dpfleet.secagg.errors import ThresholdError


def _deltas(n, d, clip, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=d)
        out.append(x * (clip * rng.uniform(0.1, 1.0) / np.linalg.norm(x)))
    return out


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 12),
    d=st.integers(1, 2000),
    bits=st.sampled_from([16, 20, 24, 32]),
    graph=st.sampled_from(["complete", "harary"]),
    dropout=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**31),
)
def test_sum_equals_the_plain_sum_within_the_quantization_bound(n, d, bits, graph, dropout, seed):
    clip = 0.5
    deltas = _deltas(n, d, clip, seed)
    agg = SecAggAggregator(clip_norm=clip, bits=bits, graph=graph, assumed_dropout=max(dropout, 0.1))
    gone = np.random.default_rng(seed).choice(n, size=round(dropout * n), replace=False).tolist()
    result = agg.aggregate(deltas, round_seed=seed, dropouts={"mask": gone})
    plain = PlainAggregator().aggregate([deltas[i] for i in result.survivors], seed).total
    info = result.info
    assert result.total.shape == (d,) and result.total.dtype == np.float64
    assert len(result.survivors) == n - round(dropout * n)
    assert sorted(set(result.survivors) | set(info["dropped"])) == list(range(n))
    assert info["clipped_coordinates"] == 0
    assert np.linalg.norm(result.total - plain) <= info["quantization_bound"]
    assert info["sensitivity"] == pytest.approx(clip * info["norm_inflation"])
    assert info["norm_inflation"] >= 1 and info["rejected_messages"] == 0


def test_conforms_to_the_aggregator_protocol_and_reports_costs():
    agg: Aggregator = SecAggAggregator(clip_norm=1.0, signed=True)
    result = agg.aggregate(_deltas(8, 300, 1.0, 0), round_seed=3)
    info = result.info
    assert result.survivors == list(range(8))
    for key in ("bytes_sent_per_client", "bytes_received_per_client", "quantization_bound",
                "norm_inflation", "k", "threshold"):
        assert info[key] > 0
    assert set(info["client_seconds"]) == set(info["server_seconds"]) >= {"share", "mask"}
    assert info["server_seconds"]["consistency"] > 0  # signed mode runs the consistency round
    assert info["signed"] and 2 * info["threshold"] > info["k"] + info["assumed_corrupt"]


def test_overlong_deltas_are_clipped_not_trusted():
    deltas = [np.full(50, 10.0), np.zeros(50), np.zeros(50)]
    result = SecAggAggregator(clip_norm=1.0).aggregate(deltas, round_seed=0)
    assert result.info["inputs_scaled_down"] == 1
    assert np.linalg.norm(result.total) <= result.info["sensitivity"] + 1e-9


def test_too_many_dropouts_abort():
    with pytest.raises(ThresholdError):
        SecAggAggregator(clip_norm=1.0, threshold=5, assumed_dropout=0.5).aggregate(
            _deltas(6, 10, 1.0, 1), round_seed=1, dropouts={"mask": [0, 2, 4]})


def test_bad_settings():
    with pytest.raises(ValueError):
        SecAggAggregator(clip_norm=0)
    with pytest.raises(ValueError):
        SecAggAggregator(clip_norm=1.0).aggregate([], round_seed=0)


@pytest.mark.parametrize("make", [PlainAggregator, lambda: SecAggAggregator(clip_norm=1.0)],
                         ids=["plain", "secagg"])
@pytest.mark.parametrize("bad", [(1,), (299,), (301,), (300, 1), ()])
def test_attack_a_wrong_shaped_delta_is_refused_not_broadcast(make, bad):
    """One device sends `[C]` (or any shape but the model's (D,)): summed by broadcasting it would
    move every coordinate by C. Each aggregator refuses it before summing, naming the shapes."""
    deltas = _deltas(6, 300, 1.0, 1)
    deltas[2] = np.full(bad, 1.0 / np.sqrt(max(1, int(np.prod(bad)))))  # norm <= C
    with pytest.raises(DpfleetError, match=rf"client 2 .*shape {re.escape(str(bad))}.*\(300,\)"):
        make().aggregate(deltas, round_seed=0, dim=300)
    with pytest.raises(DpfleetError, match=r"client 2 "):  # no `dim`: the first delta's length
        make().aggregate(deltas, round_seed=0)
    short = [np.full(1, 1.0)] + _deltas(5, 300, 1.0, 2)  # the first one short: dim says so
    with pytest.raises(DpfleetError, match=r"client 0 .*shape \(1,\)"):
        make().aggregate(short, round_seed=0, dim=300)
