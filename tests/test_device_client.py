"""The reference device client trains exactly like the simulator's eager client, from the bundle
alone, without torch.

Parity tolerance is the edge runtimes' (tests/test_edge_runtime_parity.py): after one local epoch
max |delta - eager delta| <= 1e-6 + 1e-4 * max |eager delta|, for the clipped delta too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from bundle_helpers import make_bundle, program_cache, sentences, train_briefly, word_checkpoint
from edge_models import SEQ_LEN

from dpfleet.edge.client_data import to_rows
from dpfleet.edge.client_update import client_update
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.export.checkpoint import load_checkpoint, save_checkpoint

pytest.importorskip("onnxruntime")

ARCHS = ["cifg", pytest.param("lstm", marks=pytest.mark.slow), "transformer"]
FAST_ARCHS = ["cifg", pytest.param("lstm", marks=pytest.mark.slow),
              pytest.param("transformer", marks=pytest.mark.slow)]  # keep the default suite short


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    torch.set_num_threads(1)
    made = {}

    def get(arch: str, runtimes=("onnx",)):
        if (arch, runtimes) not in made:
            root = tmp_path_factory.mktemp(f"client-{arch}")
            folder, cfg = word_checkpoint(root / "ckpt", arch)
            summary = make_bundle(folder, root / "bundle", program_cache(tmp_path_factory),
                                  runtimes=runtimes)
            made[arch, runtimes] = root / "bundle", summary["public_key"], folder, cfg
        return made[arch, runtimes]

    return get


def user_texts(seed: int, n: int = 9) -> list[str]:
    return sentences(n, seed)


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_clipped_delta_matches_eager(arch, bundles):
    bundle, key, folder, cfg = bundles(arch)
    client = BundleClient(bundle, key)
    _, _, tok = load_checkpoint(folder)
    texts = user_texts(1)
    rows = client.examples(texts)
    np.testing.assert_array_equal(rows, to_rows((tok.encode(t) for t in texts), SEQ_LEN))
    assert len(rows) % client.batch_size  # a partial last minibatch is exercised
    theta0 = client.weights()
    for clip in (0.05, 100.0):  # clipped, and left alone
        kwargs = dict(lr=0.5, batch_size=client.batch_size, clip_norm=clip, seed=7)
        ref = client_update(EagerRuntime(cfg, 1), theta0, rows, **kwargs)
        delta = client.train_epoch(theta0, rows, lr=0.5, seed=7)
        eager_delta = EagerRuntime(cfg, 1)
        eager_delta.set_weights(theta0)
        eager_delta.train_epoch(rows, lr=0.5, batch_size=client.batch_size, seed=7)
        d_ref = eager_delta.get_weights() - theta0
        assert np.abs(d_ref).max() > 1e-3  # the epoch really moved the weights
        assert np.abs(delta - d_ref).max() <= 1e-6 + 1e-4 * np.abs(d_ref).max()
        clipped, norm = client.clip(delta, clip)
        assert abs(norm - ref.norm) <= 1e-5 * ref.norm
        assert (norm > clip) == ref.clipped
        assert np.abs(clipped - ref.delta).max() <= 1e-6 + 1e-4 * np.abs(ref.delta).max()


def test_wrong_seed_or_lr_gives_a_different_delta(bundles):
    """The parity above is not vacuous: the order and step size visibly change the delta."""
    bundle, key, _, _ = bundles("cifg")
    client = BundleClient(bundle, key)
    rows, theta0 = client.examples(user_texts(2)), client.weights()
    base = client.train_epoch(theta0, rows, seed=1)
    scale = np.abs(base).max()
    assert np.abs(client.train_epoch(theta0, rows, seed=2) - base).max() > 1e-2 * scale
    assert np.abs(client.train_epoch(theta0, rows, lr=0.25, seed=1) - base).max() > 1e-2 * scale


def test_example_cap_keeps_a_seeded_subset(bundles):
    bundle, key, _, _ = bundles("cifg")
    client = BundleClient(bundle, key)
    client.max_examples = 5
    texts = user_texts(3, n=12)
    a, b, c = client.examples(texts, seed=0), client.examples(texts, seed=0), client.examples(texts, seed=1)
    assert a.shape == (5, SEQ_LEN + 1) and (a == b).all() and not (a == c).all()
    full = {tuple(r) for r in BundleClient(bundle, key).examples(texts)}
    assert {tuple(r) for r in a} <= full


def test_client_rejects_bad_rows_and_weights(bundles):
    from dpfleet.errors import DpfleetError

    bundle, key, _, cfg = bundles("cifg")
    client = BundleClient(bundle, key)
    rows = client.examples(user_texts(4))
    with pytest.raises(DpfleetError, match="token ids"):
        client.train_epoch(client.weights(), rows + cfg.vocab_size)
    with pytest.raises(DpfleetError, match="weight vector"):
        client.train_epoch(client.weights()[:-1], rows)
    clipped, norm = client.clip(np.full(4, np.nan, dtype=np.float32), 1.0)
    assert norm == float("inf") and not clipped.any()


def test_a_lying_servers_weights_still_upload_within_the_signed_clip(bundles):
    """The attack: the server sends round weights scaled up 1000x (or with an inf) to make the
    device's delta, and so its upload, large. The upload's norm stays within the signed
    manifest's clip_norm, and an inf gives an all-zero upload."""
    bundle, key, _, _ = bundles("cifg")
    client = BundleClient(bundle, key)
    rows = client.examples(user_texts(4))
    honest = client.weights()
    raw = client.train_epoch(honest * 1000, rows, seed=0)
    uploaded, norm = client.clip(raw)
    assert norm > 10 * client.clip_norm  # the lie did inflate the local delta
    assert np.linalg.norm(uploaded) <= client.clip_norm * (1 + 1e-5)
    poisoned = honest.copy()
    poisoned[0] = np.inf
    uploaded, norm = client.clip(client.train_epoch(poisoned, rows, seed=0))
    assert norm == float("inf") and not uploaded.any()


