"""Paper 000 Fig. 1 analogue: the teacher's public SentencePiece vocabulary vs private word-level
vocabularies, under DP, with no public training.

Word vocabularies are the top-1024 and top-4096 words of the *private* training clients (what a
deployment without a public tokenizer does; a real one would even need a DP vocabulary count).
The SentencePiece vocabulary is Gemma-3-270M's trimmed to 4096 pieces on WikiText-2 (the one
every row of public_training.py uses). Settings are public_training.py's `none` row: the tuned
DP settings of the main job on `shakespeare-solo`, T = 50 rounds of 20 clients.

As in paper 000 Sec. 3.1, word accuracy is converted into next-*token* accuracy so it can be
compared with the SentencePiece model: each target word weighs as many tokens as the
SentencePiece tokenizer splits it into (" word" in running text, punctuation alone), and all of
them count as right when the word is predicted. "strict" counts an OOV target as wrong, "w/ OOV"
counts predicting <unk> for an OOV target as right (what a word model's raw accuracy rewards).
All numbers are on every held-out row.

    python benchmarks/quality/vocabulary.py --seeds 0 1 2 --noise 0.3 0.7 --momentum 0.9 0.5
    python benchmarks/quality/vocabulary.py --summarize   # vocabulary.md from vocabulary.json

Writes vocabulary.json / .md / .png next to this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from grid import add_grid_args, private_simulation
from paired import format_difference, paired_difference

HERE = Path(__file__).parent
KINDS = {"word-1024": ("word", 1024), "word-4096": ("word", 4096),
         "sentencepiece-4096": ("sentencepiece", 4096)}


def config(args, kind: str, noise: float, seed: int, spm_path: str) -> dict:
    tok_kind, size = KINDS[kind]
    values = private_simulation(args, noise, seed, eval_every=args.rounds, eval_examples=0)
    values["tokenizer"] = {"kind": tok_kind, "vocab_size": size,
                           "path": spm_path if tok_kind == "sentencepiece" else ""}
    if tok_kind == "word":  # the paper's baseline: top words of the private clients, no DP
        values["tokenizer"]["allow_nonprivate_vocabulary"] = True
    return values


def pieces_per_word(words: list[str], spm_tokenizer) -> np.ndarray:
    """SentencePiece tokens of each word as it appears in running text."""
    counts = [len(spm_tokenizer.encode(" " + w if w[:1].isalnum() else w)) for w in words]
    return np.maximum(np.array(counts, dtype=np.int64), 1)


def word_token_accuracy(cfg, run_dir: Path, spm_tokenizer, top_word: int) -> dict:
    """Paper 000's conversion of a word model's held-out accuracy into token units (and of the
    unigram baseline's, which always predicts `top_word`)."""
    import torch

    from dpfleet.coordinator.engine.simulation import prepare_data
    from dpfleet.edge.client_data import build_federated
    from dpfleet.edge.datasets import load_records
    from dpfleet.edge.tokenizer import PAD, UNK, WordTokenizer
    from dpfleet.export.checkpoint import load_checkpoint

    _, model, small = load_checkpoint(run_dir / "checkpoint")
    records = load_records(cfg.data.dataset, "train")
    # a word tokenizer with every word of the dataset has no OOV: its rows are the held-out rows
    # the simulation scored, with the words themselves still known
    full = WordTokenizer.build((r.text for r in records), 1 << 30)
    rows_full = build_federated(records, full, seq_len=cfg.data.seq_len, max_examples=cfg.data.max_examples,
                                test_fraction=cfg.data.test_fraction, seed=cfg.seed,
                                max_clients=cfg.data.max_clients or None).test_examples()
    index = {w: i for i, w in enumerate(small.words)}
    lookup = np.array([index.get(w, UNK) for w in full.words], dtype=np.int64)
    lookup[:4] = np.arange(4)  # pad, bos, eos, unk are the same ids in both
    rows = lookup[rows_full]
    _, data = prepare_data(cfg)
    if not np.array_equal(rows, data.test_examples()):
        raise RuntimeError("the word rows do not reproduce the simulation's held-out rows")
    weights = pieces_per_word(full.words, spm_tokenizer)
    weights[:4] = 0
    with torch.no_grad():
        preds = np.concatenate([model(torch.from_numpy(rows[s : s + 256, :-1])).argmax(-1).numpy()
                                for s in range(0, len(rows), 256)])
    targets, w = rows[:, 1:], weights[rows_full[:, 1:]]
    right = preds == targets
    scored = targets != PAD
    return {"strict": float((w * (right & (targets != UNK))).sum() / w.sum()),
            "with_oov": float((w * right).sum() / w.sum()),
            "unigram_token": float((w * (targets == top_word)).sum() / w.sum()),
            "oov_rate": float((targets == UNK).sum() / scored.sum()),
            "tokens_per_word": float(w.sum() / scored.sum())}


def plot(results: list[dict], args, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("word-1024", "strict"), ("word-1024", "with_oov"), ("word-4096", "strict"),
            ("word-4096", "with_oov"), ("sentencepiece-4096", "strict")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(bars)
    for j, (kind, col) in enumerate(bars):
        means, stds = [], []
        for noise in args.noise:
            vals = [r[col] * 100 for r in results if r["tokenizer"] == kind and r["noise"] == noise]
            means.append(np.mean(vals))
            stds.append(np.std(vals))
        label = kind if kind.startswith("sentencepiece") else \
            f"{kind} ({'w/ OOV' if col == 'with_oov' else 'strict'})"
        ax.bar(np.arange(len(args.noise)) + (j - (len(bars) - 1) / 2) * width, means, width, yerr=stds,
               capsize=3, label=label)
    unigram = np.mean([r["unigram_token"] for r in results]) * 100
    ax.axhline(unigram, color="grey", linestyle="--", linewidth=1,
               label=f"unigram baseline (~{unigram:.1f}%)")
    eps = {r["noise"]: r["epsilon"] for r in results}
    ax.set_xticks(range(len(args.noise)), [f"z = {z:g} (eps = {eps[z]:.1f})" for z in args.noise])
    ax.set_ylabel("next-token accuracy (%), token units")
    ax.set_title("Fig. 1 analogue: public SentencePiece vs private word vocabularies under DP",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


PAIRS = [("sentencepiece-4096", "word-4096"), ("sentencepiece-4096", "word-1024"),
         ("word-4096", "word-1024")]


def write_markdown(results: list[dict], args) -> None:
    """vocabulary.md: mean ± sample sd per cell, and paired differences with 95% t-intervals."""
    lines = ["| tokenizer | noise z | eps | token acc. strict (%) | token acc. w/ OOV (%) | "
             "unigram, token units (%) | own-unit acc. (%) | OOV rate (%) |",
             "|---|---|---|---|---|---|---|---|"]
    for noise in args.noise:
        for kind in KINDS:
            rows = [r for r in results if r["tokenizer"] == kind and r["noise"] == noise]

            def cell(key, rows=rows):
                v = np.array([r[key] for r in rows]) * 100
                return f"{v.mean():.2f}" + (f" ± {v.std(ddof=1):.2f}" if len(v) > 1 else "")

            lines.append(f"| {kind} | {noise} | {rows[0]['epsilon']:.2f} | {cell('strict')} | "
                         f"{cell('with_oov')} | {cell('unigram_token')} | "
                         f"{cell('accuracy_own_units')} | {cell('oov_rate')} |")
    lines += ["", "| strict token accuracy: row - compared with | noise z | mean difference "
              "[95% t-interval] (points), seeds up / down |", "|---|---|---|"]
    for noise in args.noise:
        for a, b in PAIRS:
            acc = {(r["tokenizer"], r["seed"]): r["strict"] * 100 for r in results
                   if r["noise"] == noise}
            seeds = sorted(s for k, s in acc if k == a and (b, s) in acc)
            diff = paired_difference([acc[a, s] for s in seeds], [acc[b, s] for s in seeds])
            lines.append(f"| {a} - {b} | {noise} | {format_difference(diff)} |")
    table = "\n".join(lines) + "\n"
    (HERE / "vocabulary.md").write_text(
        "# Public SentencePiece vs private word vocabularies under DP (paper 000 Fig. 1 analogue)\n\n"
        f"T = {args.rounds} rounds of {args.report_goal} clients on shakespeare-solo, no public "
        f"training, seeds {args.seeds} (mean ± sample sd; paired differences by seed). Token "
        "units: a word weighs its SentencePiece tokens (paper 000 Sec. 3.1). The word "
        "vocabularies are the top words of the private training clients without DP "
        "(tokenizer.allow_nonprivate_vocabulary), outside the guarantee. Plot: vocabulary.png.\n\n"
        + table)
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_args(ap)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dpfleet-quality-vocab-tuned"))
    ap.add_argument("--summarize", action="store_true",
                    help="only rewrite vocabulary.md from vocabulary.json")
    args = ap.parse_args()
    if args.summarize:
        payload = json.loads((HERE / "vocabulary.json").read_text())
        write_markdown(payload["results"], argparse.Namespace(**payload["settings"]))
        return

    import torch

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine.simulation import run_simulation
    from dpfleet.public.pipeline import parse_pipeline, teacher_vocab

    torch.set_num_threads(1)
    spm = teacher_vocab(parse_pipeline({"public": {"vocab_size": 4096}}), print).tokenizer
    results = []
    for noise in args.noise:
        for seed in args.seeds:
            for kind in KINDS:
                cfg = parse_config(config(args, kind, noise, seed, str(spm.model_file.parent)))
                out = args.work / f"{kind}-z{noise}-s{seed}"
                if (out / "summary.json").is_file():  # finished earlier
                    summary = json.loads((out / "summary.json").read_text())
                    final, baseline = summary["final"], summary["unigram_baseline"]
                    eps = json.loads((out / "privacy.json").read_text())["epsilon"]
                    seconds = summary["wall_seconds"]
                else:
                    res = run_simulation(cfg, out, overwrite=True, progress=False, log=lambda _: None)
                    final, baseline, eps = res.final, res.baseline, res.privacy["epsilon"]
                    seconds = json.loads((out / "summary.json").read_text())["wall_seconds"]
                row = {"tokenizer": kind, "noise": noise, "seed": seed, "epsilon": eps,
                       "accuracy_own_units": final["accuracy"], "unigram_own_units": baseline["accuracy"]}
                if kind.startswith("word"):
                    row.update(word_token_accuracy(cfg, out, spm, baseline["top_token"]))
                else:
                    row.update(strict=final["accuracy"], with_oov=final["accuracy"], oov_rate=0.0,
                               unigram_token=baseline["accuracy"])
                row["simulation_seconds"] = seconds
                results.append(row)
                print(json.dumps(row), flush=True)
    (HERE / "vocabulary.json").write_text(json.dumps(
        {"settings": vars(args) | {"work": str(args.work)}, "results": results}, indent=2))
    write_markdown(results, args)
    plot(results, args, HERE / "vocabulary.png")


if __name__ == "__main__":
    main()
