"""What a fleet device's update costs through the run's signed bundle vs dpfleet's own trainer.

With `[fleet] client = "bundle"` every emulated device trains with `BundleClient` (ONNX Runtime,
weights fed as inputs, SGD on the host in numpy) instead of dpfleet's runtime. This times one
device update (set weights, one local epoch, clip) through: dpfleet's eager runtime, dpfleet's
ONNX runtime, and the bundle client, round-robin in one process so machine load hits each alike,
and checks the bundle's clipped delta against eager's. A CIFG (default: the main job's shape,
vocabulary 4096), random token rows (time does not depend on the values), 1 thread. The JSON
records cpu_count, torch threads and the load average.

    python benchmarks/fleet_bundle_train.py [--repeats 15] [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.client_update import client_update
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.runtimes import make_runtime
from dpfleet.edge.tokenizer import BOS, WordTokenizer
from dpfleet.export.bundle import BundleExport
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import ModelConfig, build_model, count_parameters
from dpfleet.export.params import get_flat
from dpfleet.export.training import default_program_cache

OUT = Path(__file__).parent / "results" / "fleet_bundle_train.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(arch="cifg", vocab_size=args.vocab, embedding_dim=96, hidden_dim=256,
                      projection_dim=96)
    torch.manual_seed(0)
    model = build_model(cfg)
    words = [f"w{i}" for i in range(args.vocab)]
    tok = WordTokenizer.build([" ".join(words)], args.vocab)
    lr, clip = 0.5, 0.3
    rng = np.random.default_rng(0)
    rows = rng.integers(4, args.vocab, (args.rows, args.seq_len + 1), dtype=np.int64)
    rows[:, 0] = BOS
    theta = get_flat(model).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "checkpoint"
        save_checkpoint(ckpt, model, cfg, tok)
        (Path(tmp) / "config.json").write_text(json.dumps({
            "client": {"lr": lr, "batch_size": args.batch}, "dp": {"clip_norm": clip},
            "data": {"seq_len": args.seq_len, "max_examples": args.rows}}))
        began = time.perf_counter()
        summary = BundleExport(ckpt, Path(tmp) / "bundle", seq_len=args.seq_len,
                               batch_size=args.batch).run()
        export_s = time.perf_counter() - began
        client = BundleClient(Path(tmp) / "bundle", summary["public_key"])
        cache = default_program_cache()
        runtimes = {name: make_runtime(name, cfg, args.seq_len, 1, cache) for name in ("eager", "onnx")}

        def dpfleet(name):
            return lambda: client_update(runtimes[name], theta, rows, lr=lr, batch_size=args.batch,
                                         clip_norm=clip, seed=3).delta

        def bundle():
            return client.clip(client.train_epoch(theta, rows, seed=3), clip)[0]

        paths = {"dpfleet_eager": dpfleet("eager"), "dpfleet_onnx": dpfleet("onnx"), "bundle": bundle}
        out = {name: fn() for name, fn in paths.items()}  # warm-up (sessions, first runs)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ref = out["dpfleet_eager"]
    med = {name: float(np.median(v)) for name, v in times.items()}
    result = {
        "model": {**cfg.to_dict(), "parameters": count_parameters(model)},
        "rows": args.rows, "seq_len": args.seq_len, "batch_size": args.batch, "repeats": args.repeats,
        "bundle_export_s": round(export_s, 2),
        "update_median_s": {k: round(v, 4) for k, v in med.items()},
        "update_p90_s": {k: round(float(np.percentile(v, 90)), 4) for k, v in times.items()},
        "ratio_bundle_vs": {k: round(med["bundle"] / med[k], 3) for k in ("dpfleet_eager", "dpfleet_onnx")},
        "bundle_vs_eager_max_abs": float(np.abs(out["bundle"] - ref).max()),
        "eager_delta_max_abs": float(np.abs(ref).max()),
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(), "ort_threads": 1,
                 "loadavg": [round(x, 2) for x in os.getloadavg()]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
