"""Attacks on a finished coordinator service's state directory, as someone it was published to.

`serve --state DIR` leaves simulate's run directory in DIR plus state.sqlite, service.log and the
bundle files. The test spies on the DP-FTRL server (the true, noise-free sums) and on the key
draw, so an attack is scored ON THE VALUE: the error left after subtracting the attacker's noise
guess. With the real key the noise comes off to float32 rounding (the attack is real); with any
guess built from the published files it stays in, and neither the key nor any node vector is in
any published byte, the SQLite database and the service log included."""

import asyncio
import hashlib
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from noise_spy import spied_noise
from safetensors.numpy import load_file
from service_fleet import fleet_data, serve_to_end, tiny_cfg

from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes

ROUNDS = 3


def test_a_published_service_state_neither_holds_nor_rebuilds_the_noise(tmp_path, monkeypatch):
    # momentum 0 and server lr 1: theta_T - theta_0 = (sum of the round sums + prefix noise) / m
    cfg = tiny_cfg(rounds=ROUNDS, dp={"noise_seed": -1, "momentum": 0.0, "server_lr": 1.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    device_keys = {u: Ed25519PrivateKey.generate() for u in users}
    state = tmp_path / "state"

    with spied_noise(monkeypatch) as (sums, start_theta, keys):
        asyncio.run(serve_to_end(cfg, state, device_keys, examples))
    (key,) = keys
    assert len(sums) == ROUNDS
    theta0, true_sum = start_theta[0], np.sum(sums, axis=0)
    metrics = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
    std, dim, m = metrics[-1]["noise_std"], theta0.size, cfg.dp.report_goal
    released = load_file(str(state / "checkpoint" / "server_state.safetensors"))["theta"]
    noisy_sum = (released.astype(np.float64) - theta0) * m

    def error(guess_key: bytes) -> float:
        nodes = GaussianNodes(guess_key, std, dim)
        guess = sum(nodes(0, lv, ix) for lv, ix in prefix_nodes(ROUNDS))
        return float(np.linalg.norm(noisy_sum - guess - true_sum))

    noise = float(np.linalg.norm(noisy_sum - true_sum))
    assert noise == pytest.approx(std * np.sqrt(2 * dim), rel=0.05)  # prefix 3 = two nodes
    assert error(key) < 1e-3 * noise  # whoever holds the key sees the devices' sum
    published = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    assert state / "state.sqlite" in published and state / "service.log" in published
    assert not (state / "noise_key").exists() and not (state / "rounds").exists()
    guesses = {"zero key": bytes(32)}
    for path, data in published.items():
        guesses[f"sha256 of {path.name}"] = hashlib.sha256(data).digest()
    for name, guess in guesses.items():
        assert error(guess) > 1.2 * noise, name  # a wrong key adds independent noise
    vectors = [GaussianNodes(key, std, dim)(0, lv, ix).astype("<f4").tobytes()[:64]
               for t in range(1, ROUNDS + 1) for lv, ix in prefix_nodes(t)]
    for path, data in published.items():
        assert key not in data and key.hex().encode() not in data, path
        assert not any(v in data for v in vectors), path
