"""Gboard's CIFG from its signed phone bundle: suggestion latency per keystroke on one thread.

`[model] preset = "gboard_cifg"` (96 / 670 / 96, tied, 1,422,638 parameters) over a 10,004-token
word vocabulary (TFF StackOverflow's size: 10,000 words + 1 OOV bucket + PAD / BOS / EOS), random
weights (latency does not depend on them), exported by `BundleExport` to a signed bundle and run
by the reference device client (`BundleClient`, ONNX Runtime, 1 thread), the way a phone would:
* `keystroke`: `suggest(prefix, k=3)` after every character of a typed message (the streaming step
  program carries the state; a completion runs k candidates a few pieces further);
* `step_call` / `window_call`: one next-word step from a carried state vs one window program run.
The suggestion programs are ONNX; the bundle's ExecuTorch program is the training one
(tests/test_gboard_bundle.py checks both against eager). Records the CPU (model name, AVX-512
BF16 / AMX / VNNI), threads and the load average before and after.

    python benchmarks/gboard_bundle_latency.py [--messages 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from host_info import host  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.tokenizer import BOS, WordTokenizer
from dpfleet.export.bundle import BundleExport
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.models import ModelConfig, build_model, with_preset

RESULTS = Path(__file__).parent / "results" / "gboard_bundle_latency.json"
COMMON = ["the", "a", "to", "of", "and", "in", "is", "it", "you", "that", "for", "i", "on", "with", "this",
          "how", "can", "do", "my", "not", "be", "are", "what"]


def stats(ms: list[float]) -> dict:
    return {"median_ms": round(float(np.median(ms)), 3), "p90_ms": round(float(np.percentile(ms, 90)), 3),
            "n": len(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20, help="typed messages (one suggest per keystroke)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = host(threads=1)
    tok = WordTokenizer(COMMON + [f"w{i}" for i in range(10_000 - len(COMMON))], split="tff")
    cfg = ModelConfig(**with_preset({"preset": "gboard_cifg", "vocab_size": tok.vocab_size}))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ckpt", build_model(cfg), cfg, tok)
        t0 = time.perf_counter()
        summary = BundleExport(Path(tmp) / "ckpt", Path(tmp) / "bundle", seq_len=20, batch_size=16).run()
        export_s = time.perf_counter() - t0
        client = BundleClient(Path(tmp) / "bundle", summary["public_key"], threads=1)
        rng = np.random.default_rng(0)
        messages = [" ".join(rng.choice(COMMON, size=8)) for _ in range(args.messages)]
        keystroke, step, window = [], [], []
        for text in messages:
            for i in range(1, len(text) + 1):
                t1 = time.perf_counter()
                client.suggest(text[:i], k=3)
                keystroke.append(1000 * (time.perf_counter() - t1))
            ids = tok.encode(text)
            state = client.initial_state()
            for t, token in enumerate([BOS, *ids]):
                t1 = time.perf_counter()
                _, state = client.step([token], state)
                step.append(1000 * (time.perf_counter() - t1))
                t1 = time.perf_counter()
                client.next_logits([ids[:t]])
                window.append(1000 * (time.perf_counter() - t1))
        out = {
            "what": "Gboard's CIFG (preset gboard_cifg) from its signed bundle, reference device client, "
                    "ONNX Runtime on 1 thread; random weights",
            "host_before": before, "host_after": host(threads=1),
            "parameters": client.weights().size, "vocab_size": tok.vocab_size,
            "bundle_bytes": summary["files"], "export_seconds": round(export_s, 1),
            "keystroke": stats(keystroke), "step_call": stats(step), "window_call": stats(window),
            "bundle_measured": summary["measured"],
        }
    text = json.dumps(out, indent=2, default=int)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
