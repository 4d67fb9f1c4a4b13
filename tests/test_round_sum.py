"""`secagg.round_sum`, the one owner of a round's sum for both drivers: the plain sum (simulate's
`PlainAggregator`, serve's `PlainCollector`) and the SecAgg decode's aggregation record."""

import numpy as np
import pytest

from dpfleet.coordinator.engine.aggregation import PlainAggregator
from dpfleet.coordinator.engine.round_engine import DATA_DEPENDENT_AGGREGATION
from dpfleet.secagg.aggregator import SecAggAggregator
from dpfleet.secagg.round_sum import RECORD_KEYS, plain_sum
from dpfleet.service.uploads import PlainCollector


def test_the_plain_sum_keeps_positions_and_counts_the_bits():
    deltas = [np.array([1.0, 2.0], np.float32), np.array([3.0, -4.0], np.float32)]
    agg = plain_sum(deltas, bits=[1, 1], positions=[0, 3])
    np.testing.assert_array_equal(agg.total, [4.0, -2.0])
    assert agg.total.dtype == np.float64 and agg.survivors == [0, 3] and agg.clipped_count == 2
    same = PlainAggregator().aggregate(deltas, 0, bits=[0, 1])
    np.testing.assert_array_equal(same.total, agg.total)
    assert same.survivors == [0, 1] and same.clipped_count == 1
    with pytest.raises(ValueError, match="1 positions for 2 deltas"):
        plain_sum(deltas, positions=[0])


def test_the_services_plain_sum_counts_clipped_bits_as_the_simulation_does():
    """Reports at positions 2 and 0 of 3 (norms 0.3 and 0.6, threshold C^t = 0.5): the sum in
    position order over [0, 2], and one of them (0.3 <= 0.5) counted, as `simulate` counts."""
    collector = PlainCollector(3, 2, clip_norm=1.0, goal=2)
    two = np.array([0.0, 0.25], "<f4")
    zero = np.array([0.5, 0.0], "<f4")
    collector.accept(2, two.tobytes(), {"X-Dpfleet-Norm": "0.3"})
    collector.accept(0, zero.tobytes(), {"X-Dpfleet-Norm": "0.6"})
    agg = collector.total(0.5)
    np.testing.assert_array_equal(agg.total, [0.5, 0.25])
    assert agg.survivors == [0, 2] and agg.clipped_count == 1
    assert collector.total().clipped_count is None  # fixed clipping: no count


def test_the_simulations_secagg_record_has_every_record_key():
    deltas = [np.full(8, 0.1), np.full(8, -0.05), np.full(8, 0.02)]
    agg = SecAggAggregator(clip_norm=1.0, bits=20).aggregate(deltas, 7, bits=[1, 0, 1])
    scalars = {k for k, v in agg.info.items() if v is None or isinstance(v, int | float | str | bool)}
    assert scalars - set(DATA_DEPENDENT_AGGREGATION) == set(RECORD_KEYS)  # metrics.jsonl's block
    assert agg.info["survivors"] == 3 and agg.info["dropped"] == [] and agg.clipped_count == 2
    assert agg.info["quantization_bound"] == pytest.approx(3 * np.sqrt(8) / agg.info["scale"])
    assert np.linalg.norm(agg.total - np.sum(deltas, axis=0)) <= agg.info["quantization_bound"]
