"""Paper 000 Fig. 1 analogue: the teacher's public SentencePiece vocabulary vs a private word-level
vocabulary, under DP, with no public training.

The word vocabulary is the top-4096 words of the *private* training clients (what a deployment
without a public tokenizer would do; in a real deployment even that needs a DP vocabulary
count); the SentencePiece one is Gemma-3-270M's vocabulary trimmed to 4096 pieces on WikiText-2.
Accuracies are in different units (next word vs next sub-word token; the word model's OOV
targets are excluded from its accuracy, per paper 000 Sec. 3.1), so compare each against its own
unigram baseline rather than against each other.

    python benchmarks/quality/vocabulary.py --seeds 0 1 2 --noise 0.5 2.0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--noise", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--report-goal", type=int, default=20)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dpfleet-quality-vocab"))
    args = ap.parse_args()

    import torch

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.simulation import run_simulation
    from dpfleet.public.pipeline import parse_pipeline, teacher_vocab

    torch.set_num_threads(1)
    spm_dir = teacher_vocab(parse_pipeline({"public": {"vocab_size": 4096}}), print)
    spm_path = str(spm_dir.tokenizer.model_file.parent)
    results = []
    for noise in args.noise:
        for seed in args.seeds:
            for kind in ("word", "sentencepiece"):
                cfg = parse_config({
                    "rounds": args.rounds, "eval_every": args.rounds, "seed": seed,
                    "data": {"dataset": "shakespeare-solo", "seq_len": 16, "max_examples": 64,
                             "max_clients": args.rounds * args.report_goal, "eval_examples": 1500},
                    "tokenizer": {"kind": kind, "vocab_size": 4096,
                                  "path": spm_path if kind == "sentencepiece" else ""},
                    "model": {"arch": "cifg", "embedding_dim": 64, "hidden_dim": 128,
                              "projection_dim": 64},
                    "client": {"lr": 1.0, "batch_size": 16},
                    "dp": {"noise_multiplier": noise, "clip_norm": 1.0,
                           "report_goal": args.report_goal, "server_lr": 1.0, "momentum": 0.9},
                })
                t0 = time.perf_counter()
                res = run_simulation(cfg, args.work / f"{kind}-z{noise}-s{seed}", overwrite=True,
                                     progress=False, log=lambda _: None)
                results.append({"tokenizer": kind, "noise": noise, "seed": seed,
                                "accuracy": res.final["accuracy"], "epsilon": res.privacy["epsilon"],
                                "unigram_accuracy": res.baseline["accuracy"],
                                "seconds": time.perf_counter() - t0})
                print(json.dumps(results[-1]), flush=True)
    lines = ["| tokenizer | noise z | eps | accuracy (%) | unigram baseline (%) |", "|---|---|---|---|---|"]
    for noise in args.noise:
        for kind in ("word", "sentencepiece"):
            rows = [r for r in results if r["tokenizer"] == kind and r["noise"] == noise]
            acc = np.array([r["accuracy"] for r in rows]) * 100
            std = f" ± {acc.std():.2f}" if len(acc) > 1 else ""
            lines.append(f"| {kind} | {noise} | {rows[0]['epsilon']:.2f} | {acc.mean():.2f}{std} | "
                         f"{rows[0]['unigram_accuracy'] * 100:.2f} |")
    table = "\n".join(lines) + "\n"
    (HERE / "vocabulary.json").write_text(json.dumps({"settings": vars(args) | {"work": str(args.work)},
                                                      "results": results}, indent=2))
    (HERE / "vocabulary.md").write_text("# Public SentencePiece vs private word vocabulary under DP "
                                        f"(paper 000 Fig. 1 analogue)\n\nT = {args.rounds}, report goal "
                                        f"{args.report_goal}, no public training.\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
