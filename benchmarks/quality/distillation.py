"""Does distilling the public LLM help the main job? L_LM + beta L_KD public pretraining vs L_LM.

Paper 000 (Sec. 4.1) pretrains the on-device model on public text with the teacher's top-k
next-token logits as extra targets. Here, on the main job (`examples/shakespeare_cifg.toml`):

* the on-device vocabulary is Gemma-3-270M's, trimmed to the main job's 1,024 pieces on its
  tokenizer corpus (WikiText-2 train), since distillation needs student pieces that are teacher
  pieces; both arms use it;
* the public corpus is the main job's (the King James Bible, rows of 20 tokens); `--rows` of
  them, a fixed random subset, are labelled once by the teacher (top-10, cached in
  `$DPFLEET_CACHE/topk/`, resumable) and both arms train on exactly those rows;
* each seed draws one init; from it the "lm" arm trains with beta = 0 and the "kd" arm with
  beta > 0, for the same `--steps` Adam steps of 32 rows (the main job's pretraining budget);
* each public model is scored alone on the main job's held-out users (accuracy, perplexity),
  then the main job (eps 8, 20 rounds) runs from it with that seed; both arms of a seed share
  the DP noise (`dp.noise_seed` = the seed: research mode, so the paired difference is not
  buried under noise draws; the eps is the same as with secret noise).

beta is chosen before any private data is touched: each of `--betas` trains once (seed 0) and
the one with the lowest next-token loss on `--valid-rows` (2,000) held-out *public* rows wins
(no privacy cost).
`--longer` then trains seed 0's two public models 4x as long, to see whether the steps were
what held distillation back. Rows are appended to `--out` as they finish, so an interrupted
experiment resumes; the summary (paired differences kd - lm with 95% t intervals, sample sd)
goes to `--md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
from paired import format_difference, paired_difference  # noqa: E402

from dpfleet.coordinator.config import parse_config, read_toml  # noqa: E402
from dpfleet.coordinator.engine.evaluation import evaluate, split_held_out  # noqa: E402
from dpfleet.coordinator.engine.simulation import prepare_data, run_simulation  # noqa: E402
from dpfleet.edge.datasets import load_records  # noqa: E402
from dpfleet.edge.wheel_cache import cache_dir  # noqa: E402
from dpfleet.export.models import build_model  # noqa: E402
from dpfleet.export.params import get_flat, set_flat  # noqa: E402
from dpfleet.public.kd_pretrain import KDTrainConfig, kd_evaluate, kd_train  # noqa: E402
from dpfleet.public.public_init import public_sequences  # noqa: E402
from dpfleet.public.teacher import load_teacher, resolve_teacher  # noqa: E402
from dpfleet.public.teacher_tokenizer import TeacherVocab, build_teacher_vocab, load_teacher_spm  # noqa: E402
from dpfleet.public.topk import TopKCorpus, TopKExtractor  # noqa: E402
from dpfleet.public.topk_cache import cached_topk_corpus  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MAIN_JOB = ROOT / "examples" / "shakespeare_cifg.toml"


def teacher_vocab(teacher: str, size: int) -> tuple[TeacherVocab, Path]:
    """The teacher's vocabulary trimmed on the main job's tokenizer corpus (cached) and its folder."""
    folder = cache_dir() / "kd" / f"vocab-{teacher}-{size}-wikitext2"
    if (folder / "teacher.json").is_file():
        return TeacherVocab.load(folder), folder
    lines = [r.text for r in load_records("wikitext2", "train")]
    return build_teacher_vocab(load_teacher_spm(resolve_teacher(teacher)), lines, size, folder,
                               teacher), folder


def main_job(seed: int, vocab_dir: Path) -> dict:
    values = read_toml(MAIN_JOB)
    values["seed"] = seed
    values["tokenizer"] = {"path": str(vocab_dir)}
    values["dp"]["noise_seed"] = seed
    return values


def labelled_rows(vocab: TeacherVocab, rows: int, valid: int, teacher: str) -> tuple[TopKCorpus, dict]:
    """`rows` random KJV rows for training plus `valid` for choosing beta, labelled (cached)."""
    sequences = public_sequences(["kjv"], vocab.tokenizer, 20)
    order = np.random.default_rng(0).permutation(len(sequences))[: rows + valid]
    chosen = [sequences[i] for i in order]
    extractor = TopKExtractor(load_teacher(teacher, "cpu"), vocab, 10)
    start = time.perf_counter()
    folder = cached_topk_corpus(extractor, chosen)
    info = {"kjv_rows": len(sequences), "labelled_rows": len(chosen),
            "labelled_tokens": int(sum(map(len, chosen))), "head": extractor.head_mode,
            "labelling_seconds": time.perf_counter() - start, "corpus": str(folder)}
    corpus = TopKCorpus(folder)
    info["labelling_tokens_per_s"] = corpus.manifest.get("tokens_per_s")
    return corpus, info


def public_model(model_cfg, seed: int, corpus, train: np.ndarray, steps: int,
                 beta: float) -> np.ndarray:
    torch.manual_seed(seed)
    theta0 = get_flat(build_model(model_cfg))
    cfg = KDTrainConfig(steps=steps, batch_size=32, lr=3e-3, beta=beta, seed=seed)
    theta, _ = kd_train(model_cfg, theta0, corpus, train, cfg, progress=True,
                        desc=f"{'kd' if beta else 'lm'} seed {seed}")
    return theta


def run_arm(arm: str, seed: int, beta: float, steps: int, corpus, train, vocab_dir: Path) -> dict:
    cfg = parse_config(main_job(seed, vocab_dir))
    t0 = time.perf_counter()
    tokenizer, data = prepare_data(cfg, None)
    rows, _ = split_held_out(data.test, cfg.data.eval_examples or None)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    theta = public_model(model_cfg, seed, corpus, train, steps, beta if arm == "kd" else 0.0)
    public_seconds = time.perf_counter() - t0
    model = build_model(model_cfg)
    set_flat(model, theta)
    public = evaluate(model, rows)

    def pretrain(cfg, model_cfg, model, tokenizer, log, progress=True) -> dict:
        set_flat(model, theta)  # the arm's public model, trained above
        return {"corpus": ["kjv"], "rows": len(train), "steps": steps, "beta": beta,
                "distilled": arm == "kd"}

    with tempfile.TemporaryDirectory() as tmp:
        res = run_simulation(cfg, Path(tmp) / "run", progress=False, log=lambda s: None,
                             pretrain=pretrain)
        run_summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    final, started_from = run_summary["final"], run_summary.get("public_pretraining", {})
    if started_from.get("distilled") != (arm == "kd"):
        raise RuntimeError(f"the private run did not start from the {arm} public model")
    return {"arm": arm, "seed": seed, "steps": steps, "beta": beta if arm == "kd" else 0.0,
            "public_accuracy": public["accuracy"], "public_perplexity": public["perplexity"],
            "private_accuracy": final["accuracy"], "private_perplexity": final["perplexity"],
            "epsilon": res.privacy["epsilon"], "public_seconds": public_seconds,
            "wall_seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads(),
            "loadavg": os.getloadavg()[0]}


def choose_beta(betas: list[float], steps: int, corpus, train, valid, vocab_dir: Path) -> list[dict]:
    """One public model per beta (seed 0); the next-token loss on held-out public rows."""
    cfg = parse_config(main_job(0, vocab_dir))
    size = TeacherVocab.load(vocab_dir).tokenizer.vocab_size
    model_cfg = dataclasses.replace(cfg.model, vocab_size=size)
    out = []
    for beta in [0.0, *betas]:
        theta = public_model(model_cfg, 0, corpus, train, steps, beta)
        scores = kd_evaluate(model_cfg, theta, corpus, valid)
        out.append({"beta": beta, "valid_lm": scores["lm"], "valid_kd": scores["kd"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def longer_training(steps: int, beta: float, corpus, train, valid, vocab_dir: Path) -> list[dict]:
    """Seed 0's public model of each arm at `steps`: does a longer run open a gap? Scored on the
    held-out public rows and the main job's held-out users (no private run)."""
    cfg = parse_config(main_job(0, vocab_dir))
    tokenizer, data = prepare_data(cfg, None)
    rows, _ = split_held_out(data.test, cfg.data.eval_examples or None)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    out = []
    for arm, b in (("lm", 0.0), ("kd", beta)):
        theta = public_model(model_cfg, 0, corpus, train, steps, b)
        model = build_model(model_cfg)
        set_flat(model, theta)
        held = evaluate(model, rows)
        out.append({"arm": arm, "seed": 0, "steps": steps, "beta": b,
                    "valid_lm": kd_evaluate(model_cfg, theta, corpus, valid)["lm"],
                    "public_accuracy": held["accuracy"], "public_perplexity": held["perplexity"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    by = {(r["arm"], r["seed"]): r for r in rows if r["arm"] in ("kd", "lm")}
    seeds = sorted({s for a, s in by if (("kd", s) in by and ("lm", s) in by)})
    out = {"seeds": seeds}
    if not seeds:
        return out
    for key in ("public_accuracy", "public_perplexity", "private_accuracy", "private_perplexity"):
        kd = [by[("kd", s)][key] for s in seeds]
        lm = [by[("lm", s)][key] for s in seeds]
        scale = 100 if "accuracy" in key else 1
        out[key] = {"kd_mean": float(np.mean(kd)), "lm_mean": float(np.mean(lm)),
                    "kd_minus_lm": paired_difference(np.multiply(kd, scale), np.multiply(lm, scale)),
                    "unit": "points" if scale == 100 else "perplexity"}
    return out


def markdown(result: dict) -> str:
    s, info = result["summary"], result["setup"]
    lines = [f"{len(s['seeds'])} seeds; kd - lm, paired, 95% t interval (sample sd):", "",
             "| measure | lm (mean) | kd (mean) | kd - lm |", "|---|---|---|---|"]
    for key, label in (("public_accuracy", "public model alone: accuracy"),
                       ("public_perplexity", "public model alone: perplexity"),
                       ("private_accuracy", "main job at eps 8: accuracy"),
                       ("private_perplexity", "main job at eps 8: perplexity")):
        c = s[key]
        fmt = (lambda v: f"{v:.4f}") if "accuracy" in key else (lambda v: f"{v:.2f}")
        lines.append(f"| {label} | {fmt(c['lm_mean'])} | {fmt(c['kd_mean'])} | "
                     f"{format_difference(c['kd_minus_lm'])} {c['unit']} |")
    if result.get("longer"):
        lines += ["", "Longer public training (seed 0, public models only):", ""]
    for row in result.get("longer", []):
        lines.append(f"- seed 0, {row['arm']}, {row['steps']} steps: public held-out loss "
                     f"{row['valid_lm']:.4f}, main job's held-out users {row['public_accuracy']:.4f} "
                     f"(perplexity {row['public_perplexity']:.1f})")
    lines += ["", f"Setup: {json.dumps(info)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--rows", type=int, default=30_000, help="labelled KJV training rows")
    parser.add_argument("--valid-rows", type=int, default=2000,
                        help="labelled KJV rows held out to choose beta")
    parser.add_argument("--steps", type=int, default=3000, help="Adam steps of 32 rows, each arm")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--betas", default="1.0,0.1,0.01", help="tried on public rows (seed 0)")
    parser.add_argument("--longer", type=int, default=12_000,
                        help="also train seed 0's two public models this many steps (0: skip)")
    parser.add_argument("--beta", type=float, default=None, help="skip the choice")
    parser.add_argument("--threads", type=int, default=2, help="the main job's client.threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "distillation.json")
    parser.add_argument("--md", type=Path, default=RESULTS / "distillation.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab, vocab_dir = teacher_vocab(args.teacher, 1024)
    corpus, info = labelled_rows(vocab, args.rows, args.valid_rows, args.teacher)
    info.update(steps=args.steps, batch_size=32, teacher=args.teacher, k=10,
                vocab_size=vocab.tokenizer.vocab_size, threads=args.threads)
    train, valid = np.arange(args.rows), np.arange(args.rows, args.rows + args.valid_rows)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": []}
    if args.beta is not None:
        beta = args.beta
    else:
        if not result.get("beta_choice"):
            result["beta_choice"] = choose_beta([float(b) for b in args.betas.split(",")],
                                                args.steps, corpus, train, valid, vocab_dir)
            args.out.write_text(json.dumps(result, indent=2))
        beta = min((c for c in result["beta_choice"] if c["beta"] > 0),
                   key=lambda c: c["valid_lm"])["beta"]
    info["beta"] = beta
    done = {(r["arm"], r["seed"]) for r in result["rows"]}
    for seed in range(args.seeds):
        for arm in ("lm", "kd"):
            if (arm, seed) in done:
                continue
            row = run_arm(arm, seed, beta, args.steps, corpus, train, vocab_dir)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            result["setup"] = info
            result["summary"] = summary(result["rows"])
            args.out.write_text(json.dumps(result, indent=2))
    if args.longer and not result.get("longer"):
        result["longer"] = longer_training(args.longer, beta, corpus, train, valid, vocab_dir)
        args.out.write_text(json.dumps(result, indent=2))
    if result.get("summary", {}).get("seeds"):
        args.md.write_text(markdown(result))
        print(markdown(result))


if __name__ == "__main__":
    main()
