"""Paper 000 Table 2 / Table 3 / Fig. 3 analogues at laptop scale, with `dpfleet public pipeline`.

Private: Shakespeare without its collaborative plays (`shakespeare-solo`). Public pool: WikiText-2,
the King James Bible and the collaborative plays (`shakespeare-collab`: same author, other
plays), so matching has an in-style source to find. Teacher: Gemma-3-270M (packaged GGUF); its
vocabulary trimmed to 4096 pieces is the on-device tokenizer of every row.

Rows (T' = T / 2 for mid-training, the same number of public steps everywhere):
  none         no public training
  pre-100      public pre-training (T' = 0) on 100% of the pool, L_LM
  pre-kd       public pre-training on a random q_small with KD
  mid          mid-training on a random q, L_LM
  mid-kd       + KD
  mid-kd-dm    + distribution matching ((l_pub + l_priv) / 2)
  mid-kd-priv  Table 3: matching on l_priv only

    python benchmarks/quality/public_training.py --seeds 0 1 2 --noise 0.3 0.7 --momentum 0.9 0.5
    python benchmarks/quality/public_training.py --summarize   # public_training.md from the .json

Writes public_training.json / .md and fig3_ppl_scatter.png next to this file. The private data
(shakespeare-solo) and the pool's shakespeare-collab share no record (edge/overlap.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from grid import add_grid_args, private_simulation
from paired import format_difference, paired_difference

HERE = Path(__file__).parent

VARIANTS = {
    "none": {"selection": "none"},
    "pre-100": {"first_stage_rounds": 0, "selection": "random", "fraction": 1.0, "kd_beta": 0.0},
    "pre-kd": {"first_stage_rounds": 0, "selection": "random", "fraction": "small", "kd_beta": 0.1},
    "mid": {"selection": "random", "kd_beta": 0.0},
    "mid-kd": {"selection": "random", "kd_beta": 0.1},
    "mid-kd-dm": {"selection": "match", "match_beta": 0.5, "kd_beta": 0.1},
    "mid-kd-priv": {"selection": "match", "match_beta": 1.0, "kd_beta": 0.1},
}


def config(args, variant: str, noise: float, seed: int) -> dict:
    """One row's pipeline config: the tuned private setting of `grid.py` plus the public stage."""
    public = {"teacher": args.teacher, "vocab_size": 4096, "fraction": args.q, "steps": args.steps,
              "batch_size": 32, "lr": 3e-3}
    public.update(VARIANTS[variant])
    if public["fraction"] == "small":
        public["fraction"] = args.q_small
    return {
        "public": public,
        "pool": {"sources": ["wikitext2", "kjv", "shakespeare-collab"], "records": args.pool,
                 "seq_len": 16, "seed": 0},
        "simulation": private_simulation(args, noise, seed, eval_every=args.rounds // 2,
                                         eval_examples=1500),
    }