@pytest.mark.slow
def test_suggest_completes_words_from_a_trained_model(tmp_path_factory, bundles):
    """After training, the bundle's window program predicts the language's verb for each subject."""
    _, _, folder, cfg = bundles("cifg")
    model_cfg, model, tok = load_checkpoint(folder)
    train_briefly(model, tok, sentences(400, 0), SEQ_LEN)
    root = tmp_path_factory.mktemp("trained")
    save_checkpoint(root / "ckpt", model, model_cfg, tok)
    summary = make_bundle(root / "ckpt", root / "bundle", program_cache(tmp_path_factory))
    client = BundleClient(root / "bundle", summary["public_key"])
    for subject, verb in [("alice", "eats"), ("bob", "buys"), ("carol", "likes"), ("dave", "cooks")]:
        logits = client.next_logits([tok.encode(subject)])[0].astype(np.float64)
        p = np.exp(logits - logits.max())
        assert p[tok.encode(verb)[0]] / p.sum() > 0.9  # a real margin, not a near-tie
        assert client.suggest(f"{subject} ", k=1) == [verb]
        assert client.suggest(f"{subject} {verb[:2]}", k=3)[0] == verb
    assert all(w.startswith("b") for w in client.suggest("alice eats b", k=3))


BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top == "torch" or name.startswith(("dpfleet.export", "dpfleet.coordinator")):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
"""


# the recurrent and the KV-cache step; the transformer's bundle export runs with the slow set
@pytest.mark.parametrize("arch", ["cifg", pytest.param("transformer", marks=pytest.mark.slow)])
def test_client_runs_without_torch(bundles, arch):
    bundle, key, _, _ = bundles(arch)
    script = BLOCKER + textwrap.dedent(f"""
        from dpfleet.edge.device_client import BundleClient
        c = BundleClient({str(bundle)!r}, {key!r})
        rows = c.examples(["alice eats apples every day .", "bob buys bread every day ."] * 3)
        delta, norm = c.clip(c.train_epoch(c.weights(), rows, seed=0))
        words = c.suggest("alice ")
        assert c.streaming and c._stream is not None  # suggest() went through the step program
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "dpfleet.")))
        print(norm > 0, len(words), loaded)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, n_words, loaded = proc.stdout.strip().split(" ", 2)
    assert ok == "True" and int(n_words) > 0
    assert "torch" not in loaded and "dpfleet.export" not in loaded and "dpfleet.coordinator" not in loaded
    assert "dpfleet.edge.runtime'" not in loaded  # the torch runtimes are not imported either


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["cifg", "transformer"])
def test_pte_training_matches_eager(arch, bundles):
    pytest.importorskip("executorch")
    bundle, key, _, cfg = bundles(arch, ("onnx", "executorch"))
    client = BundleClient(bundle, key)
    spec = client.bundle.manifest["training"]["pte"]
    assert spec["method"] == "forward" and spec["batch"] == client.batch_size
    assert "aten::embedding.out" in spec["portable_operators"]  # the selective-build list
    rows, theta0 = client.examples(user_texts(5)), client.weights()
    onnx = client.train_epoch(theta0, rows, seed=3)
    pte = client.train_epoch(theta0, rows, seed=3, runtime="executorch")
    eager = EagerRuntime(cfg, 1)
    eager.set_weights(theta0)
    eager.train_epoch(rows, lr=client.lr, batch_size=client.batch_size, seed=3)
    d_ref = eager.get_weights() - theta0
    for got in (onnx, pte):
        assert np.abs(got - d_ref).max() <= 1e-6 + 1e-4 * np.abs(d_ref).max()
