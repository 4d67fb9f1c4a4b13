"""Checkpoints and bundles for the bundle and device-client tests.

The word-tokenizer checkpoints use the edge tests' tiny zoo shapes (`edge_models`), so their ONNX
training programs come from the session's shared program cache instead of a fresh export.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from edge_models import SEQ_LEN, tiny_config

from dpfleet.edge.tokenizer import BOS, EOS, PAD, WordTokenizer, train_sentencepiece
from dpfleet.export.bundle import BundleExport
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import ModelConfig, build_model, next_token_loss

SUBJECTS = {"alice": "eats", "bob": "buys", "carol": "likes", "dave": "cooks"}
OBJECTS = ["apples", "bread", "cheese", "dates", "eggs"]


def sentences(n: int, seed: int) -> list[str]:
    """A tiny structured language: each subject has its own verb."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = list(SUBJECTS)[rng.integers(len(SUBJECTS))]
        out.append(f"{s} {SUBJECTS[s]} {OBJECTS[rng.integers(len(OBJECTS))]} every day .")
    return out


def program_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "dpfleet-programs"  # shared with the parity tests


def train_briefly(model, tokenizer, lines: list[str], seq_len: int, steps: int = 200) -> float:
    rows = np.zeros((len(lines), seq_len + 1), dtype=np.int64)
    for i, line in enumerate(lines):
        ids = [BOS, *tokenizer.encode(line), EOS][: seq_len + 1]
        rows[i, : len(ids)] = ids
    data = torch.from_numpy(rows)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (32,), generator=g)]
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:], PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def word_checkpoint(folder: Path, arch: str) -> tuple[Path, ModelConfig]:
    """An untrained tiny zoo model with a word vocabulary of the structured language."""
    cfg = tiny_config(arch)
    tok = WordTokenizer.build(sentences(200, 0), cfg.vocab_size)
    torch.manual_seed(0)
    save_checkpoint(folder, build_model(cfg), cfg, tok)
    return folder, cfg


def spm_checkpoint(folder: Path, seq_len: int = SEQ_LEN) -> Path:
    """A CIFG over a small SentencePiece vocabulary (briefly trained: its weights are not random)."""
    lines = sentences(400, 0)
    tok = train_sentencepiece(lines * 3, folder.parent / f"{folder.name}-spm", 285)
    cfg = ModelConfig(arch="cifg", vocab_size=tok.vocab_size, embedding_dim=16, hidden_dim=32,
                      projection_dim=16)
    torch.manual_seed(0)
    model = build_model(cfg)
    train_briefly(model, tok, lines, seq_len, steps=40)
    save_checkpoint(folder, model, cfg, tok)
    return folder


def make_bundle(checkpoint: Path, out: Path, cache: Path, **kwargs) -> dict:
    kwargs.setdefault("seq_len", SEQ_LEN)
    kwargs.setdefault("batch_size", 4)
    return BundleExport(checkpoint, out, cache_dir=cache, **kwargs).run()
