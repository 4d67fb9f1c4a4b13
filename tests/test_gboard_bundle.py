"""Gboard's CIFG (1.42M parameters, 10,004 tokens) as a signed phone bundle: its ONNX Runtime and
ExecuTorch training programs give the eager delta, and its streaming step program the window
program's next-word logits.

Tolerances are the edge runtimes' (tests/test_device_client.py): max |delta - eager delta| <=
1e-6 + 1e-4 * max |eager delta|; logits within 1e-5 + 1e-4 * max |eager logits|. Exporting a
model this size takes about a minute (two with ExecuTorch), so the module is `slow`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle_helpers import gboard_checkpoint, make_bundle, program_cache, sentences

from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.edge.tokenizer import BOS

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow

SEQ_LEN = 20  # the StackOverflow task's sequence length
RUNTIMES = ("onnx", "executorch")


@pytest.fixture(scope="module")
def gboard_bundle(tmp_path_factory):
    pytest.importorskip("executorch")
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gboard")
    folder, cfg = gboard_checkpoint(root / "ckpt")
    summary = make_bundle(folder, root / "bundle", program_cache(tmp_path_factory), runtimes=RUNTIMES,
                          seq_len=SEQ_LEN, batch_size=16)
    return BundleClient(root / "bundle", summary["public_key"]), cfg, summary


def close(got: np.ndarray, ref: np.ndarray, floor: float = 1e-6) -> bool:
    return float(np.abs(got - ref).max()) <= floor + 1e-4 * float(np.abs(ref).max())


def test_manifest_ships_the_gboard_model(gboard_bundle):
    client, cfg, summary = gboard_bundle
    model = client.bundle.manifest["model"]["config"]
    assert client.bundle.manifest["model"]["parameter_count"] == 1_422_638
    assert (model["embedding_dim"], model["hidden_dim"], model["projection_dim"]) == (96, 670, 96)
    assert model["vocab_size"] == 10_004 and model["tie_embeddings"] and model["preset"] == "gboard_cifg"
    assert client.weights().size == 1_422_638
    assert {"train.onnx", "infer.onnx", "step.onnx", "weights.bin"} <= set(summary["files"])
    assert any(name.endswith(".pte") for name in summary["files"])
    assert client.streaming


def test_onnx_and_executorch_training_match_eager(gboard_bundle):
    client, cfg, _ = gboard_bundle
    rows, theta0 = client.examples(sentences(40, 5)), client.weights()
    assert len(rows) % client.batch_size  # a partial last minibatch is exercised
    eager = EagerRuntime(cfg, 1)
    eager.set_weights(theta0)
    eager.train_epoch(rows, lr=client.lr, batch_size=client.batch_size, seed=3)
    d_ref = eager.get_weights() - theta0
    assert np.abs(d_ref).max() > 1e-4  # the epoch really moved the weights
    for runtime in RUNTIMES:
        got = client.train_epoch(theta0, rows, seed=3, runtime=runtime)
        assert close(got, d_ref), runtime


def test_streaming_step_gives_the_window_and_eager_logits(gboard_bundle):
    """Token by token through step.onnx, the logits after each prefix equal the window program's
    and the eager model's; suggest() streams and returns three vocabulary words."""
    client, cfg, _ = gboard_bundle
    ids = client.tokenizer.encode("alice eats bread every day .")
    eager = EagerRuntime(cfg, 1)
    eager.set_weights(client.weights())
    with torch.no_grad():
        ref = eager.model(torch.tensor([[BOS, *ids]]))[0].numpy()
    state = client.initial_state()
    for t, token in enumerate([BOS, *ids]):
        logits, state = client.step([token], state)
        window = client.next_logits([ids[:t]])[0]
        assert close(logits[0], ref[t], 1e-5) and close(window, ref[t], 1e-5), t
    words = client.suggest("alice ", k=3)
    assert len(words) == 3 and all(w in client.tokenizer.words for w in words)
    assert client._stream is not None  # suggest() went through the step program
