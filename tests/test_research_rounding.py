"""Research-mode rounding: with `dp.noise_seed` a SecAgg assignment carries its device's keyed
rounding seed (the simulation's draw for that round, attempt and position), with secret noise
none; a device not set up for research runs ignores the field and draws its own randomness.
End to end (simulate and serve releasing the same bits): tests/test_service_parity.py."""

import asyncio
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import checkin_all, fleet_data, serving, tiny_cfg

from dpfleet.coordinator.engine.simulation import derive_seed
from dpfleet.fleet.participant import _rounding
from dpfleet.secagg.encoding import rounding_rng, rounding_seed

SECAGG = {"kind": "secagg", "signed": True}


def first_assignments(tmp_path, noise_seed: int) -> dict:
    """Every device's reply to its first check-in of a SecAgg run with `noise_seed`."""
    cfg = tiny_cfg(rounds=1, aggregation=SECAGG, dp={"noise_seed": noise_seed},
                   service={"overselect": 0.0})
    users, _ = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        async with serving(cfg, tmp_path / "state", keys) as (_, links):
            return await checkin_all(links)

    return {u: r for u, r in asyncio.run(main()).items() if r["kind"] == "assignment"}


@pytest.mark.parametrize("noise_seed", [-1, 11], ids=["secret-noise", "research"])
def test_only_a_research_runs_assignments_carry_the_keyed_rounding_seed(tmp_path, noise_seed):
    jobs = first_assignments(tmp_path, noise_seed)
    assert len(jobs) == 3  # the report goal, no over-selection
    if noise_seed < 0:  # secret noise: nothing about the rounding leaves the coordinator
        assert not any("rounding_seed" in job for job in jobs.values())
        return
    for job in jobs.values():
        disc_seed = job["secagg"]["discretizer"]["seed"]
        # round 1 (index 0), attempt 1: the simulation's round seed, not keyed by the attempt
        assert disc_seed == derive_seed(5, "agg", 0)
        assert job["rounding_seed"] == [disc_seed, 0xE1C, job["position"]]
    assert sorted(job["position"] for job in jobs.values()) == [0, 1, 2]


def test_a_device_takes_the_seed_only_when_set_up_for_research_runs():
    seed = json.loads(json.dumps(rounding_seed(1234, 2)))  # as it arrives over the wire
    keyed = np.random.default_rng([1234, 0xE1C, 2]).random(8)  # the simulation's draw
    np.testing.assert_array_equal(_rounding({"rounding_seed": seed}, True).random(8), keyed)
    # not set up for research runs: the field is ignored, the device's own draws differ
    own = _rounding({"rounding_seed": seed}, False).random(8)
    assert not np.array_equal(own, keyed)
    assert not np.array_equal(_rounding({}, True).random(8), keyed)


@pytest.mark.parametrize("bad", [[1, 2], [1, 2, -3], [1, 2, 1 << 32], [1, 2, True], "1 2 3", None])
def test_a_malformed_rounding_seed_is_refused(bad):
    with pytest.raises(ValueError, match="three 32-bit words"):
        rounding_rng(bad)
