"""Streaming keyboard inference: step(token, state) gives the window program's last logits.

Equal (to float rounding) while the message has at most seq_len - 1 tokens, which the window
program can see whole; past that the step's state remembers more, and the two differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle_helpers import make_bundle, program_cache, sentences, train_briefly, word_checkpoint
from edge_models import SEQ_LEN

from dpfleet.edge.bundle_format import BundleError
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.tokenizer import BOS
from dpfleet.export.checkpoint import load_checkpoint, save_checkpoint

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per architecture: a briefly trained tiny model's bundle and its client."""
    torch.set_num_threads(1)
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"stream-{arch}")
            folder, _ = word_checkpoint(root / "init", arch)
            cfg, model, tok = load_checkpoint(folder)
            train_briefly(model, tok, sentences(400, 0), SEQ_LEN, steps=800)
            save_checkpoint(root / "ckpt", model, cfg, tok)
            summary = make_bundle(root / "ckpt", root / "bundle", program_cache(tmp_path_factory))
            made[arch] = BundleClient(root / "bundle", summary["public_key"]), model
        return made[arch]

    return get


def stream(client, ids):
    state = client.initial_state()
    for t in [BOS, *ids]:
        logits, state = client.step([t], state)
    return logits[0]


@pytest.mark.parametrize("arch", ["cifg", pytest.param("lstm", marks=pytest.mark.slow)])
def test_step_logits_equal_window_logits(arch, trained):
    client, model = trained(arch)
    rng = np.random.default_rng(0)
    for n in range(SEQ_LEN):  # 0 .. seq_len - 1 message tokens
        ids = rng.integers(4, client.vocab_size, n).tolist()
        window = client.next_logits([ids])[0]
        got = stream(client, ids)
        np.testing.assert_allclose(got, window, atol=1e-5, rtol=0)
        with torch.no_grad():
            eager = model(torch.tensor([[BOS, *ids]]))[0, -1].numpy()
        np.testing.assert_allclose(got, eager, atol=1e-5, rtol=0)
    measured = client.bundle.manifest["measured"]["step"]
    assert measured["vs_window_max_abs_err"] < 1e-5 and measured["vs_window_top1"] == 1.0


def test_longer_messages_differ_from_the_window(trained):
    """Past seq_len - 1 tokens the window forgets the start and the step does not (so the
    equality above is not vacuous)."""
    client, _ = trained("cifg")
    ids = np.random.default_rng(1).integers(4, client.vocab_size, 3 * SEQ_LEN).tolist()
    assert np.abs(stream(client, ids) - client.next_logits([ids])[0]).max() > 1e-3


def test_batched_steps_keep_rows_apart(trained):
    client, _ = trained("cifg")
    state = client.initial_state(batch=3)
    logits, state = client.step([BOS] * 3, state)
    logits, state = client.step([5, 6, 7], state)
    for row, t in enumerate([5, 6, 7]):
        np.testing.assert_allclose(logits[row], stream(client, [t]), atol=1e-5)


def test_streaming_suggestions_equal_window_suggestions(trained):
    client, _ = trained("cifg")
    prefixes = ["alice ", "bob b", "carol likes ", "dave cooks eggs ev", "alice eats apples every "]
    streamed = [client.suggest(p) for p in prefixes]
    client.use_streaming = False
    windowed = [client.suggest(p) for p in prefixes]
    client.use_streaming = True
    assert streamed == windowed
    assert streamed[0][0] == "eats" and streamed[2][0] in {"apples", "bread", "cheese", "dates", "eggs"}


def test_context_state_is_reused_between_keystrokes(trained):
    client, _ = trained("cifg")
    runs = []
    session = client._session("step", client.inference["step"]["file"])

    class Counting:
        def run(self, names, feed):
            runs.append(len(feed["token"]))
            return session.run(names, feed)

    client._sessions["step"] = Counting()
    try:
        client.suggest("alice ")
        first = len(runs)
        runs.clear()
        client.suggest("alice eats ")  # one more context token: one more batch-1 step
        context_steps = [r for r in runs if r == 1]
        assert first >= 2 and len(context_steps) == 1
    finally:
        client._sessions["step"] = session


def test_suggestions_follow_new_weights(trained):
    """The window and step programs read the weights as inputs: a new model needs no new program."""
    client, model = trained("cifg")
    untrained = np.random.default_rng(3).normal(0, 0.1, client.weights().shape).astype(np.float32)
    ids = [5, 6]
    before = client.next_logits([ids])[0]
    client.set_inference_weights(untrained)
    try:
        from dpfleet.export.models import build_model
        from dpfleet.export.params import set_flat

        other = build_model(model.cfg)
        set_flat(other, untrained)
        with torch.no_grad():
            eager = other(torch.tensor([[BOS, *ids]]))[0, -1].numpy()
        for got in (client.next_logits([ids])[0], stream(client, ids)):
            np.testing.assert_allclose(got, eager, atol=1e-5, rtol=0)
        assert np.abs(eager - before).max() > 0.1
    finally:
        client.set_inference_weights(client.weights())
    np.testing.assert_allclose(client.next_logits([ids])[0], before, atol=1e-6)


def test_transformer_bundles_have_no_step(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-transformer")
    folder, _ = word_checkpoint(root / "ckpt", "transformer")
    summary = make_bundle(folder, root / "bundle", program_cache(tmp_path_factory))
    client = BundleClient(root / "bundle", summary["public_key"])
    assert "step" not in client.bundle.manifest["inference"] and not client.streaming
    with pytest.raises(BundleError, match="no streaming step"):
        client.initial_state()
    assert len(client.suggest("alice ")) == 3  # the window program still serves suggestions
