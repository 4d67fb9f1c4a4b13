"""Paper 003 Table 1, second half: pre-train on each candidate, then DP-FTRL; final accuracy.

For each seed and candidate (none, wikitext2, kjv, shakespeare-collab): public pre-training of the
on-device CIFG on the candidate's first --records records (plain next-token loss, --steps Adam
steps) at round 0 through the round engine's `before_round` hook, then T rounds of DP-FTRL on
`shakespeare-solo` (the tuned private setting of grid.py). The same seed gives the same clients,
tokenizer and DP noise across candidates, so differences are paired.

    python benchmarks/quality/fred_training.py --seeds 0 1 2

Writes fred_training.json next to this file (read by fred_quality.py for FRED.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from grid import add_grid_args, private_simulation

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import make_tokenizer, run_simulation
from dpfleet.public.fred_job import candidate_texts
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_train
from dpfleet.public.topk import student_sequences

HERE = Path(__file__).parent
CANDIDATES = ["none", "wikitext2", "kjv", "shakespeare-collab"]


def run_one(args, candidate: str, seed: int, root: Path) -> dict:
    values = private_simulation(args, args.noise[0], seed, eval_every=args.rounds,
                                eval_examples=1500)
    values["tokenizer"] = {"kind": "sentencepiece", "corpus": "wikitext2", "vocab_size": args.vocab}
    cfg = parse_config(values)
    tokenizer = make_tokenizer(cfg, [])
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    public_seconds = 0.0

    def pretrain(r: int, theta):
        nonlocal public_seconds
        if r != 0 or candidate == "none":
            return None
        t0 = time.perf_counter()
        texts = candidate_texts(candidate, args.records, seed=0)
        corpus = PlainCorpus(student_sequences(texts, tokenizer, 16))
        kd = KDTrainConfig(steps=args.steps, batch_size=32, lr=3e-3, beta=0.0, seed=seed)
        new_theta, _ = kd_train(model_cfg, theta, corpus, None, kd, progress=False)
        public_seconds = time.perf_counter() - t0
        return new_theta

    t0 = time.perf_counter()
    result = run_simulation(cfg, root / f"{candidate}-{seed}", overwrite=True, progress=False,
                            log=lambda s: None, before_round=pretrain)
    return {"candidate": candidate, "seed": seed, "accuracy": result.final["accuracy"],
            "final": result.final, "epsilon": result.privacy.get("epsilon"),
            "zcdp": result.privacy.get("zcdp"), "public_seconds": public_seconds,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_grid_args(ap)
    ap.add_argument("--records", type=int, default=2000, help="public records per candidate")
    ap.add_argument("--steps", type=int, default=150, help="public pre-training steps")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--candidates", nargs="+", default=CANDIDATES)
    ap.add_argument("--append", action="store_true", help="keep the rows already in the JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = HERE / "fred_training.json"
    rows = json.loads(out.read_text())["rows"] if args.append and out.is_file() else []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for cand in args.candidates:
                rows.append(run_one(args, cand, seed, Path(tmp)))
                print(json.dumps({k: rows[-1][k] for k in ("candidate", "seed", "accuracy", "seconds")}),
                      flush=True)
                out.write_text(json.dumps({
                    "setting": {"rounds": args.rounds, "report_goal": args.report_goal,
                                "noise_multiplier": args.noise[0], "momentum": args.momentum[0],
                                "records": args.records, "steps": args.steps, "vocab": args.vocab,
                                "private": "shakespeare-solo", "model": "cifg 32/64/32"},
                    "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                "loadavg": os.getloadavg()},
                    "rows": rows}, indent=2, default=float))


if __name__ == "__main__":
    main()