def fig3(run: Path, teacher_work, vocab, model_cfg, private_texts: list[str], png: Path) -> dict:
    """Per-record perplexity under the DP checkpoint at T' vs the teacher, pool and private."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfleet.export.models import build_model
    from dpfleet.export.params import set_flat
    from dpfleet.public.matching import student_logprobs, teacher_logprobs

    with np.load(run / "scores.npz") as z:
        l_priv = z["l_priv"]
    l_pub = teacher_work.logprobs()  # cached; the l_priv-only run stores no l_pub
    with np.load(run / "pool.npz") as z:
        sources = z["sources"]
    seqs = [ids for ids in (vocab.tokenizer.encode(t)[:16] for t in private_texts) if len(ids) >= 4]
    model = build_model(model_cfg)
    set_flat(model, np.load(run / "first_stage_theta.npy"))
    priv_student = student_logprobs(model, seqs)
    priv_teacher = teacher_logprobs(teacher_work.extractor(), vocab.tokenizer, seqs,
                                    progress=False)
    fig, ax = plt.subplots(figsize=(6, 5))
    groups = {s: (np.exp(-l_priv[sources == s]), np.exp(-l_pub[sources == s]))
              for s in dict.fromkeys(sources)}
    groups["private (shakespeare-solo sample)"] = (np.exp(-priv_student), np.exp(-priv_teacher))
    for name, (x, y) in groups.items():
        ax.scatter(x, y, s=8, alpha=0.5, label=name)
    ax.set(xscale="log", yscale="log", xlabel="PPL under the private LM (DP checkpoint at T')",
           ylabel="PPL under the teacher (Gemma-3-270M, own tokenization,\nper on-device token)",
           title="Fig. 3 analogue")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return {name: {"median_ppl_private_lm": float(np.median(x)), "median_ppl_teacher": float(np.median(y)),
                   "records": len(x)} for name, (x, y) in groups.items()}


# (row, compared with) pairs the notes discuss, each as a paired difference over seeds
COMPARISONS = [("pre-100", "none"), ("pre-kd", "none"), ("mid", "none"), ("mid-kd", "none"),
               ("mid-kd-dm", "none"), ("mid-kd-priv", "none"), ("mid", "pre-100"),
               ("pre-kd", "pre-100"), ("mid-kd", "mid"), ("mid-kd-dm", "mid-kd"),
               ("mid-kd-priv", "mid-kd"), ("mid-kd-priv", "mid-kd-dm")]


def comparisons(results: list[dict]) -> list[dict]:
    """Accuracy differences (points) of COMPARISONS per noise level, paired by seed."""
    acc = {(r["variant"], r["noise"], r["seed"]): r["accuracy"] * 100 for r in results}
    out = []
    for noise in sorted({r["noise"] for r in results}):
        for row, base in COMPARISONS:
            seeds = sorted(s for v, z, s in acc if v == row and z == noise and (base, z, s) in acc)
            if seeds:
                out.append({"row": row, "vs": base, "noise": noise, "seeds": seeds,
                            **paired_difference([acc[row, noise, s] for s in seeds],
                                                [acc[base, noise, s] for s in seeds])})
    return out


def comparison_table(rows: list[dict]) -> str:
    lines = ["| row - compared with | noise z | mean difference [95% t-interval] (points), "
             "seeds up / down |", "|---|---|---|"]
    lines += [f"| {c['row']} - {c['vs']} | {c['noise']} | {format_difference(c)} |" for c in rows]
    return "\n".join(lines) + "\n"


def _mean_std(values: np.ndarray, signed: bool = False) -> str:
    mean = f"{values.mean():+.2f}" if signed else f"{values.mean():.2f}"
    return mean + (f" ± {values.std(ddof=1):.2f}" if len(values) > 1 else "")


def markdown(results: list[dict], args) -> str:
    lines = [f"T = {args.rounds} rounds, report goal {args.report_goal}, pool {args.pool} "
             f"(wikitext2, kjv, shakespeare-collab), q = {args.q}, q_small = {args.q_small}, "
             f"{args.steps} public steps. Accuracy (%) on held-out private clients, mean ± sample "
             "sd over seeds; 'vs none' is the mean ± sample sd of the per-seed difference to the "
             "`none` row of the same seed (paired: same clients, same noise draws before public "
             "training); 95% t-intervals are in the second table.",
             "", "| row | noise z | eps | accuracy | vs none | acc. at T' (before public) | selected "
             "from wikitext2 / kjv / collab (mean) |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["variant"], r["noise"]) for r in results},
                  key=lambda k: (k[1], list(VARIANTS).index(k[0])))
    for variant, noise in keys:
        rows = sorted((r for r in results if r["variant"] == variant and r["noise"] == noise),
                      key=lambda r: r["seed"])
        acc = np.array([r["accuracy"] for r in rows]) * 100
        none = {r["seed"]: r["accuracy"] * 100 for r in results
                if r["variant"] == "none" and r["noise"] == noise}
        diff = np.array([a - none[r["seed"]] for a, r in zip(acc, rows, strict=True) if r["seed"] in none])
        before = [r["accuracy_before_public_training"] for r in rows]
        before_s = "" if before[0] is None else _mean_std(np.array(before) * 100)
        picked = "-"
        if rows[0].get("sources"):
            picked = " / ".join(f"{np.mean([r['sources'][s]['selected'] for r in rows]):.0f}"
                                for s in ("wikitext2", "kjv", "shakespeare-collab"))
        vs_none = _mean_std(diff, signed=True) if variant != "none" and len(diff) else ""
        lines.append(f"| {variant} | {noise} | {rows[0]['epsilon']:.2f} | {_mean_std(acc)} | "
                     f"{vs_none} | {before_s} | {picked} |")
    return "\n".join(lines) + "\n\n" + comparison_table(comparisons(results))


def summarize() -> None:
    """Rewrite public_training.md from public_training.json (no run)."""
    payload = json.loads((HERE / "public_training.json").read_text())
    args = argparse.Namespace(**payload["settings"])
    write_markdown(payload["results"], args)


def write_markdown(results: list[dict], args) -> None:
    text = markdown(results, args)
    (HERE / "public_training.md").write_text("# Public training at laptop scale (paper 000 Tables "
                                             "2-3)\n\n" + text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_args(ap)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--pool", type=int, nargs=3, default=[200, 100, 100])
    ap.add_argument("--q", type=float, default=0.2)
    ap.add_argument("--q-small", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--teacher", default="gemma3-270m")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dpfleet-quality-tuned"))
    ap.add_argument("--rerun", action="store_true", help="rerun pipelines finished in --work")
    ap.add_argument("--summarize", action="store_true",
                    help="only rewrite public_training.md from public_training.json")
    args = ap.parse_args()
    if args.summarize:
        return summarize()

    import torch

    from dpfleet.public.pipeline import parse_pipeline, run_pipeline

    torch.set_num_threads(1)
    results = []
    for noise in args.noise:
        for seed in args.seeds:
            for variant in args.variants:
                cfg = parse_pipeline(config(args, variant, noise, seed))
                out = args.work / f"{variant}-z{noise}-s{seed}"
                if (out / "summary.json").is_file() and not args.rerun:  # finished earlier
                    s = json.loads((out / "summary.json").read_text())
                else:
                    s = run_pipeline(cfg, out, overwrite=True, progress=False, log=lambda _: None)
                results.append({"variant": variant, "noise": noise, "seed": seed,
                                "accuracy": s["final"]["accuracy"], "epsilon": s["epsilon"],
                                "accuracy_before_public_training": s["accuracy_before_public_training"],
                                "sources": s.get("sources"), "seconds": s["wall_seconds"]})
                print(json.dumps(results[-1], default=float), flush=True)
    payload = {"settings": vars(args) | {"work": str(args.work)}, "results": results}
    dm = [r for r in results if r["variant"] in ("mid-kd-dm", "mid-kd-priv")]  # same T' checkpoint
    if dm:
        run = args.work / f"{dm[0]['variant']}-z{dm[0]['noise']}-s{dm[0]['seed']}"
        from dpfleet.edge.datasets import load_records
        from dpfleet.public.matching import Pool
        from dpfleet.public.pipeline import TeacherWork, teacher_vocab

        cfg = parse_pipeline(config(args, "mid-kd-dm", dm[0]["noise"], dm[0]["seed"]))
        vocab = teacher_vocab(cfg, print)
        with np.load(run / "pool.npz") as z:
            lengths = np.cumsum(z["lengths"])[:-1]
            pool = Pool([list(s) for s in np.split(z["tokens"], lengths)], list(z["sources"]),
                        list(z["texts"]))
        import dataclasses

        model_cfg = dataclasses.replace(cfg.simulation.model, vocab_size=vocab.tokenizer.vocab_size)
        private = [r.text for r in load_records("shakespeare-solo")[::300][:80]]
        payload["fig3"] = fig3(run, TeacherWork(cfg, vocab, pool, False), vocab, model_cfg, private,
                               HERE / "fig3_ppl_scatter.png")
    (HERE / "public_training.json").write_text(json.dumps(payload, indent=2, default=float))
    write_markdown(results, args)


if __name__ == "__main__":
    main()
