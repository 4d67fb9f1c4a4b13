"""Streaming keyboard inference: step(token, state) gives the window program's last logits.

Equal (to float rounding) while the message has at most seq_len - 1 tokens, which the window
program can see whole; past that the recurrent step's state remembers more, and the two differ,
and the transformer's KV cache (seq_len slots) is full: its step is refused and suggestions come
from the window program.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle_helpers import make_bundle, program_cache, sentences, train_briefly, word_checkpoint
from edge_models import SEQ_LEN
from numerics import assert_scaled_close, scaled_bound

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
            train_briefly(model, tok, sentences(400, 0), SEQ_LEN)
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


@pytest.mark.parametrize("arch", ["cifg", pytest.param("lstm", marks=pytest.mark.slow), "transformer"])
def test_step_logits_equal_window_logits(arch, trained):
    client, model = trained(arch)
    rng = np.random.default_rng(0)
    for n in range(SEQ_LEN):  # 0 .. seq_len - 1 message tokens
        ids = rng.integers(4, client.vocab_size, n).tolist()
        window = client.next_logits([ids])[0]
        got = stream(client, ids)
        assert_scaled_close(got, window)
        with torch.no_grad():
            eager = model(torch.tensor([[BOS, *ids]]))[0, -1].numpy()
        assert_scaled_close(got, eager)
    measured = client.bundle.manifest["measured"]["kv_step" if arch == "transformer" else "step"]
    assert measured["vs_window_max_abs_err"] <= scaled_bound(measured["vs_window_ref_max_abs"])
    assert measured["vs_window_top1"] == 1.0


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
        assert_scaled_close(logits[row], stream(client, [t]))


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
            assert_scaled_close(got, eager)
        assert np.abs(eager - before).max() > 0.1
    finally:
        client.set_inference_weights(client.weights())
    assert_scaled_close(client.next_logits([ids])[0], before, rtol=1e-6)


def count_step_runs(client, runs: list):
    """Wrap the client's step session so each run appends its batch size to `runs`."""
    session = client._session("step", client._step_spec()["file"])

    class Counting:
        def run(self, names, feed):
            runs.append(len(feed["token"]))
            return session.run(names, feed)

    client._sessions["step"] = Counting()
    return session


def test_transformer_bundle_ships_the_kv_step(trained):
    client, model = trained("transformer")
    m = client.bundle.manifest
    spec = m["inference"]["kv_step"]
    assert "step" not in m["inference"] and spec["file"] == "kv_step.onnx" and spec["slots"] == SEQ_LEN
    cfg = model.cfg
    assert spec["cache"]["keys"] == [cfg.num_layers, "batch", cfg.num_heads, SEQ_LEN,
                                     cfg.embedding_dim // cfg.num_heads]
    io = {v["name"]: (v["shape"], v["dtype"]) for v in spec["inputs"]}
    assert io["position"] == ([], "int64") and io["token"][1] == "int64"
    assert io["keys"][0][3] == SEQ_LEN and io["keys"][1] == "float32"
    assert [o["name"] for o in spec["outputs"]] == ["logits", "next_keys", "next_values"]
    assert "window program" in m["rules"]["kv_step"] and "kv_step.onnx" in m["files"]
    config = client.bundle.read("ort_required_operators.config").decode()
    listed = {op for line in config.splitlines() if not line.startswith("#")
              for op in line.split(";")[2].split(",")}
    assert {op.split("::")[1] for op in spec["ops"]} <= listed


def test_full_kv_cache_is_refused_and_would_be_wrong(trained):
    """Past seq_len tokens the step is refused: fed anyway (position = slots) the token lands in
    no slot and the logits are far from the window program's."""
    client, _ = trained("transformer")
    ids = np.random.default_rng(2).integers(4, client.vocab_size, SEQ_LEN).tolist()
    state = client.initial_state()
    for t in [BOS, *ids[:-1]]:
        _, state = client.step([t], state)
    assert state[2] == SEQ_LEN
    with pytest.raises(BundleError, match="window program"):
        client.step([ids[-1]], state)
    keys, values, _ = state
    session = client._session("step", client._step_spec()["file"])
    forced = session.run(None, {"token": np.array([ids[-1]]), "position": np.array(SEQ_LEN), "keys": keys,
                                "values": values, **client._weights_feed()})[0][0]
    assert np.abs(forced - client.next_logits([ids])[0]).max() > 0.5


def test_kv_candidates_extend_like_the_window(trained):
    """Completion candidates share one cache batch: each row equals its own window run."""
    client, _ = trained("transformer")
    root_logits, root = client._context([5])
    assert_scaled_close(root_logits, client.next_logits([[5]])[0])
    handles, prompts = [root] * 3, [[5]] * 3
    for tokens in ([6, 7, 8], [9, 10, 11]):
        got, handles = client._extend(handles, tokens)
        want, prompts = client._extend(prompts, tokens)
        assert_scaled_close(got, want)
        assert np.abs(got[0] - got[1]).max() > 1e-3  # the rows really differ
    assert [h[2] for h in handles] == [4] * 3


def test_transformer_streaming_suggestions_equal_window_suggestions(trained):
    client, _ = trained("transformer")
    short = ["alice ", "bob ", "carol likes ", "dave cooks eggs "]  # BOS + context fit the cache
    long = ["alice eats apples every day . bob ", "carol likes bread every day . dave "]
    runs: list = []
    session = count_step_runs(client, runs)
    try:
        streamed = [client.suggest(p) for p in short]
        assert len(runs) >= 4  # the KV step served the short contexts
        runs.clear()
        streamed_long = [client.suggest(p) for p in long]
        assert runs == []  # too long for the cache: the window program answered
    finally:
        client._sessions["step"] = session
    client.use_streaming = False
    windowed = [client.suggest(p) for p in short + long]
    client.use_streaming = True
    assert streamed + streamed_long == windowed
    assert streamed[0][0] == "eats" and streamed[2][0] in {"apples", "bread", "cheese", "dates", "eggs"}
