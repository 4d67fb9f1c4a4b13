"""Issue 12 item 1 over real sockets: with uniform participation, plain aggregation, every device
always there and none dropping, and the same dp.noise_seed, `dpfleet coordinator serve`'s run
(devices training remotely through fleet/link.py + fleet/participant.py) releases the same
participation, the same DP metrics and the same final model as `simulate`, bit for bit (the
service sums the float32 reports in position order in float64, as PlainAggregator does)."""

import asyncio
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import load_file
from service_fleet import fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.service.server import shutdown, start


def run_service(cfg, root, **start_kw):
    users, examples = fleet_data(cfg, root / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None, **start_kw)
        devices = asyncio.create_task(run_devices(running.url, keys, examples,
                                                  runtime=cfg.client.runtime))
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        outcomes = await asyncio.wait_for(devices, 30)
        status = running.driver.status()
        await shutdown(running)
        return status, outcomes

    return asyncio.run(main())


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("runtime", ["eager", pytest.param("onnx", marks=pytest.mark.slow)])
def test_the_service_run_is_the_simulation_bit_for_bit(tmp_path, runtime):
    # an exported runtime builds its training program on first use: a longer report deadline
    cfg = tiny_cfg(client={"runtime": runtime}, service={"report_deadline_s": 120.0})
    sim = run_simulation(cfg, tmp_path / "sim", progress=False, log=lambda s: None)
    status, outcomes = run_service(cfg, tmp_path)
    state = tmp_path / "state"
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    assert status["rounds_failed"] == 0
    assert lines(state / "participation.jsonl") == lines(tmp_path / "sim" / "participation.jsonl")
    reported = sorted((r, d) for d, outs in outcomes.items() for r, _, o in outs
                      if o.kind == "reported")
    assert reported == sorted((e["round"] + 1, d) for e in lines(state / "participation.jsonl")
                              for d in e["devices"])
    served, simulated = lines(state / "metrics.jsonl"), sim.metrics
    for a, b in zip(served, simulated, strict=True):
        for key in ("round", "clients", "noise_std", "epsilon", "accuracy", "loss"):
            assert a[key] == b[key], key
    ours = load_file(state / "checkpoint" / "model.safetensors")
    theirs = load_file(tmp_path / "sim" / "checkpoint" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:  # bitwise (max |diff| = 0), the strongest tolerance there is
        np.testing.assert_array_equal(ours[name], theirs[name])
    assert json.loads((state / "privacy.json").read_text())["epsilon"] == sim.privacy["epsilon"]
    for name in ("privacy_report.md", "accuracy.png", "summary.json", "service.log", "config.toml",
                 "config.json"):
        assert (state / name).is_file()
    assert not (state / "admin.json").exists()  # the token goes with the process
