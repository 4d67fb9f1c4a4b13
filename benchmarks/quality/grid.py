"""What the quality benchmarks share: the seeds x noise grid and the tuned private setting.

Private data is `shakespeare-solo` (Shakespeare without the co-written plays, which serve as an
in-style public source), T rounds of disjoint report-goal clients, with the DP settings tuned for
the main job (examples/shakespeare_cifg.toml). Server momentum is per noise level: 0.9 helps at
low noise, 0.5 at high, because momentum also amplifies the tree noise.
"""

from __future__ import annotations

import argparse


def add_grid_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--noise", type=float, nargs="+", default=[0.3, 0.7])
    ap.add_argument("--momentum", type=float, nargs="+", default=[0.9, 0.5],
                    help="server momentum for each --noise level, in order")
    ap.add_argument("--rounds", type=int, default=50)  # shakespeare-solo: 1056 training clients
    ap.add_argument("--report-goal", type=int, default=20)


def private_simulation(args: argparse.Namespace, noise: float, seed: int, *, eval_every: int,
                       eval_examples: int) -> dict:
    """The `[simulation]` values of one grid cell (tokenizer left to the caller)."""
    momentum = dict(zip(args.noise, args.momentum, strict=True))[noise]
    return {
        "rounds": args.rounds, "eval_every": eval_every, "seed": seed,
        "data": {"dataset": "shakespeare-solo", "seq_len": 16, "max_examples": 64,
                 "max_clients": args.rounds * args.report_goal, "eval_examples": eval_examples},
        "model": {"arch": "cifg", "embedding_dim": 32, "hidden_dim": 64, "projection_dim": 32},
        "client": {"lr": 5.0, "batch_size": 16},
        "dp": {"noise_multiplier": noise, "clip_norm": 2.0, "report_goal": args.report_goal,
               "server_lr": 1.0, "momentum": momentum},
        "participation": {"mode": "disjoint"},
    }
