"""Gboard's CIFG as a zoo preset: its size counted by hand, and one cohort-path round of it equal
to the sequential reference (tolerances of tests/test_edge_cohort.py's `assert_same`)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_edge_cohort import assert_same, both, client_rows

from dpfleet.coordinator.config import load_config, parse_config
from dpfleet.errors import DpfleetError
from dpfleet.export.models import PRESETS, ModelConfig, build_model, count_parameters, with_preset

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
V = 10_004  # TFF StackOverflow: 10,000 words + 1 OOV bucket + PAD / BOS / EOS


def gboard() -> ModelConfig:
    return ModelConfig(**with_preset({"preset": "gboard_cifg", "vocab_size": V}))


def test_gboard_preset_has_the_papers_size_and_shapes():
    """Hand count: embedding 10,004 x 96 = 960,384; CIFG gates (96 + 96) x 3*670 + 3*670 = 387,930;
    projection 670 x 96 = 64,320; tied output bias 10,004. Total 1,422,638 (Hard et al. 2018: 1.4M).
    Untied adds the output table 96 x 10,004 = 960,384: 2,383,022 (paper 002 Sec. 1: 2.4M)."""
    model = build_model(gboard())
    assert count_parameters(model) == 960_384 + 387_930 + 64_320 + 10_004 == 1_422_638
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {"embed.weight": (V, 96), "layers.0.gates.weight": (2010, 192),
                      "layers.0.gates.bias": (2010,), "layers.0.proj.weight": (96, 670),
                      "output_bias": (V,)}
    assert model(torch.ones(2, 5, dtype=torch.long)).shape == (2, 5, V)
    assert count_parameters(build_model(dataclasses.replace(gboard(), tie_embeddings=False))) == 2_383_022


def test_config_preset_fills_the_sizes_and_a_contradicting_key_is_one_error():
    m = parse_config({"model": {"preset": "gboard_cifg", "hidden_dim": 670}}).model  # agreeing: fine
    assert (m.arch, m.embedding_dim, m.hidden_dim, m.projection_dim, m.num_layers) == ("cifg", 96, 670, 96, 1)
    assert m.preset == "gboard_cifg" and m.tie_embeddings is True
    # --set model.preset on a file that states other sizes (examples/tiny.toml: embedding 16)
    with pytest.raises(DpfleetError, match=r"^model.preset = 'gboard_cifg' sets model.embedding_dim = 96, "
                                           r"but the config states 16: remove one of them$"):
        load_config(EXAMPLES / "tiny.toml", {"model.preset": "gboard_cifg"})
    with pytest.raises(DpfleetError, match="unknown model.preset 'gboard'; choose from"):
        parse_config({"model": {"preset": "gboard"}})


def test_gboard_cohort_step_equals_the_sequential_path():
    """One round of 3 clients (ragged: a short last batch, exactly one batch, several) through the
    fused recurrent cohort path at full Gboard size equals the eager sequential trainer; the clip
    sits between the clients' norms so both branches run."""
    sizes = {k: v for k, v in PRESETS["gboard_cifg"].items() if k != "arch"}
    rng = np.random.default_rng(3)
    examples = [client_rows(rng, n) for n in (3, 8, 17)]
    unclipped, _ = both("cifg", examples, [0, 1, 2], clip=1e9, vocab_size=V, **sizes)
    norms = sorted(u.norm for u in unclipped)
    seq, cohort = both("cifg", examples, [0, 1, 2], clip=(norms[0] + norms[1]) / 2, vocab_size=V, **sizes)
    assert_same(seq, cohort)
    assert any(u.clipped for u in seq) and not all(u.clipped for u in seq)
    assert seq[0].delta.size == 1_422_638
