import pytest
import torch

from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model, count_parameters, next_token_loss


def expected_params(cfg: ModelConfig) -> int:
    v, e, h, p = cfg.vocab_size, cfg.embedding_dim, cfg.hidden_dim, cfg.projection_dim
    if cfg.arch == "transformer":
        block = 2 * 2 * e + (e * 3 * e + 3 * e) + (e * e + e) + (e * h + h) + (h * e + e)
        return v * e + cfg.max_length * e + block * cfg.num_layers + 2 * e + (e * v + v)
    gates = 3 if cfg.arch == "cifg" else 4
    layer_in = [e] + [p] * (cfg.num_layers - 1)
    rec = sum((d + p) * gates * h + gates * h + h * p for d in layer_in)
    return v * e + rec + p * v + v


@pytest.mark.parametrize("arch", ["cifg", "lstm", "transformer"])
@pytest.mark.parametrize("layers", [1, 2])
def test_shapes_and_parameter_counts(arch, layers):
    cfg = ModelConfig(arch=arch, vocab_size=300, embedding_dim=16, hidden_dim=24,
                      projection_dim=12, num_layers=layers, num_heads=4)
    model = build_model(cfg)
    out = model(torch.randint(0, 300, (3, 9)))
    assert out.shape == (3, 9, 300)
    assert count_parameters(model) == expected_params(cfg)


def test_gboard_cifg_size():
    # paper 002: CIFG, 670 hidden, 96 embedding, projection 96, separate in/out embeddings
    cfg = ModelConfig(arch="cifg", vocab_size=10_000)
    assert count_parameters(build_model(cfg)) == expected_params(cfg) == 2_382_250


@pytest.mark.parametrize("arch", ["cifg", "lstm", "transformer"])
def test_models_are_causal(arch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, vocab_size=50, embedding_dim=8, hidden_dim=8,
                                    projection_dim=8, num_heads=2))
    x = torch.randint(0, 50, (1, 10))
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % 50
    torch.testing.assert_close(model(x)[:, :6], model(y)[:, :6])
    assert not torch.allclose(model(x)[:, 6:], model(y)[:, 6:])


def test_loss_ignores_padding():
    logits = torch.randn(2, 4, 7)
    targets = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]])
    manual = torch.stack([
        torch.nn.functional.cross_entropy(logits[0, 0], targets[0, 0]),
        torch.nn.functional.cross_entropy(logits[0, 1], targets[0, 1]),
        torch.nn.functional.cross_entropy(logits[1, 0], targets[1, 0]),
    ]).mean()
    torch.testing.assert_close(next_token_loss(logits, targets, pad_id=0), manual)


def test_bad_model_config():
    with pytest.raises(DpfleetError, match="unknown architecture"):
        ModelConfig(arch="gru")
    with pytest.raises(DpfleetError, match="divisible"):
        ModelConfig(arch="transformer", embedding_dim=10, num_heads=4)
