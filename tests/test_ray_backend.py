"""`[backend] kind = "ray"` on a local Ray cluster gives the local cohort's updates and model."""

import json

import numpy as np
import pytest
import torch

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.ray_backend import shards
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat


def test_shards_cover_every_client_once_and_balance():
    steps = [5, 1, 1, 3, 2, 2, 8, 1]
    parts = shards(steps, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(steps)))
    loads = [sum(steps[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(steps)
    assert parts == shards(steps, 3)  # fixed by the data: same shards every run
    assert shards([1, 1], 4)[2:] == [[], []]


@pytest.mark.slow
def test_ray_trainer_equals_local_cohort(ray_local):
    from dpfleet.coordinator.engine.ray_backend import RayTrainer

    cfg = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=16, hidden_dim=24, projection_dim=16)
    torch.manual_seed(0)
    theta = get_flat(build_model(cfg))
    rng = np.random.default_rng(0)
    examples = []
    for n in (3, 17, 9, 1, 30, 12):
        rows = rng.integers(4, 64, (n, 10)).astype(np.int32)
        rows[:, 0] = 1
        examples.append(rows)
    seeds = list(range(6))
    kw = {"lr": 0.5, "batch_size": 8, "clip_norm": 0.2}
    local = CohortTrainer(cfg, seq_len=9, batch_size=8, device="cpu").train_round(
        theta, examples, seeds, **kw)
    remote = RayTrainer(cfg, seq_len=9, batch_size=8, workers=2).train_round(theta, examples, seeds, **kw)
    for a, b in zip(local, remote, strict=True):
        np.testing.assert_allclose(b.delta, a.delta, rtol=0, atol=1e-6)
        assert b.norm == pytest.approx(a.norm, rel=1e-5) and b.clipped == a.clipped


@pytest.mark.slow
def test_simulate_on_ray_gives_the_local_model(ray_local, tmp_path):
    from dpfleet.coordinator.engine.simulation import run_simulation

    values = {
        "rounds": 2, "eval_every": 2, "seed": 1, "checkpoint_every": 0,
        "data": {"dataset": "shakespeare", "max_clients": 60, "eval_examples": 100, "max_examples": 24},
        "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},  # public: no DP vocabulary draw
        "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 24, "projection_dim": 16},
        "client": {"lr": 1.0, "batch_size": 8},
        # research-mode noise seed: both runs draw the same noise, so they can be compared
        "dp": {"noise_multiplier": 0.3, "clip_norm": 1.0, "report_goal": 8, "momentum": 0.5,
               "noise_seed": 3},
    }
    quiet = {"progress": False, "log": lambda s: None}
    local = run_simulation(parse_config(values), tmp_path / "local", **quiet)
    remote = run_simulation(parse_config(dict(values, backend={"kind": "ray", "workers": 2})),
                            tmp_path / "ray", **quiet)
    assert json.loads((remote.run_dir / "summary.json").read_text())["client_trainer"] == "ray"
    participation = [(run.run_dir / "participation.jsonl").read_text() for run in (local, remote)]
    assert participation[0] == participation[1]  # the same clients (train loss is debug-only now)
    assert remote.final["loss"] == pytest.approx(local.final["loss"], abs=1e-4)
