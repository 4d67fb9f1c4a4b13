"""How close the fused cohort step is to this CPU's matmul speed: its GEMMs timed alone vs the step.

Why: the cohort trainer's speed-up over a plain per-client loop is bounded by what the step's
matrix products can do at their shapes. A recurrent step's per-time-step products have only
`batch` (16) rows per client, and every client has its own weights, so stacking clients does not
make those GEMMs larger; only the input projection, the weight gradients and the output layer
are large. This script times every GEMM of one fused step (`edge/cohort_lstm.py`) with
`torch.bmm` at exactly its shapes ("GEMM floor": a step that did nothing else), the machine's
sgemm on a large square product, and the real fused step on real Shakespeare minibatches, and
reports achieved GFLOP/s against the floor.

    python benchmarks/cohort_roofline.py [--threads 1,2] [--reps 5]

Workloads: `peer` (issue 15's LSTM 96/256/96, 4K words, the chunk of 9 clients the default
budget gives) and `main` (examples/shakespeare_cifg.toml's CIFG 32/64/32, 1K pieces, 20 clients).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import tomllib
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.edge.cohort_lstm import recurrent_grads
from dpfleet.edge.minibatch import batches
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import build_model
from dpfleet.export.params import ParamLayout, get_flat

ROOT = Path(__file__).resolve().parents[1]


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def step_gemms(k: int, steps: int, rows: int, real: int, d: int, p: int, h: int, gates: int,
               vocab: int) -> list[tuple[str, tuple[int, int, int], int]]:
    """(name, (m, k_inner, n) per client, calls per step) of every GEMM of one fused step."""
    tb = steps * rows
    return [
        ("input_projection", (tb, d, gates), 1),
        ("recurrent_gates_fwd", (rows, p, gates), steps - 1),
        ("projection_fwd", (rows, h, p), steps),
        ("projection_bwd", (rows, p, h), steps),
        ("recurrent_gates_bwd", (rows, gates, p), steps - 1),
        ("input_grad", (tb, gates, d), 1),
        ("gates_weight_grad", (gates, tb, d + p), 1),
        ("projection_weight_grad", (p, tb, h), 1),
        ("logits", (real, p, vocab), 1),
        ("logits_input_grad", (real, vocab, p), 1),
        ("output_weight_grad", (vocab, real, p), 1),
    ]


def gemm_floor(k: int, shapes, reps: int) -> dict:
    """Each GEMM timed alone with torch.bmm over k clients (fresh operands, output reused)."""
    out, total_ms, total_flops = {}, 0.0, 0
    for name, (m, inner, n), calls in shapes:
        a, b, c = torch.randn(k, m, inner), torch.randn(k, inner, n), torch.empty(k, m, n)
        ms = _median_ms(lambda a=a, b=b, c=c: torch.bmm(a, b, out=c), reps)
        flops = 2 * k * m * inner * n
        out[name] = {"shape_per_client": [m, inner, n], "calls": calls, "ms_each": round(ms, 4),
                     "gflop_s": round(flops / ms / 1e6, 1)}
        total_ms += ms * calls
        total_flops += flops * calls
    return {"per_gemm": out, "floor_ms": round(total_ms, 3), "flops_M": round(total_flops / 1e6, 1),
            "floor_gflop_s": round(total_flops / total_ms / 1e6, 1)}


def machine_sgemm(reps: int, size: int = 1024) -> float:
    a, b, c = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    ms = _median_ms(lambda: torch.mm(a, b, out=c), reps)
    return round(2 * size**3 / ms / 1e6, 1)


def workload(name: str):
    if name == "main":
        raw = tomllib.loads((ROOT / "examples" / "shakespeare_cifg.toml").read_text())
        clients, min_rows = 20, 16
    else:
        from trainer_throughput import PEER

        raw, clients, min_rows = PEER, 9, 16
    cfg = parse_config(raw)
    tokenizer, data = prepare_data(cfg)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    eligible = [c.examples for c in data.train if len(c.examples) >= min_rows]
    rng = np.random.default_rng(0)
    chosen = [eligible[i] for i in rng.choice(len(eligible), clients, replace=False)]
    return cfg, model_cfg, chosen


def measure(name: str, reps: int) -> dict:
    cfg, model_cfg, chosen = workload(name)
    bs = cfg.client.batch_size
    trainer = CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=bs, device="cpu")
    k = min(trainer.chunk, len(chosen))
    theta = torch.from_numpy(get_flat(build_model(model_cfg)))
    layout = ParamLayout.of(trainer.model)
    params = {n: part.reshape(s).unsqueeze(0).repeat(k, *([1] * len(s))).contiguous()
              for n, s, part in zip(layout.names, layout.shapes, theta.split(layout.sizes), strict=True)}
    width = max(x.shape[1] for x in chosen)
    block = np.full((k, bs, width), PAD, dtype=np.int64)  # each client's first full minibatch
    for j, x in enumerate(chosen[:k]):
        idx = batches(len(x), bs, j)[0]
        block[j, : len(idx), : x.shape[1]] = x[idx]
    real_cols = (block[:, :, 1:] != PAD).any(axis=(0, 1)).nonzero()[0]
    rows = torch.from_numpy(block[:, :, : int(real_cols[-1]) + 2])
    steps = rows.shape[2] - 1
    real = int((rows[:, :, 1:] != PAD).sum(dim=(1, 2)).max())
    m = model_cfg
    gates = (3 if m.arch == "cifg" else 4) * m.hidden_dim
    shapes = step_gemms(k, steps, bs, real, m.embedding_dim, m.projection_dim, m.hidden_dim, gates,
                        m.vocab_size)
    floor = gemm_floor(k, shapes, reps)
    step_ms = _median_ms(lambda: recurrent_grads(model_cfg, params, rows, lr=0.0), reps)
    return {
        "model": f"{m.arch} {m.embedding_dim}/{m.hidden_dim}/{m.projection_dim}, vocab {m.vocab_size}",
        "clients_in_step": k, "time_steps": steps, "rows_per_client": bs, "most_real_targets": real,
        "fused_step_ms": round(step_ms, 3),
        "achieved_gflop_s": round(floor["flops_M"] / step_ms, 1),
        "gemm_floor": floor,
        "step_over_gemm_floor": round(step_ms / floor["floor_ms"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workloads", default="peer,main")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cohort_roofline.json")
    args = ap.parse_args()
    result = {"loadavg_start": os.getloadavg(), "cpu_count": os.cpu_count(), "by_torch_threads": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        entry = {"sgemm_1024_gflop_s": machine_sgemm(args.reps)}
        for name in args.workloads.split(","):
            entry[name] = measure(name, args.reps)
        result["by_torch_threads"][str(threads)] = entry
        print(json.dumps({threads: entry}, indent=1))
    result["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
