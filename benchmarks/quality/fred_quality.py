"""Paper 003 analogues for FreD on embedded text: Table 1 (FreD half) and Fig. 2.

Private: `shakespeare-solo` (a cohort of K users, at most --max-samples speeches each). Public
PCA to --pca-dim fitted on 1000 records each of wikitext2 / kjv / shakespeare-collab (free);
clip c = the 90th percentile of the public pool's projected norms (public, so free).

* Table 1: candidates wikitext2, kjv, shakespeare-collab (--records each): non-private FD (all the
  cohort's speeches, record-level moments) and DP FreD at (0.6, 2e-6), user level and sample level,
  over --trials noise draws (mean and 95% t-interval, sample sd).
* Fig. 2: Y% co-written plays + (100 - Y)% WikiText-2 at fixed size --mix-size, Y in {0, 10, ...,
  90, 95, 99, 100}; each trial draws a new mixture and a new DP noise draw. Is FreD monotone in Y;
  can 99% and 100% be told apart (paired difference per trial, and the paper's criterion: every
  100% value below every 99% value)?

    python benchmarks/quality/fred_quality.py --embedder glove
    python benchmarks/quality/fred_quality.py --embedder minilm --max-samples 4

Writes fred_quality_<embedder>.json and fred_fig2_<embedder>.png next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import scipy.stats
import torch

from dpfleet.public.embedders import Projection, load_embedder
from dpfleet.public.fred import frechet_distance, moments
from dpfleet.public.fred_job import (
    FredSection,
    candidate_texts,
    cohort_texts,
    embed_cached,
    public_pool_texts,
)
from dpfleet.public.fred_privacy import calibrate
from dpfleet.public.fred_stats import private_moments

HERE = Path(__file__).parent
YS = [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 99, 100]
CANDIDATES = ["wikitext2", "kjv", "shakespeare-collab"]


def interval(values) -> dict:
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return {"mean": float(v.mean()), "ci95": None, "n": len(v), "values": v.tolist()}
    half = float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)))
    return {"mean": float(v.mean()), "ci95": half, "n": len(v), "values": v.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--embedder", default="glove")
    ap.add_argument("--cohort", type=int, default=1000)
    ap.add_argument("--max-samples", type=int, default=256)
    ap.add_argument("--pca-dim", type=int, default=16)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--mix-size", type=int, default=2000)
    ap.add_argument("--pool", type=int, default=4000,
                    help="records of each Fig. 2 source the mixtures are drawn from")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--pca-records", type=int, default=1000, help="public PCA records per source")
    ap.add_argument("--epsilon", type=float, default=0.6)
    ap.add_argument("--delta", type=float, default=2e-6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    f = FredSection(embedder=args.embedder, cohort_size=args.cohort, max_samples=args.max_samples,
                    pca_dim=args.pca_dim, pca_records=args.pca_records)
    embedder = load_embedder(args.embedder)
    cohort = cohort_texts(f)
    collab = candidate_texts("shakespeare-collab", args.pool)
    wiki = candidate_texts("wikitext2", args.pool)
    needed = {c: candidate_texts(c, args.records) for c in CANDIDATES}
    pool_texts = public_pool_texts(f)
    # every distinct text is embedded once (the sets overlap: same shuffles, nested prefixes)
    unique = sorted({t for group in (pool_texts, collab, wiki, *needed.values(), *cohort) for t in group})
    table = dict(zip(unique, embed_cached(embedder, unique), strict=True))

    def embed(texts: list[str]) -> np.ndarray:
        return np.stack([table[t] for t in texts])

    public = embed(pool_texts)
    proj = Projection.fit(public, args.pca_dim)
    clip = float(np.quantile(np.linalg.norm(proj.apply(public), axis=1), 0.9))
    counts = [len(t) for t in cohort]
    flat = proj.apply(embed([t for texts in cohort for t in texts]))
    users = np.split(flat, np.cumsum(counts)[:-1])
    z1, z2 = calibrate(args.epsilon, args.delta)
    exact = moments(flat)
    releases = {
        level: [private_moments(users, clip=clip, z_mean=z1, z_cov=z2, level=level,
                                noise_seed=1000 * (level == "sample") + t, max_samples=args.max_samples)
                for t in range(args.trials)] for level in ("user", "sample")}
    noiseless_user = private_moments(users, clip=clip, z_mean=1e-9, z_cov=1e-9, noise_seed=0,
                                     max_samples=args.max_samples)

    def scores(x: np.ndarray, t: int | None) -> dict:
        m, c = moments(x)
        out = {"non_private": frechet_distance(m, c, *exact), "user_clipped_noiseless":
               frechet_distance(m, c, noiseless_user.mean, noiseless_user.cov)}
        for level, rs in releases.items():
            picks = rs if t is None else [rs[t]]
            out[f"dp_{level}"] = [frechet_distance(m, c, r.mean, r.cov) for r in picks]
        return out

    table1 = {}
    for cand in CANDIDATES:
        s = scores(proj.apply(embed(needed[cand])), None)
        table1[cand] = {"non_private": s["non_private"],
                        "user_clipped_noiseless": s["user_clipped_noiseless"],
                        "dp_user": interval(s["dp_user"]), "dp_sample": interval(s["dp_sample"])}
        print(cand, json.dumps({k: v if not isinstance(v, dict) else v["mean"]
                                for k, v in table1[cand].items()}), flush=True)

    e_collab, e_wiki = proj.apply(embed(collab)), proj.apply(embed(wiki))
    fig2 = {y: {"non_private": [], "dp_user": [], "dp_sample": []} for y in YS}
    for t in range(args.trials):
        rng = random.Random(f"fig2/{t}")
        for y in YS:
            n_c = round(args.mix_size * y / 100)
            idx_c = rng.sample(range(len(e_collab)), min(n_c, len(e_collab)))
            idx_w = rng.sample(range(len(e_wiki)), args.mix_size - len(idx_c))
            s = scores(np.vstack([e_collab[idx_c], e_wiki[idx_w]]), t)
            for key in fig2[y]:
                fig2[y][key].append(s[key] if key == "non_private" else s[key][0])
    summary = {}
    for key in ("non_private", "dp_user", "dp_sample"):
        per_trial = np.array([[fig2[y][key][t] for y in YS] for t in range(args.trials)])
        means = per_trial.mean(axis=0)
        diff = per_trial[:, YS.index(99)] - per_trial[:, YS.index(100)]
        summary[key] = {
            "by_y": {y: interval(per_trial[:, i]) for i, y in enumerate(YS)},
            "mean_strictly_decreasing": bool(np.all(np.diff(means) < 0)),
            "trials_strictly_decreasing": int(sum(np.all(np.diff(row) < 0) for row in per_trial)),
            "spearman_per_trial": [float(scipy.stats.spearmanr(YS, row)[0]) for row in per_trial],
            "diff_99_minus_100": interval(diff),
            "paper_criterion_max100_below_min99": bool(per_trial[:, YS.index(100)].max()
                                                      < per_trial[:, YS.index(99)].min()),
        }
    result = {
        "setting": {"embedder": embedder.name, "pca_dim": args.pca_dim, "clip": clip,
                    "pca_records_per_source": args.pca_records,
                    "cohort": args.cohort, "cohort_texts": int(sum(counts)),
                    "max_samples": args.max_samples, "epsilon": args.epsilon, "delta": args.delta,
                    "z_mean": z1, "z_cov": z2, "records_per_candidate": args.records,
                    "mix_size": args.mix_size, "collab_pool": len(collab), "wiki_pool": len(wiki),
                    "trials": args.trials, "noise_seeds": "user t, sample 1000 + t",
                    "noise_std_mean_user": releases["user"][0].noise_std_mean,
                    "noise_std_cov_diag_user": releases["user"][0].noise_std_cov_diag,
                    "sample_level_count": releases["sample"][0].cohort},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg": os.getloadavg(), "seconds": time.perf_counter() - t_start},
        "table1": table1, "fig2": summary,
    }
    name = args.embedder.replace(":", "_")
    (HERE / f"fred_quality_{name}.json").write_text(json.dumps(result, indent=2, default=float))
    plot(summary, HERE / f"fred_fig2_{name}.png", result["setting"])
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "by_y"} for k, v in summary.items()},
                     indent=1, default=float))


def plot(summary: dict, out: Path, setting: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("non_private", "non-private FD"), ("dp_user", "DP FreD, user level"),
                       ("dp_sample", "DP FreD, sample level")):
        by_y = summary[key]["by_y"]
        ax.errorbar(YS, [by_y[y]["mean"] for y in YS], yerr=[by_y[y]["ci95"] or 0 for y in YS],
                    marker="o", ms=3, capsize=2, label=label)
    ax.set_xlabel("Y: % co-written Shakespeare plays (rest WikiText-2)")
    ax.set_ylabel("FreD to shakespeare-solo")
    ax.set_title(f"{setting['embedder']}, PCA d = {setting['pca_dim']}, (0.6, 2e-6)-DP, "
                 f"K = {setting['cohort']}, 95% CI over {setting['trials']} trials", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
