"""Phone bundle sizes: every file of `dpfleet export --bundle` at the main job's and Gboard's size.

Random weights (sizes do not depend on them), a word vocabulary of the model's size, fp32, ONNX
training program (dynamic batch) + window + step programs. Saves benchmarks/results/bundle_sizes.json.

    python benchmarks/bundle_sizes.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.export.bundle import BundleExport
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import ModelConfig, build_model, count_parameters

RESULTS = Path(__file__).parent / "results" / "bundle_sizes.json"
SHAPES = {
    "main_job_cifg": ModelConfig(vocab_size=4096, embedding_dim=96, hidden_dim=256, projection_dim=96),
    "gboard_cifg": ModelConfig(),
    "gboard_cifg_tied": ModelConfig(tie_embeddings=True),
}


def main() -> None:
    torch.set_num_threads(1)
    out = {"host": {"cpu_count": os.cpu_count(), "torch_threads": 1, "loadavg": os.getloadavg()},
           "seq_len": 20, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in SHAPES.items():
            torch.manual_seed(0)
            model = build_model(cfg)
            tok = WordTokenizer([f"w{i}" for i in range(cfg.vocab_size - 4)])
            save_checkpoint(Path(tmp) / name / "ckpt", model, cfg, tok)
            start = time.perf_counter()
            summary = BundleExport(Path(tmp) / name / "ckpt", Path(tmp) / name / "bundle", seq_len=20,
                                   batch_size=16).run()
            out["results"][name] = {"parameters": count_parameters(model), "files": summary["files"],
                                    "total_bytes": summary["total_bytes"],
                                    "export_seconds_with_cache": round(time.perf_counter() - start, 1)}
            print(name, f"{count_parameters(model):,} params", f"{summary['total_bytes'] / 1e6:.2f} MB",
                  {k: round(v / 1e6, 2) for k, v in summary["files"].items() if v > 1e5})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
