"""benchmarks/peers.py compares systems on one workload file: the plain torch loop it times must do
dpfleet's work exactly (same rows, minibatches, steps, clip), or its speed ratio means nothing.
Checked here on a tiny CIFG, without the peers' venv."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peers_worker import PlainLoop, Workload, dpfleet_round, run_rounds  # noqa: E402

from dpfleet.coordinator.engine.backends import SequentialTrainer  # noqa: E402
from dpfleet.edge.minibatch import batches  # noqa: E402
from dpfleet.edge.runtime import EagerRuntime  # noqa: E402
from dpfleet.edge.tokenizer import PAD  # noqa: E402
from dpfleet.export.models import ModelConfig, build_model  # noqa: E402
from dpfleet.export.params import get_flat  # noqa: E402


def tiny_workload(tmp_path: Path, clip_norm: float = 0.3) -> Workload:
    """Clients of 3..13 rows (partial last minibatches, PAD tails), 2 seeds x 2 rounds of 3, saved
    and loaded back through the file format the systems read."""
    rng = np.random.default_rng(0)
    clients = []
    for n in (3, 5, 8, 9, 13, 6, 4, 11, 7, 10, 12, 5):
        rows = rng.integers(4, 40, size=(n, 9))
        for r in rows:
            r[rng.integers(2, 9):] = PAD
        clients.append(rows)
    cfg = ModelConfig(arch="cifg", vocab_size=40, embedding_dim=8, hidden_dim=16, projection_dim=8)
    theta0 = []
    for s in range(2):
        torch.manual_seed(s)
        theta0.append(get_flat(build_model(cfg)))
    cohorts = np.stack([rng.permutation(len(clients))[:6].reshape(2, 3) for _ in range(2)])
    w = Workload(clients, cohorts, rng.integers(0, 2 ** 31, size=cohorts.shape), np.stack(theta0), [0, 1],
                 cfg, lr=0.5, batch_size=4, clip_norm=clip_norm, noise_multiplier=0.7)
    w.save(tmp_path / "w.npz")
    return Workload.load(tmp_path / "w.npz")


def test_ordered_rows_are_dpfleets_minibatches(tmp_path):
    w = tiny_workload(tmp_path)
    for c, seed in ((4, 11), (1, 3)):
        ordered = w.ordered(c, seed)
        idx = batches(len(w.clients[c]), w.batch_size, seed)
        for i, b in enumerate(idx):
            np.testing.assert_array_equal(ordered[i * w.batch_size:(i + 1) * w.batch_size], w.clients[c][b])
    assert Workload.load(tmp_path / "w.npz", seed=1).theta0.shape[0] == 1


def test_plain_loop_matches_dpfleet_sequential_deltas(tmp_path):
    """Same clipped delta per client: some clipped to C exactly, some under it, none zero (a loop
    that trained on aliased start weights would give zero deltas)."""
    torch.set_num_threads(1)
    w = tiny_workload(tmp_path)
    loop = PlainLoop(w)
    seq = dpfleet_round(SequentialTrainer(EagerRuntime(w.model)), w)
    theta = w.theta0[0].copy()
    clients, seeds = w.cohorts.reshape(-1)[:6], w.batch_seeds.reshape(-1)[:6]
    plain, ref = loop.round(theta, clients, seeds), seq(theta, clients, seeds)
    norms = [float(np.linalg.norm(d)) for d in ref]
    assert any(abs(n - w.clip_norm) < 1e-5 for n in norms) and any(0 < n < w.clip_norm * 0.99 for n in norms)
    for a, b in zip(plain, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_array_equal(theta, w.theta0[0])  # the round left the server's weights alone


def test_plain_and_sequential_runs_end_on_the_same_weights(tmp_path):
    """Whole runs (rounds, server step with noise) agree, and differ from the start weights."""
    torch.set_num_threads(1)
    w = tiny_workload(tmp_path)
    plain, _ = run_rounds(w, PlainLoop(w).round)
    seq, times = run_rounds(w, dpfleet_round(SequentialTrainer(EagerRuntime(w.model)), w))
    assert len(times) == 2 and all(len(t) == 2 for t in times)
    for a, b, start in zip(plain, seq, w.theta0, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.abs(a - start).max() > 0.01
