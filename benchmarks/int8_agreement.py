"""int8 phone exports vs eager on the held-out real text of a trained checkpoint.

Takes a `dpfleet simulate` run directory (its checkpoint/ and config.toml), rebuilds the run's
split of whole users, samples `--lines` lines of the HELD-OUT users (never trained on), and exports
the checkpoint's window program as ONNX int8 (x86 `reduce_range` and ARM full range) and `.pte`
int8 (XNNPACK dynamic int8 matmuls, with the fp32 embedding table and with the int8 one), each
with `--accept-int8-drop` so the number is recorded even where `export` would refuse it. Reports
top-1 / top-3 agreement with eager over the real (non-PAD) positions, a 95% interval over lines
(each line a cluster: mean of its positions' agreement, sample sd), paired per-line differences
between variants (same lines) with their 95% intervals, file sizes, and the fp32 references.
Saves benchmarks/results/int8_agreement.json.

    dpfleet simulate examples/shakespeare_cifg.toml --rounds 40 --out /tmp/run
    python benchmarks/int8_agreement.py /tmp/run [--lines 400] [--seed 0] [--formats onnx pte]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.config import load_config
from dpfleet.edge.client_data import group_by_user, split_users
from dpfleet.edge.datasets import load_records
from dpfleet.export.checkpoint import load_checkpoint
from dpfleet.export.phone import InferenceProgram, PhoneExport, text_windows

RESULTS = Path(__file__).parent / "results" / "int8_agreement.json"


def heldout_lines(run: Path, n: int, seed: int) -> tuple[list[str], int]:
    """`n` lines of the run's held-out users (its own seed and test_fraction)."""
    cfg = load_config(run / "config.toml")
    path = Path(cfg.data.path) if cfg.data.path else None
    by_user = group_by_user(load_records(cfg.data.dataset, "train", path))
    _, test_users = split_users(list(by_user), cfg.data.test_fraction, cfg.seed)
    lines = [t for u in test_users for t in by_user[u] if t.strip()]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(lines), min(n, len(lines)), replace=False)
    return [lines[i].strip().replace("\n", " ") for i in np.sort(pick)], len(test_users)


def per_line_interval(model, program_path: Path, fmt: str, tokenizer, lines: list[str], seq_len: int) -> dict:
    """Top-1 agreement per line (mean over its positions) -> mean and 95% normal interval."""
    rows, lengths = text_windows(tokenizer, lines, seq_len)
    with torch.no_grad():
        ref = model(torch.from_numpy(rows)).numpy()
    got = InferenceProgram(program_path, fmt, 1)(rows)
    valid = np.arange(seq_len)[None, :] < lengths[:, None]
    same = (got.argmax(-1) == ref.argmax(-1)) & valid
    per_line = same.sum(1) / valid.sum(1)
    return {**mean_ci(per_line, "line_mean_top1"), "lines": len(per_line), "per_line": per_line}


def mean_ci(values: np.ndarray, key: str) -> dict:
    """Mean and 95% normal interval (sample sd) over lines."""
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
    return {key: float(values.mean()), "ci95": [float(values.mean() - half), float(values.mean() + half)]}


PAIRS = (("onnx_int8_arm", "onnx_int8_x86"), ("pte_int8", "pte_int8_fp32_table"),
         ("pte_int8", "onnx_int8_x86"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a dpfleet simulate run directory")
    ap.add_argument("--lines", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0, help="which held-out lines are sampled")
    ap.add_argument("--seq-len", type=int, default=20)
    ap.add_argument("--formats", nargs="+", default=["onnx", "pte"], choices=["onnx", "pte"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.run / "config.toml")
    lines, n_users = heldout_lines(args.run, args.lines, args.seed)
    _, model, tokenizer = load_checkpoint(args.run / "checkpoint")
    summary_path = args.run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    out = {"host": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg_start": os.getloadavg()},
           "run": {"dir": str(args.run), "train_seed": cfg.seed, "rounds": cfg.rounds,
                   "dataset": cfg.data.dataset, "architecture": model.cfg.to_dict(),
                   "final_accuracy": summary.get("final", {}).get("accuracy"),
                   "unigram_accuracy": summary.get("unigram_baseline", {}).get("accuracy")},
           "heldout": {"users": n_users, "lines": len(lines), "line_seed": args.seed},
           "seq_len": args.seq_len, "results": {}}
    variants = []  # name, format, quantize, target, int8 embedding table (pte)
    for fmt in args.formats:
        variants.append((f"{fmt}_fp32", fmt, None, "x86", False))
        if fmt == "onnx":
            variants += [("onnx_int8_x86", "onnx", "int8", "x86", False),
                         ("onnx_int8_arm", "onnx", "int8", "arm", False)]
        else:
            variants += [("pte_int8_fp32_table", "pte", "int8", "x86", False),
                         ("pte_int8", "pte", "int8", "x86", True)]
    with tempfile.TemporaryDirectory() as tmp:
        heldout = Path(tmp) / "heldout.txt"
        heldout.write_text("\n".join(lines))
        for name, fmt, quantize, target, int8_table in variants:
            start = time.perf_counter()
            folder = Path(tmp) / name
            result = PhoneExport(args.run / "checkpoint", fmt, folder, quantize, args.seq_len, 1, heldout,
                                 target, accept_int8_drop=True, pte_int8_embedding=int8_table).run()
            program = folder / ("model.pte" if fmt == "pte" else "model.onnx")
            out["results"][name] = {
                **result["agreement"],
                **per_line_interval(model, program, fmt, tokenizer, lines, args.seq_len),
                "program_bytes": program.stat().st_size, "int8_check": result["int8_check"],
                "seconds": round(time.perf_counter() - start, 1)}
            r = out["results"][name]
            print(f"{name:14s} top1 {r['top1']:.4f} top3 {r['top3']:.4f} max|err| {r['max_abs_err']:.3g} "
                  f"positions {r['positions']} bytes {r['program_bytes']:,}", flush=True)
    per_line = {name: r.pop("per_line") for name, r in out["results"].items()}
    out["paired_top1_differences"] = {  # same lines, so per-line differences pair up
        f"{a} - {b}": mean_ci(per_line[a] - per_line[b], "mean") for a, b in PAIRS
        if a in per_line and b in per_line}
    for pair, d in out["paired_top1_differences"].items():
        print(f"{pair}: {d['mean']:+.4f} (95% CI {d['ci95'][0]:+.4f} .. {d['ci95'][1]:+.4f})")
    out["host"]["loadavg_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
