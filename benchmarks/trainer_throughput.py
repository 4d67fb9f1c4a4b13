"""Round trainers on issue 15's peer-shaped workload, in one run, as ratios to the sequential path.

Workload: Shakespeare next-word, word tokenizer (4K words, the top words, not the DP vocabulary:
the workload has no DP anyway), LSTM 96/256/96, batch 16, lr 0.5, one local epoch, no DP noise,
50 clients per round; clients are dpfleet's (one per play and speaker, speeches cut into 20-token
rows) with at least 16 rows. Each round's cohort is drawn once (seeded) and every trainer trains
that same cohort from the same weights; the trainers alternate within each round (their order
reversed every other round) at each torch thread count, so they share the machine's load.

Trainers: `sequential` (the reference eager path), `cohort` (the default: hand-written recurrent
step, chunks from the memory budget), `cohort_chunk1` (the same step one client at a time: the
flops removed without batching across clients), `cohort_vmap` (torch.func over the client axis:
batching without the flops removed), `nn_lstm` (a plain PyTorch loop over `nn.LSTM`, the issue's
peer baseline), `ray`. Also: where a sequential step's time and flops go (profile + padding), the
zoo LSTM vs `nn.LSTM` per step, and the clip-norm cost (numpy float64 + OpenBLAS vs torch).

    python benchmarks/trainer_throughput.py [--rounds 1] [--threads 1,2] [--trainers ...]

About 2-3 min on a quiet 2-core machine. On an oversubscribed one (load >> cores) torch's
2-thread runs stall on their thread barriers (a round took > 29 min at load 10-14): use --threads 1.
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
from tqdm import tqdm

from dpfleet.coordinator.config import SimulationConfig, parse_config
from dpfleet.coordinator.engine.backends import SequentialTrainer
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.edge.client_update import finish_update
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.edge.minibatch import batches
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig, build_model, next_token_loss
from dpfleet.export.params import get_flat

ROOT = Path(__file__).resolve().parents[1]
PEER = {
    "seed": 0,
    "data": {"dataset": "shakespeare", "seq_len": 20, "max_examples": 256, "test_fraction": 0.1},
    "tokenizer": {"kind": "word", "vocab_size": 4096, "allow_nonprivate_vocabulary": True},
    "model": {"arch": "lstm", "embedding_dim": 96, "hidden_dim": 256, "projection_dim": 96},
    "client": {"lr": 0.5, "batch_size": 16},
    "dp": {"noise_multiplier": 0.0, "clip_norm": 1e6, "report_goal": 50, "momentum": 0.9},
}


def build_workload(config: dict | SimulationConfig) -> tuple[SimulationConfig, ModelConfig, object]:
    """A config (dict or parsed) -> (config, model config with the tokenizer's vocabulary, the
    federated data): dpfleet's own split and rows, shared by this file and peers.py."""
    cfg = parse_config(config) if isinstance(config, dict) else config
    tokenizer, data = prepare_data(cfg)
    return cfg, dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size), data


def nn_lstm_model(model_cfg) -> tuple[torch.nn.Module, object]:
    """The peer's plain model: nn.Embedding -> nn.LSTM (with projection) -> nn.Linear."""
    ref = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(model_cfg.vocab_size, model_cfg.embedding_dim),
        "lstm": torch.nn.LSTM(model_cfg.embedding_dim, model_cfg.hidden_dim,
                              proj_size=model_cfg.projection_dim, batch_first=True),
        "out": torch.nn.Linear(model_cfg.projection_dim, model_cfg.vocab_size),
    })

    def ref_forward(x):
        return ref["out"](ref["lstm"](ref["embed"](x))[0])

    return ref, ref_forward


