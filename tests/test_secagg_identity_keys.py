"""Fleet key files (the out-of-band identity keys of an emulated fleet) and the simulator's
`[aggregation] signed` / threat-model keys."""

import json
import stat

import numpy as np
import pytest

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import make_aggregator
from dpfleet.errors import DpfleetError
from dpfleet.secagg.aggregator import SecAggAggregator
from dpfleet.secagg.identity_keys import create_fleet_file, load_fleet_file, pinned_keys


def test_fleet_file_round_trip_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / "fleet.json"
    keys = create_fleet_file(path, 5)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert pinned_keys(load_fleet_file(path)) == pinned_keys(keys)
    with pytest.raises(DpfleetError, match="already exists"):
        create_fleet_file(path, 5)
    with pytest.raises(TypeError):
        pinned_keys(keys)[0] = b"x" * 32  # read-only: nobody rewrites a pinned key


@pytest.mark.parametrize("content,message", [
    ("not json", "not readable JSON"),
    (json.dumps({"version": 9, "keys": {}}), "expected"),
    (json.dumps({"version": 1, "keys": {"0": "zz"}}), "bad key for client"),
    (json.dumps({"version": 1, "keys": {"1": "00" * 32}}), "client ids"),
])
def test_bad_fleet_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "fleet.json"
    path.write_text(content)
    with pytest.raises(DpfleetError, match=message):
        load_fleet_file(path)
    with pytest.raises(DpfleetError, match="not found"):
        load_fleet_file(tmp_path / "missing.json")


def test_signed_aggregation_with_a_fleet_file(tmp_path):
    path = tmp_path / "fleet.json"
    create_fleet_file(path, 6)
    deltas = [np.full(20, 0.01 * u) for u in range(6)]
    result = SecAggAggregator(clip_norm=1.0, signed=True, fleet_keys=path).aggregate(deltas, 1)
    assert result.info["signed"] and result.survivors == list(range(6))
    np.testing.assert_allclose(result.total, np.sum(deltas, axis=0),
                               atol=result.info["quantization_bound"])
    too_small = SecAggAggregator(clip_norm=1.0, signed=True, fleet_keys=path)
    with pytest.raises(DpfleetError, match="holds 6 identity keys"):
        too_small.aggregate([np.zeros(20)] * 8, 1)


def test_simulator_selects_signed_mode_and_the_threat_model():
    cfg = parse_config({"aggregation": {"kind": "secagg", "signed": True, "corruption": 0.1}})
    aggregator = make_aggregator(cfg)
    assert aggregator.signed and aggregator.corruption == 0.1
    with pytest.raises(DpfleetError, match="corruption"):
        parse_config({"aggregation": {"kind": "secagg", "corruption": 0.6}})
    with pytest.raises(DpfleetError, match="fleet_keys needs"):
        parse_config({"aggregation": {"kind": "secagg", "fleet_keys": "f.json"}})
