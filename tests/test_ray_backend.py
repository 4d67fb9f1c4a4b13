"""`[backend] kind = "ray"` on a local Ray cluster gives the local cohort's updates and model."""

import json

import numpy as np
import pytest
import torch

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.ray_backend import cluster_kernels, cluster_precision, shards
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.edge.native_cell import cell
from dpfleet.edge.precision import Precision, native_bf16, resolve_precision
from dpfleet.errors import DpfleetError
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


AMX = Precision("bfloat16", "auto: CPU has AMX-BF16")
NO_BF16 = Precision("float32", "auto: CPU has no AMX-BF16 or AVX512-BF16, torch kernels AVX2")


def test_one_precision_for_the_whole_cohort():
    """Each worker resolves `client.precision` on its own CPU; the cohort runs at one precision."""
    assert cluster_precision("auto", [("a", AMX), ("b", AMX)]) == Precision(
        "bfloat16", "auto: every Ray worker's CPU has native BF16 (a: AMX-BF16; b: AMX-BF16)")
    assert cluster_precision("auto", [("a", NO_BF16), ("a", NO_BF16)]) == Precision(
        "float32", "auto: no Ray worker's CPU has native BF16 (a: CPU has no AMX-BF16 or "
                   "AVX512-BF16, torch kernels AVX2)")
    # a mixed cluster under "auto": float32 everywhere, said so, rather than a cohort of two precisions
    mixed = cluster_precision("auto", [("a", AMX), ("b", NO_BF16), ("c", NO_BF16)])
    assert mixed == Precision(
        "float32", "auto: the Ray workers on b, c have no native BF16 (b: CPU has no AMX-BF16 or "
                   "AVX512-BF16, torch kernels AVX2), so every worker runs float32: one precision "
                   "for the cohort keeps a round's result independent of which node trained which "
                   "shard")
    with pytest.raises(DpfleetError, match=r"^client.precision = 'bfloat16' but the Ray workers on b "
                                           r"have no native BF16 \(b: CPU has no AMX-BF16"):
        cluster_precision("bfloat16", [("a", AMX), ("b", NO_BF16)])
    assert cluster_precision("bfloat16", [("a", AMX)]) == Precision(
        "bfloat16", "precision = 'bfloat16': every Ray worker's CPU has native BF16 (a: AMX-BF16)")
    assert cluster_precision("float32", [("a", AMX)]) == resolve_precision("float32")


def test_the_workers_kernel_builds_are_stated_one_or_each():
    """Each Ray worker builds the bfloat16 kernels for its own CPU and compiler: one build where
    all run it, else each host's (a resume on another set of builds is then said, as locally)."""
    c = {"elementwise": "fused C kernels (cc, lstm_cell-c.so)", "kernels": "lstm_cell-c.so"}
    d = {"elementwise": "fused C kernels (gcc, lstm_cell-d.so)", "kernels": "lstm_cell-d.so"}
    assert cluster_kernels([("a", c), ("a", c), ("b", c)]) == c
    assert cluster_kernels([("b", d), ("a", c), ("b", d)]) == {
        "elementwise": "a: fused C kernels (cc, lstm_cell-c.so); b: fused C kernels (gcc, lstm_cell-d.so)",
        "kernels": "lstm_cell-c.so + lstm_cell-d.so"}
    assert cluster_kernels([("a", {}), ("b", {})]) == {}  # float32: no elementwise kernels


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
def test_ray_workers_train_at_the_precision_their_cpus_resolve(ray_local):
    """`client.precision = "auto"` on Ray: what the workers resolve on their CPUs (here this
    machine's), and the updates are those of the local cohort at that precision."""
    from dpfleet.coordinator.engine.ray_backend import RayTrainer

    cfg = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=16, hidden_dim=24, projection_dim=16)
    torch.manual_seed(0)
    theta = get_flat(build_model(cfg))
    rng = np.random.default_rng(1)
    examples = [np.concatenate([np.ones((n, 1), np.int32), rng.integers(4, 64, (n, 9), np.int32)], 1)
                for n in (5, 11, 7)]
    kw = {"lr": 0.5, "batch_size": 8, "clip_norm": 0.2}
    here = resolve_precision("auto", params=sum(p.numel() for p in build_model(cfg).parameters()))
    remote = RayTrainer(cfg, seq_len=9, batch_size=8, workers=2, precision="auto")
    assert remote.precision.name == here.name and "Ray worker" in remote.precision.reason
    local = CohortTrainer(cfg, seq_len=9, batch_size=8, device="cpu", precision="auto",
                          processes=False).train_round(theta, examples, [0, 1, 2], **kw)
    for a, b in zip(local, remote.train_round(theta, examples, [0, 1, 2], **kw), strict=True):
        np.testing.assert_allclose(b.delta, a.delta, rtol=0, atol=1e-6 if here.name == "float32" else 2e-3)