class NnLstmTrainer:
    """The issue's plain PyTorch loop: nn.LSTM, one client after another, same minibatches, same
    delta + clip; its deltas are of a different model, so they are not compared."""

    name = "nn_lstm"

    def __init__(self, model_cfg):
        self.model, self.forward = nn_lstm_model(model_cfg)
        self.start = {k: v.clone() for k, v in self.model.state_dict().items()}

    def train_round(self, theta, examples, seeds, *, lr, batch_size, clip_norm):
        out = []
        for x, seed in zip(examples, seeds, strict=True):
            self.model.load_state_dict(self.start)
            opt = torch.optim.SGD(self.model.parameters(), lr=lr)
            data = torch.from_numpy(x.astype(np.int64))
            losses = []
            for idx in batches(len(data), batch_size, seed):
                rows = data[idx]
                loss = next_token_loss(self.forward(rows[:, :-1]), rows[:, 1:], PAD)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
            start = torch.cat([v.reshape(-1) for v in self.start.values()])  # all parameters
            out.append(finish_update((flat - start).numpy(), clip_norm, float(np.mean(losses)),
                                     len(x)))
        return out


def step_anatomy(model_cfg, clients: list[np.ndarray], batch_size: int, reps: int = 8) -> dict:
    """Where a sequential step goes: padding of the minibatches, flops per part (analytic), and a
    torch.profiler split of one step's self time by op family."""
    real, width, rows_total = 0, 0, 0
    for x in clients:
        for idx in batches(len(x), batch_size, 0):
            r = x[idx][:, 1:] != PAD
            real += int(r.sum())
            width += (int(r.any(0).nonzero()[0].max()) + 1 if r.any() else 0) * len(idx)
            rows_total += len(idx) * r.shape[1]
    e, h, p, v = (model_cfg.embedding_dim, model_cfg.hidden_dim, model_cfg.projection_dim,
                  model_cfg.vocab_size)
    per_token = {"output_layer": 2 * p * v, "lstm_gates": 2 * (e + p) * 4 * h, "lstm_proj": 2 * h * p}
    tot = sum(per_token.values())
    model = build_model(model_cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = torch.from_numpy(clients[0][:batch_size].astype(np.int64))

    def step():
        loss = next_token_loss(model(rows[:, :-1]), rows[:, 1:], PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    with torch.profiler.profile() as prof:
        for _ in range(reps):
            step()
    families = {"matmul": ("mm", "addmm", "bmm", "linear"), "log_softmax": ("_log_softmax",
                "_log_softmax_backward_data"), "optimizer": ("SGD",)}
    split = dict.fromkeys([*families, "other"], 0.0)
    total = 0.0
    for ev in prof.key_averages():
        name = ev.key.removeprefix("aten::")
        total += ev.self_cpu_time_total
        fam = next((f for f, keys in families.items() if any(k in name for k in keys)), "other")
        split[fam] += ev.self_cpu_time_total
    return {
        "real_target_fraction": round(real / rows_total, 4),
        "trimmed_width_fraction": round(width / rows_total, 4),
        "flops_fraction_per_token": {k: round(f / tot, 3) for k, f in per_token.items()},
        "forward_flops_per_padded_step_M": round(tot * rows_total / sum(
            -(-len(x) // batch_size) for x in clients) / 1e6, 1),
        "profile_self_time_fraction": {k: round(t / total, 3) for k, t in split.items()},
        "profile_ms_per_step": round(total / 1000 / reps, 2),
    }


def zoo_vs_nn_lstm(model_cfg, rows: torch.Tensor, reps: int) -> dict:
    """ms per SGD step of the zoo LSTM and of nn.LSTM (same shape, projection), interleaved."""
    zoo = build_model(model_cfg)
    ref, ref_forward = nn_lstm_model(model_cfg)
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
    from dpfleet.coordinator.engine.ray_backend import RayTrainer

    return RayTrainer(model_cfg, seq_len=seq_len, batch_size=batch_size, workers=workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="rounds per thread count")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--trainers", default="sequential,cohort,cohort_chunk1,nn_lstm")
    ap.add_argument("--ray-workers", type=int, default=2, help="Ray(local) actors, one thread each")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_throughput.json")
    args = ap.parse_args()
    load_start = os.getloadavg()

    cfg, model_cfg, data = build_workload(PEER)
    eligible = [c for c in data.train if len(c.examples) >= 16]
    theta = get_flat(build_model(model_cfg))
    bs, lr, seq_len = cfg.client.batch_size, cfg.client.lr, cfg.data.seq_len
    trainers = {
        "sequential": lambda: SequentialTrainer(EagerRuntime(model_cfg)),
        "cohort": lambda: CohortTrainer(model_cfg, seq_len=seq_len, batch_size=bs, device="cpu"),
        "cohort_chunk1": lambda: CohortTrainer(model_cfg, seq_len=seq_len, batch_size=bs,
                                               device="cpu", chunk=1),
        "cohort_vmap": lambda: CohortTrainer(model_cfg, seq_len=seq_len, batch_size=bs,
                                             device="cpu", fused=False),
        "nn_lstm": lambda: NnLstmTrainer(model_cfg),
        "ray": lambda: _ray_trainer(model_cfg, seq_len, bs, args.ray_workers),
    }
    names = args.trainers.split(",")
    built = {n: trainers[n]() for n in names}
    rng = np.random.default_rng(cfg.seed)
    by_threads = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        wall = dict.fromkeys(names, 0.0)
        updates = steps = 0
        max_diff = 0.0
        loads = [os.getloadavg()]
        for r in tqdm(range(args.rounds), desc=f"rounds, {threads} thread(s)"):
            cohort = rng.choice(len(eligible), cfg.dp.report_goal, replace=False)
            examples = [eligible[i].examples for i in cohort]
            seeds = [int(i) for i in cohort]
            results = {}
            for n in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                results[n] = built[n].train_round(theta, examples, seeds, lr=lr, batch_size=bs,
                                                  clip_norm=cfg.dp.clip_norm)
                wall[n] += time.perf_counter() - t0
                loads.append(os.getloadavg())
                tqdm.write(f"{threads} thread(s), round {r}: {n} {time.perf_counter() - t0:.1f} s, "
                           f"load {loads[-1][0]:.1f}")
            if "sequential" in results:
                for n in names:
                    if n != "nn_lstm":
                        max_diff = max(max_diff, max(float(np.abs(a.delta - b.delta).max()) for a, b
                                                     in zip(results["sequential"], results[n], strict=True)))
            updates += len(examples)
            steps += sum(-(-len(x) // bs) for x in examples)
        base = wall[names[0]]
        by_threads[str(threads)] = {
            "paths": {n: {"seconds": round(w, 2), "client_updates_per_s": round(updates / w, 3),
                          "gradient_steps_per_s": round(steps / w, 2),
                          "speedup_vs_" + names[0]: round(base / w, 3)} for n, w in wall.items()},
            "client_updates": updates, "gradient_steps": steps,
            "max_abs_delta_diff_vs_sequential": max_diff,
            "loadavg_1min_min_max": [round(min(x[0] for x in loads), 2), round(max(x[0] for x in loads), 2)],
        }
    torch.set_num_threads(1)
    rows = torch.from_numpy(eligible[0].examples[:bs].astype(np.int64))
    out = {
        "workload": "issue 15 peer: LSTM 96/256/96, 4K words, 50 clients/round, batch 16, lr 0.5, no noise",
        "vocab_size": model_cfg.vocab_size, "clients_eligible": len(eligible),
        "rounds_per_thread_count": args.rounds, "by_torch_threads": by_threads,
        "cohort_chunk": built["cohort"].chunk if "cohort" in built else None,
        "step_anatomy_1_thread": step_anatomy(model_cfg, [c.examples for c in eligible], bs),
        "zoo_vs_nn_lstm_1_thread": zoo_vs_nn_lstm(model_cfg, rows, reps=10),
        "clip_norm_cost_1M_params": clip_norm_cost(int(theta.size)),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cpu_count": os.cpu_count(),
        "ray_workers": args.ray_workers if "ray" in built else None,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
