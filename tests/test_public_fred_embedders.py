"""FreD's embedders on real runtimes: the teacher's hidden states and the on-device LM's table."""

import numpy as np

from dpfleet.public.embedders import DeviceLMEmbedder, Projection, TeacherEmbedder

TEXTS = ["To be, or not to be, that is the question.", "The cat sat on the mat.", ""]


def test_teacher_embedder_mean_pools_hidden_states(tiny_teacher_dir):
    emb = TeacherEmbedder(str(tiny_teacher_dir), device="cpu", progress=False)
    x = emb.embed(TEXTS)
    assert x.shape == (3, emb.dim) and x.dtype == np.float32 and np.isfinite(x).all()
    assert not np.allclose(x[0], x[1])
    # padding must not change a text's embedding: alone or in a batch, the same vector
    assert np.allclose(emb.embed(TEXTS[1:2])[0], x[1], atol=1e-4)


def test_device_lm_embedder_averages_its_input_embeddings(tmp_path):
    import torch

    from dpfleet.edge.tokenizer import WordTokenizer
    from dpfleet.export.checkpoint import save_checkpoint
    from dpfleet.export.models import ModelConfig, build_model

    tok = WordTokenizer.build(["the cat sat on the mat", "to be or not"], 50)
    cfg = ModelConfig(arch="cifg", vocab_size=tok.vocab_size, embedding_dim=8, hidden_dim=16,
                      projection_dim=8)
    torch.manual_seed(0)
    model = build_model(cfg)
    save_checkpoint(tmp_path / "ckpt", model, cfg, tok)
    emb = DeviceLMEmbedder(tmp_path / "ckpt")
    x = emb.embed(["the cat", "mat"])
    table = model.embed.weight.detach().numpy()
    assert np.allclose(x[0], table[tok.encode("the cat")].mean(axis=0), atol=1e-6)
    assert x.shape == (2, 8)


def test_pca_projection_keeps_the_top_directions():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 5)) * np.array([5.0, 3.0, 1.0, 0.1, 0.1])
    p = Projection.fit(x, 2)
    assert np.allclose(np.abs(p.components[:2, :2]), np.eye(2), atol=0.05)
    assert p.apply(x).shape == (2000, 2)
    assert p.eigenvalues[0] > p.eigenvalues[1] > p.eigenvalues[2]
