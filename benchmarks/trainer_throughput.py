"""Round trainers on issue 15's peer-shaped workload, in one run, as ratios to the sequential path.

Workload: Shakespeare next-word, word tokenizer (4K words), LSTM 96/256/96, batch 16, lr 0.5, one
local epoch, no DP noise, 50 clients per round; clients are dpfleet's (one per play and speaker,
speeches cut into 20-token rows) with at least 16 rows. Each round's cohort is drawn once (seeded)
and every trainer trains that same cohort from the same weights, trainers interleaved round by
round so they share the machine's load. Also: the zoo LSTM vs `nn.LSTM` per step at this shape,
and the clip-norm cost before / after the profile fix (numpy float64 + OpenBLAS vs torch).

    python benchmarks/trainer_throughput.py [--rounds 10] [--threads 2] [--trainers sequential,cohort,ray]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.backends import SequentialTrainer
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.simulation import prepare_data
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import build_model, next_token_loss
from dpfleet.export.params import get_flat

ROOT = Path(__file__).resolve().parents[1]
PEER = {
    "seed": 0,
    "data": {"dataset": "shakespeare", "seq_len": 20, "max_examples": 256, "test_fraction": 0.1},
    "tokenizer": {"kind": "word", "vocab_size": 4096},
    "model": {"arch": "lstm", "embedding_dim": 96, "hidden_dim": 256, "projection_dim": 96},
    "client": {"lr": 0.5, "batch_size": 16},
    "dp": {"noise_multiplier": 0.0, "clip_norm": 1e6, "report_goal": 50},
}


def zoo_vs_nn_lstm(model_cfg, rows: torch.Tensor, reps: int) -> dict:
    """ms per SGD step of the zoo LSTM and of nn.LSTM (same shape, projection), interleaved."""
    zoo = build_model(model_cfg)
    ref = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(model_cfg.vocab_size, model_cfg.embedding_dim),
        "lstm": torch.nn.LSTM(model_cfg.embedding_dim, model_cfg.hidden_dim,
                              proj_size=model_cfg.projection_dim, batch_first=True),
        "out": torch.nn.Linear(model_cfg.projection_dim, model_cfg.vocab_size),
    })

    def ref_forward(x):
        return ref["out"](ref["lstm"](ref["embed"](x))[0])

    timings = {"zoo": [], "nn_lstm": []}
    for name, model, fwd in (("zoo", zoo, zoo), ("nn_lstm", ref, ref_forward)) * 2:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for i in range(reps + 2):
            t0 = time.perf_counter()
            loss = next_token_loss(fwd(rows[:, :-1]), rows[:, 1:], PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= 2:
                timings[name].append(time.perf_counter() - t0)
    zoo_ms, ref_ms = (1000 * float(np.median(timings[k])) for k in ("zoo", "nn_lstm"))
    return {"zoo_ms_per_step": round(zoo_ms, 2), "nn_lstm_ms_per_step": round(ref_ms, 2),
            "zoo_over_nn_lstm": round(zoo_ms / ref_ms, 3)}


def clip_norm_cost(dim: int, reps: int = 20) -> dict:
    """The profile fix: the clip norm of one delta, numpy float64 (before) vs torch (after)."""
    vec = np.random.default_rng(0).standard_normal(dim).astype(np.float32)
    out = {}
    for name, fn in (("numpy_float64_ms", lambda: np.linalg.norm(vec.astype(np.float64))),
                     ("torch_ms", lambda: torch.linalg.vector_norm(torch.from_numpy(vec),
                                                                   dtype=torch.float64))):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = round(1000 * (time.perf_counter() - t0) / reps, 3)
    return out


def _ray_trainer(model_cfg, seq_len: int, batch_size: int, workers: int):
    """Ray(local): a private Ray instance with one single-threaded cohort worker per core."""
    from dpfleet.coordinator.ray_backend import RayTrainer

    return RayTrainer(model_cfg, seq_len=seq_len, batch_size=batch_size, workers=workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trainers", default="sequential,cohort")
    ap.add_argument("--ray-workers", type=int, default=2, help="Ray(local) actors, one thread each")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()

    cfg = parse_config(PEER)
    tokenizer, data = prepare_data(cfg)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    eligible = [c for c in data.train if len(c.examples) >= 16]
    theta = get_flat(build_model(model_cfg))
    bs, lr = cfg.client.batch_size, cfg.client.lr
    trainers = {
        "sequential": lambda: SequentialTrainer(EagerRuntime(model_cfg)),
        "cohort": lambda: CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=bs, device="cpu"),
        "ray": lambda: _ray_trainer(model_cfg, cfg.data.seq_len, bs, args.ray_workers),
    }
    names = args.trainers.split(",")
    built = {n: trainers[n]() for n in names}
    rng = np.random.default_rng(cfg.seed)
    wall = dict.fromkeys(names, 0.0)
    updates = steps = 0
    max_diff = 0.0
    for _ in range(args.rounds):
        cohort = rng.choice(len(eligible), cfg.dp.report_goal, replace=False)
        examples = [eligible[i].examples for i in cohort]
        seeds = [int(i) for i in cohort]
        results = {}
        for n in names:
            t0 = time.perf_counter()
            results[n] = built[n].train_round(theta, examples, seeds, lr=lr, batch_size=bs,
                                              clip_norm=cfg.dp.clip_norm)
            wall[n] += time.perf_counter() - t0
        if "sequential" in results:
            for n in names:
                max_diff = max(max_diff, max(float(np.abs(a.delta - b.delta).max())
                                             for a, b in zip(results["sequential"], results[n], strict=True)))
        updates += len(examples)
        steps += sum(-(-len(x) // bs) for x in examples)

    base = wall[names[0]]
    paths = {n: {"seconds": round(w, 2), "client_updates_per_s": round(updates / w, 3),
                 "gradient_steps_per_s": round(steps / w, 2), "speedup_vs_" + names[0]: round(base / w, 3)}
             for n, w in wall.items()}
    rows = torch.from_numpy(eligible[0].examples[:bs].astype(np.int64))
    out = {
        "workload": "issue 15 peer: LSTM 96/256/96, 4K words, 50 clients/round, batch 16, lr 0.5, no noise",
        "clients_eligible": len(eligible), "rounds": args.rounds, "client_updates": updates,
        "gradient_steps": steps, "paths": paths,
        "max_abs_delta_diff_vs_sequential": max_diff,
        "cohort_chunk": built["cohort"].chunk if "cohort" in built else None,
        "zoo_vs_nn_lstm": zoo_vs_nn_lstm(model_cfg, rows, reps=10),
        "clip_norm_cost_1M_params": clip_norm_cost(int(theta.size)),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "ray_workers": args.ray_workers if "ray" in built else None,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