@pytest.mark.slow
@pytest.mark.skipif(native_bf16() is None, reason="needs a CPU with native BF16")
def test_ray_states_the_kernels_its_workers_built(ray_local):
    """At bfloat16 summary.json's `precision` names the workers' C kernel build (here this
    machine's, as a local cohort's would), which the resume points then keep. (An explicit
    "bfloat16" on a model under auto's size rule was refused as "no native BF16" before.)"""
    from dpfleet.coordinator.engine.backends import trainer_precision
    from dpfleet.coordinator.engine.ray_backend import RayTrainer

    cfg = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=16, hidden_dim=24, projection_dim=16)
    remote = RayTrainer(cfg, seq_len=9, batch_size=8, workers=2, precision="bfloat16")
    local = CohortTrainer(cfg, seq_len=9, batch_size=8, device="cpu", precision="bfloat16",
                          processes=False)
    stated = trainer_precision(remote)
    assert stated["used"] == "bfloat16" and stated["kernels"] == cell().identity
    assert {k: stated[k] for k in ("elementwise", "kernels")} == {
        k: trainer_precision(local)[k] for k in ("elementwise", "kernels")}


@pytest.mark.slow
def test_simulate_on_ray_gives_the_local_model(ray_local, tmp_path):
    from dpfleet.coordinator.engine.simulation import run_simulation

    values = {
        "rounds": 2, "eval_every": 2, "seed": 1, "checkpoint_every": 0,
        "data": {"dataset": "shakespeare", "max_clients": 60, "eval_examples": 100, "max_examples": 24},
        "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},  # public: no DP vocabulary draw
        "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 24, "projection_dim": 16},
        "client": {"lr": 1.0, "batch_size": 8, "precision": "auto"},
        # research-mode noise seed: both runs draw the same noise, so they can be compared
        "dp": {"noise_multiplier": 0.3, "clip_norm": 1.0, "report_goal": 8, "momentum": 0.5,
               "noise_seed": 3},
    }
    quiet = {"progress": False, "log": lambda s: None}
    local = run_simulation(parse_config(values), tmp_path / "local", **quiet)
    remote = run_simulation(parse_config(dict(values, backend={"kind": "ray", "workers": 2})),
                            tmp_path / "ray", **quiet)
    summary = json.loads((remote.run_dir / "summary.json").read_text())
    assert summary["client_trainer"] == "ray"
    # what the workers ran (client.precision = "auto" resolved on their CPUs), not a float32 default
    size = sum(p.numel() for p in local.model.parameters())  # "auto" reads the model's size too
    assert summary["precision"]["used"] == resolve_precision("auto", params=size).name
    assert "Ray worker" in summary["precision"]["reason"]
    participation = [(run.run_dir / "participation.jsonl").read_text() for run in (local, remote)]
    assert participation[0] == participation[1]  # the same clients (train loss is debug-only now)
    assert remote.final["loss"] == pytest.approx(local.final["loss"], abs=1e-4)
