"""The phone's strip is the one measured: `BundleClient.suggest` (ONNX Runtime, numpy) runs the
same word search (`edge.word_search`) as `Predictor.suggest` (torch), so a trained model exported
to a bundle offers the same words, mid-word and after a space, through the step program and
through the window program; and the keyboard figures through the bundle equal the Predictor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle_helpers import (
    make_bundle,
    program_cache,
    sentences,
    spm_checkpoint,
    train_briefly,
    word_checkpoint,
)
from edge_models import SEQ_LEN

import dpfleet
from dpfleet.coordinator.engine.keyboard_eval import bundle_keyboard_block, keyboard_block
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.suggest import Predictor
from dpfleet.edge.tokenizer import CharTokenizer, WordTokenizer
from dpfleet.export.checkpoint import load_checkpoint, save_checkpoint
from dpfleet.export.phone import vocabulary_entry

pytest.importorskip("onnxruntime")

MODELS = ["cifg", "transformer", pytest.param("spm", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def phones(tmp_path_factory):
    """Per model: a briefly trained tiny model's bundle client and its Predictor. "cifg" and
    "transformer": word vocabularies in the device tests' shapes (their programs come from the
    session's cache); "spm": a SentencePiece CIFG whose words take several pieces each, with a
    window of 12 (a fresh export, so slow)."""
    torch.set_num_threads(1)
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(f"phone-{name}")
            seq = 12 if name == "spm" else SEQ_LEN
            init = spm_checkpoint(root / "init", seq) if name == "spm" else \
                word_checkpoint(root / "init", name)[0]
            cfg, model, tok = load_checkpoint(init)
            train_briefly(model, tok, sentences(400, 0), seq, steps=300)
            save_checkpoint(root / "ckpt", model, cfg, tok)
            cache = program_cache(tmp_path_factory)
            summary = make_bundle(root / "ckpt", root / "bundle", cache, seq_len=seq)
            made[name] = BundleClient(root / "bundle", summary["public_key"]), Predictor(model, tok, seq)
        return made[name]

    return get


def held_out_prefixes(n: int) -> list[str]:
    """Held-out sentences (a seed training never used) cut after a space or inside a word."""
    rng = np.random.default_rng(7)
    out = []
    for i, text in enumerate(sentences(n, 99)):
        spaces = [j + 1 for j, c in enumerate(text) if c == " "]
        cut = int(rng.choice(spaces)) if i % 2 else int(rng.integers(1, len(text)))
        out.append(text[:cut])
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.slow
def test_bundle_strips_equal_the_predictors(phones, name, streaming):
    client, predictor = phones(name)
    prefixes = held_out_prefixes(24)
    assert sum(p.endswith(" ") for p in prefixes) >= 10 and sum(not p.endswith(" ") for p in prefixes) >= 10
    client.use_streaming = streaming
    try:
        got = [client.suggest(p) for p in prefixes]
    finally:
        client.use_streaming = True
    want = [predictor.suggest(p) for p in prefixes]
    assert got == want
    # not a comparison of empty strips (the SentencePiece model, of 25 pieces beside its bytes and
    # a window of 12, spells poorly: it offers fewer words)
    assert sum(len(s) == 3 for s in want) >= (4 if name == "spm" else 10), want


@pytest.mark.slow
def test_keyboard_figures_through_the_bundle_equal_the_predictors(phones):
    client, predictor = phones("cifg")
    rows = client.examples(sentences(30, 123))
    fit = client.examples(sentences(30, 321))
    kwargs = dict(words=20, seed=0, fit_rows=fit)
    phone_block = bundle_keyboard_block(client, rows, **kwargs)
    model_block = keyboard_block(predictor.model, predictor.tokenizer, rows, seq_len=client.seq_len, **kwargs)
    for block in (phone_block, model_block):
        block.pop("seconds")
    assert phone_block == model_block
    assert phone_block["words"] == 20 and phone_block["model"]["keystroke_savings"] > 0


def test_manifest_vocabulary_lists_every_oov_bucket():
    """The phone export's manifest took unk_id 3 as the only unknown id: with two OOV buckets
    ids 3 and 4 are unknown words (the words start at 5)."""
    tok = WordTokenizer(["the", "to", "of"], oov_buckets=2)
    entry = vocabulary_entry(tok)
    assert entry == {"kind": "word", "size": 8, "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3,
                     "oov_ids": [3, 4]}
    assert tok.encode("the") == [5] and vocabulary_entry(CharTokenizer())["oov_ids"] == [3]


PLAY = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"]


@pytest.mark.slow  # a run and a fresh export of a character model's programs (~1-2 minutes)
def test_a_char_run_exports_a_bundle_that_suggests_like_the_run(tmp_path):
    """`kind = "char"` end to end: a tiny run over TFF Shakespeare's characters, its signed bundle,
    and the bundle's strip, spelled a character at a time, equals the run's `Result.suggest`."""
    users = {f"u{i}": [PLAY[(i + j) % 4] for j in range(3)] for i in range(24)}
    config = {"rounds": 2, "eval_every": 1, "checkpoint_every": 0, "seed": 3,
              "data": {"seq_len": 16, "max_examples": 4, "test_fraction": 0.2, "keyboard_words": 0},
              "tokenizer": {"kind": "char"},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 16, "projection_dim": 8},
              "client": {"lr": 0.1, "batch_size": 4},
              "dp": {"noise_multiplier": 0.5, "clip_norm": 1.0, "report_goal": 6, "noise_seed": 7}}
    result = dpfleet.simulate(config, users=users, progress=False, run_dir=tmp_path / "run")
    assert result.tokenizer.kind == "char" and result.tokenizer.vocab_size == 90
    summary = result.export_bundle(tmp_path / "bundle", accept_caveats=True)
    client = BundleClient(tmp_path / "bundle", summary["public_key"])
    assert client.tokenizer.kind == "char" and client.streaming
    assert np.isfinite(client.next_logits([client.tokenizer.encode("To be")])).all()
    prefixes = ["To be, or no", "that is the ", "Whether 'tis nob", "of "]
    strips = [client.suggest(p) for p in prefixes]
    assert strips == [result.suggest(p) for p in prefixes]
    assert all(len(s) == 3 for s in strips), strips  # no lexicon: any spelling is a word
