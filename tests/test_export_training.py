"""The training program's loss and graph rewrites: same numbers as eager, fewer slow ops."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export.experimental import _export_forward_backward

from dpfleet.export.graph_passes import dedup_nodes, split_addmm
from dpfleet.export.models import ModelConfig, build_model, next_token_loss
from dpfleet.export.training import LossModule, ProgramSpec, example_batch

aten = torch.ops.aten


class Logits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, inputs):
        return self.logits


@pytest.mark.parametrize("scale", [1.0, 1e3])  # 1e3: exp would overflow without the max shift
def test_program_loss_equals_next_token_loss(scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * scale
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[0, 2:] = 0
    targets[2] = 0  # a row of PAD only
    values, grads = [], []
    for loss_fn in (
        lambda m: LossModule(m)(None, targets),
        lambda m: next_token_loss(m(None), targets, 0),
    ):
        m = Logits(logits.clone())
        loss = loss_fn(m)
        loss.backward()
        values.append(loss)
        grads.append(m.logits.grad)
    assert torch.isfinite(values[0])
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert not grads[0][2].any()  # PAD targets get no gradient
    all_pad = LossModule(Logits(logits))(None, torch.zeros_like(targets))
    assert all_pad.item() == 0.0


def count(ep, target):
    return sum(1 for n in ep.graph.nodes if n.target == target)


def test_rewrites_preserve_loss_and_gradients():
    torch.set_num_threads(1)
    cfg = ModelConfig(arch="cifg", vocab_size=40, embedding_dim=8, hidden_dim=12, projection_dim=8)
    spec = ProgramSpec(cfg, seq_len=4, batch=3, fmt="pte")
    args = example_batch(spec)
    model = build_model(cfg)
    ep = _export_forward_backward(torch.export.export(LossModule(model), args))
    before = copy.deepcopy(ep)
    params = [p.detach() for p in model.parameters()]
    assert count(ep, aten.addmm.default) > 0
    nodes = len(ep.graph.nodes)

    assert split_addmm(ep) > 0
    assert dedup_nodes(ep) > 0
    assert count(ep, aten.addmm.default) == 0
    assert len(ep.graph.nodes) < nodes
    # The unrolled loop transposed the recurrent weight at every step; now once per use site.
    permutes = [n for n in ep.graph.nodes if n.target == aten.permute.default]
    assert len({(n.args[0].name, tuple(n.args[1])) for n in permutes}) == len(permutes)

    ref = before.graph_module(*params, *args)
    got = ep.graph_module(*params, *args)
    assert len(ref) == len(got) == 1 + len(params)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    # The signature still names the (possibly renamed) outputs.
    out_names = [a.name for a in ep.graph.output_node().args[0]]
    assert [s.arg.name for s in ep.graph_signature.output_specs] == out_names
