"""`[pretrain]`: the model starts from central training on public text, not from a random init.

Why: under DP the private rounds buy little signal per unit of noise, so what the model can learn
without the private data should not be paid for with it. Training on public corpora (WikiText-2,
the King James Bible: packaged, and refused when they overlap the private dataset) before the
first private round is post-processing of public data: it costs no privacy, and the run's
privacy report names the corpora. The same tokenizer (trained on WikiText-2) cuts the public
text into rows of `data.seq_len` tokens; the loop is public/kd_pretrain.py's with beta = 0
(plain next-token loss, Adam, gradient clipping at 1), at `client.precision` (bfloat16 autocast
under "auto" where the CPU has native BF16 and the model is large enough, `edge.precision`; the
resolved precision is part of the cache key and summary.json states it with why).

Pretraining starts from the model's init at `pretrain.seed` (not the run's seed), so its result
is a function of the token rows, the model config and the training settings alone: it is cached
under `$DPFLEET_CACHE/pretrain/` by their digest, and every seed of the private run (which then
sets sampling and noise) starts from the same public model without paying for it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.edge.datasets import load_records
from dpfleet.edge.overlap import check_public_sources
from dpfleet.edge.precision import resolve_precision
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat, set_flat
from dpfleet.io import atomic_write
from dpfleet.jsonio import SPACED, canonical_sha256
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_train


def public_sequences(sources: list[str], tokenizer, seq_len: int) -> list[list[int]]:
    """Every train-split record of each source, tokenized and cut into pieces of <= seq_len tokens
    (pieces under 4 tokens dropped: mostly headings and blank tails)."""
    out = []
    for source in sources:
        for record in load_records(source, "train"):
            ids = tokenizer.encode(record.text)
            pieces = (ids[i:i + seq_len] for i in range(0, len(ids), seq_len))
            out.extend(piece for piece in pieces if len(piece) >= 4)
    if not out:
        raise DpfleetError(f"pretrain.corpus {sources} gave no text")
    return out


def _key(sequences: list[list[int]], model_cfg: ModelConfig, train: KDTrainConfig, sources: list[str]) -> str:
    # SPACED: the separators of the entries cached before (they still hit)
    digest = canonical_sha256([sources, asdict(model_cfg), asdict(train)], separators=SPACED)
    for s in sequences:
        digest.update(np.asarray(s, dtype=np.int32).tobytes() + b"\xff\xff\xff\xff")
    return digest.hexdigest()[:24]


def pretrain_on_public(cfg: SimulationConfig, model_cfg: ModelConfig, model: torch.nn.Module, tokenizer,
                       log: Callable[[str], None] = print, *, progress: bool = True) -> dict:
    """Set `model` to the public model (`cfg.pretrain.corpus` trained from the init at pretrain.seed);
    returns what the privacy report and summary record (corpora, rows, steps, seconds, cached).
    Training (the first run of a config: minutes) says so in `log` when it starts and shows a
    progress bar with its ETA on stderr unless `progress` is off; a cached model loads at once."""
    p = cfg.pretrain
    check_public_sources(p.corpus, cfg.data.dataset, "pretrain.corpus")
    t0 = time.perf_counter()
    sequences = public_sequences(list(p.corpus), tokenizer, cfg.data.seq_len)
    precision = resolve_precision(cfg.client.precision, key="client.precision",  # keys the cache
                                  params=sum(p.numel() for p in model.parameters()))
    train = KDTrainConfig(steps=p.steps, batch_size=p.batch_size, lr=p.lr, beta=0.0, seed=p.seed,
                          precision=precision.name)
    path = cache_dir() / "pretrain" / f"{_key(sequences, model_cfg, train, list(p.corpus))}.npy"
    cached = path.is_file()
    if cached:
        theta = np.load(path)
    else:
        log(f"public pretraining: {', '.join(p.corpus)} ({len(sequences):,} rows), {p.steps} steps: "
            f"not cached yet, training once (cached in {path.parent} for later runs)")
        rng = torch.get_rng_state()  # the private run's torch stream stays as without pretraining
        torch.manual_seed(p.seed)  # the public init: a function of the cache key alone
        theta, _ = kd_train(model_cfg, get_flat(build_model(model_cfg)), PlainCorpus(sequences), None,
                            train, progress=progress, desc="public pretraining")
        torch.set_rng_state(rng)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.save(f, theta))
    set_flat(model, theta)
    seconds = time.perf_counter() - t0
    log(f"public pretraining: {', '.join(p.corpus)} ({len(sequences):,} rows), {p.steps} steps"
        f"{' (cached)' if cached else ''}, {seconds:.1f} s")
    return {"corpus": list(p.corpus), "rows": len(sequences), "steps": p.steps, "batch_size": p.batch_size,
            "lr": p.lr, "seed": p.seed, "cached": cached, "seconds": seconds,
            "precision": {"used": precision.name, "reason": precision.reason}}
