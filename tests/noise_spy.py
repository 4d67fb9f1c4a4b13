"""Test-only eyes on the server's noise (tests/test_noise_secrecy.py, test_service_secrecy.py).

An attack test needs what no output holds: the true per-round delta sums, the initial model and
the fresh noise key, to show the released model hides the sum from everyone but the key's holder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

import dpfleet.coordinator.engine.round_engine as round_engine
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLServer


@contextmanager
def spied_noise(monkeypatch) -> Iterator[tuple[list, list, list]]:
    """(sums, start, keys), filled while the block runs: each round's true delta sum, the model
    before the first step, and every noise key drawn. The real functions are back on exit."""
    sums, start, keys = [], [], []
    real_step, real_key = DPFTRLServer.step, round_engine.new_noise_key

    def step(self, delta_sum):
        if not start:
            start.append(self.theta.copy())
        sums.append(np.asarray(delta_sum, dtype=np.float64).copy())
        return real_step(self, delta_sum)

    def key():
        keys.append(real_key())
        return keys[-1]

    monkeypatch.setattr(DPFTRLServer, "step", step)
    monkeypatch.setattr(round_engine, "new_noise_key", key)
    try:
        yield sums, start, keys
    finally:
        monkeypatch.setattr(DPFTRLServer, "step", real_step)
        monkeypatch.setattr(round_engine, "new_noise_key", real_key)
