"""`tie_embeddings = true`: one vocab x dim table read both ways; Gboard's CIFG shape at 10K is 1.42M
tied (2.38M untied, as Gboard ships it: paper 002 keeps the two embeddings separate).

The tied models train through every runtime exactly like eager (the edge parity tolerance), and
their checkpoints and bundles carry a single table.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from bundle_helpers import program_cache
from edge_models import SEQ_LEN, tiny_config

from dpfleet.coordinator.config import parse_config
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.edge.runtimes import make_runtime
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model, count_parameters, next_token_loss


def tied(arch: str) -> ModelConfig:
    return dataclasses.replace(tiny_config(arch), tie_embeddings=True)


def test_gboard_cifg_size():
    untied = count_parameters(build_model(ModelConfig()))
    tied_count = count_parameters(build_model(ModelConfig(tie_embeddings=True)))
    # embedding 10000 x 96 + CIFG gates (96 + 96) x 3 x 670 + 3 x 670 + projection 670 x 96 + bias 10000
    assert tied_count == 960_000 + 385_920 + 2_010 + 64_320 + 10_000 == 1_422_250
    assert untied - tied_count == 96 * 10_000  # exactly the output table is gone


@pytest.mark.parametrize("arch", ["cifg", "transformer"])
def test_one_table_gets_both_gradients(arch):
    torch.manual_seed(0)
    model = build_model(tied(arch))
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "output.weight" not in names and "output_bias" in names
    tokens = torch.randint(4, 48, (3, SEQ_LEN + 1))
    loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:], 0)
    loss.backward()
    grad = model.embed.weight.grad
    unseen = sorted(set(range(48)) - set(tokens[:, :-1].flatten().tolist()))
    # rows never fed as input still get gradient: through the output side of the same table
    assert grad[unseen].abs().sum() > 0
    for tie in (True, False):  # an unseen row moves every position's logit only when tied
        torch.manual_seed(1)
        m = build_model(dataclasses.replace(tiny_config(arch), tie_embeddings=tie))
        with torch.no_grad():
            before = m(tokens[:, :-1])
            # not a constant shift: a LayerNorm'd hidden state sums to 0
            m.embed.weight[unseen[0]] += torch.randn(m.embed.weight.shape[1])
            change = (m(tokens[:, :-1]) - before)[..., unseen[0]].abs()
        assert change.min() > 1e-6 if tie else change.max() == 0


def test_tying_needs_matching_dims():
    with pytest.raises(DpfleetError, match="projection_dim == model.embedding_dim"):
        ModelConfig(embedding_dim=96, projection_dim=64, tie_embeddings=True)
    cfg = parse_config({"model": {"tie_embeddings": True}})
    assert cfg.model.tie_embeddings
    with pytest.raises(DpfleetError):
        parse_config({"model": {"tie_embeddings": "yes"}})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return program_cache(tmp_path_factory)  # one export per program for the whole run


@pytest.mark.slow  # ~13 s an export (the default suite keeps test_tied_bundle_round_trip)
@pytest.mark.parametrize("runtime", ["onnx", "executorch"])
@pytest.mark.parametrize("arch", ["cifg", "transformer"])
def test_tied_training_matches_eager(arch, runtime, cache_dir):
    pytest.importorskip("onnxruntime")
    if runtime == "executorch":
        pytest.importorskip("executorch")
    cfg = tied(arch)
    rng = np.random.default_rng(0)
    rows = rng.integers(4, 48, (11, SEQ_LEN + 1))
    rows[3, 3:] = 0
    eager = EagerRuntime(cfg, 1)
    theta0 = eager.get_weights()
    eager.train_epoch(rows, lr=0.5, batch_size=4, seed=3)
    rt = make_runtime(runtime, cfg, SEQ_LEN, 1, cache_dir)
    rt.set_weights(theta0)
    rt.train_epoch(rows, lr=0.5, batch_size=4, seed=3)
    d_ref, d_got = eager.get_weights() - theta0, rt.get_weights() - theta0
    assert np.abs(d_ref).max() > 1e-3
    assert np.abs(d_got - d_ref).max() <= 1e-6 + 1e-4 * np.abs(d_ref).max()


@pytest.mark.slow
def test_tied_bundle_round_trip(tmp_path, cache_dir):
    """A tied checkpoint exports to a bundle whose client trains like eager."""
    pytest.importorskip("onnxruntime")
    from bundle_helpers import make_bundle, sentences

    from dpfleet.edge.device_client import BundleClient
    from dpfleet.edge.tokenizer import WordTokenizer
    from dpfleet.export.checkpoint import save_checkpoint

    cfg = tied("cifg")
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", build_model(cfg), cfg, WordTokenizer.build(sentences(50, 0), 48))
    summary = make_bundle(tmp_path / "ckpt", tmp_path / "bundle", cache_dir)
    client = BundleClient(tmp_path / "bundle", summary["public_key"])
    assert client.bundle.manifest["model"]["config"]["tie_embeddings"]
    assert summary["files"]["weights.bin"] == 4 * count_parameters(build_model(cfg))
    rows, theta0 = client.examples(sentences(9, 1)), client.weights()
    eager = EagerRuntime(cfg, 1)
    eager.set_weights(theta0)
    eager.train_epoch(rows, lr=client.lr, batch_size=client.batch_size, seed=0)
    d_ref = eager.get_weights() - theta0
    d_got = client.train_epoch(theta0, rows, seed=0)
    assert np.abs(d_got - d_ref).max() <= 1e-6 + 1e-4 * np.abs(d_ref).max()
