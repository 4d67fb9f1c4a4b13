"""Checkpoints and bundles for the bundle and device-client tests.

The word-tokenizer checkpoints use the edge tests' tiny zoo shapes (`edge_models`), so their ONNX
training programs come from the session's shared program cache instead of a fresh export.
"""

from __future__ import annotations

import os
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
    """One export cache for the test run, shared by every module: under pytest-xdist the workers'
    base temps share a parent made for this run, so a program one worker exported is read by the
    others (the cache's file lock makes a second export of it wait, not repeat); run alone, the
    run's own base temp (its parent outlives the run: a stale export must never be reused)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "dpfleet-programs"


# Bounds a trained test model must meet (asserted by `train_rows`): far above what the tiny
# language needs (a trained model's logits reach ~10-40 here) and far below a diverged run's
# (SGD at lr 1.0 without clipping reached 1e7-1e8 on an AMD EPYC): parity tolerances are
# scaled to the values compared, so a diverged model would make them meaningless.
MAX_LOGIT = 100.0


def train_rows(model, data: torch.Tensor, steps: int, lr: float = 0.02, seed: int = 0,
               max_loss: float | None = None, min_drop: float = 0.5) -> float:
    """Train `model` on example rows (inputs then next-token targets) and return its loss over
    all of `data`, asserting it ends finite and well-conditioned.

    Why Adam at a small lr with the gradient norm clipped to 1: plain SGD at lr 1.0 is stable or
    divergent depending on a CPU's float rounding; this is stable with margin (2x the lr and other
    seeds reach the same loss). The batch order comes from its own seeded generator."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    start = full_loss(model, data)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (32,), generator=g)]
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:], PAD)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    end = full_loss(model, data)
    assert all(torch.isfinite(p).all() for p in model.parameters()), "training left a non-finite weight"
    with torch.no_grad():
        peak = model(data[:, :-1]).abs().max().item()
    assert peak < MAX_LOGIT, f"ill-conditioned model: max |logit| {peak:.3g} >= {MAX_LOGIT}"
    assert end < start - min_drop, f"training did not learn: loss {start:.3f} -> {end:.3f}"
    assert max_loss is None or end < max_loss, f"loss {end:.3f} not below {max_loss}"
    return end


def full_loss(model, data: torch.Tensor) -> float:
    with torch.no_grad():
        return next_token_loss(model(data[:, :-1]), data[:, 1:], PAD).item()


def line_rows(tokenizer, lines: list[str], seq_len: int) -> torch.Tensor:
    """One row per line: BOS, its tokens, EOS, cut or PAD-filled to seq_len + 1."""
    rows = np.zeros((len(lines), seq_len + 1), dtype=np.int64)
    for i, line in enumerate(lines):
        ids = [BOS, *tokenizer.encode(line), EOS][: seq_len + 1]
        rows[i, : len(ids)] = ids
    return torch.from_numpy(rows)


def train_briefly(model, tokenizer, lines: list[str], seq_len: int, steps: int = 300, **kwargs) -> float:
    """`train_rows` on the lines of the structured language (see `sentences`)."""
    return train_rows(model, line_rows(tokenizer, lines, seq_len), steps, **kwargs)


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


def gboard_checkpoint(folder: Path) -> tuple[Path, ModelConfig]:
    """Gboard's CIFG (`[model] preset = "gboard_cifg"`) over a 10,004-token word vocabulary, TFF's
    StackOverflow size: the structured language's words, then filler words up to 10,000, one OOV
    bucket and PAD / BOS / EOS. Untrained: parity and latency do not depend on the weights."""
    from dpfleet.export.models import with_preset

    known = [*SUBJECTS, *SUBJECTS.values(), *OBJECTS, "every", "day", "."]
    tok = WordTokenizer(known + [f"w{i}" for i in range(10_000 - len(known))], split="tff")
    cfg = ModelConfig(**with_preset({"preset": "gboard_cifg", "vocab_size": tok.vocab_size}))
    torch.manual_seed(0)
    save_checkpoint(folder, build_model(cfg), cfg, tok)
    return folder, cfg
