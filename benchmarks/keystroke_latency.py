"""Per-keystroke suggestion latency on CPU: the window program vs the streaming step program.

A keyboard scores the next word after every keystroke. With the window program (`infer.onnx`) a
keystroke recomputes a fixed seq_len window and returns seq_len x V logits; with the step program
(`step.onnx`, recurrent models) it feeds the new token into the carried state and returns V logits.
Completing a word runs k candidates for a few more pieces (the reference client's `suggest`):
one window batch of k per piece, or one step batch of k per piece from the kept states.

For Gboard's CIFG shape (vocab 10k, embedding 96, hidden 670, projection 96), untied and tied,
with random weights (latency does not depend on them), the programs as the bundle ships them
(weights as `p.<name>` inputs): median / p90 of
* `call`: one program run, window [1, seq_len] vs step [1];
* `keystroke`: one new context token + a k = 3 completion of 3 more pieces, as the client does it;
* `baked_*_call`: the same single runs with the weights baked into the programs (what weight
  inputs cost).
For a transformer at Gboard's vocabulary (`transformer_10k`) the step is the KV-cache step of
`export/kv_step.py` (a cache of seq_len slots), timed the same way.
Both programs are timed round-robin in one process so machine load hits each alike; the JSON
records cpu_count, ORT threads and the load average.

    python benchmarks/keystroke_latency.py [--repeats 200] [--threads 1]
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

from dpfleet.edge.ort_session import load_session
from dpfleet.edge.tokenizer import BOS, PAD
from dpfleet.export.kv_step import empty_cache, kv_step_program
from dpfleet.export.models import ModelConfig, build_model, count_parameters
from dpfleet.export.phone import onnx_program, window_program_with_weight_inputs
from dpfleet.export.streaming import initial_state, step_program
from dpfleet.export.training import onnx_param_name

RESULTS = Path(__file__).parent / "results" / "keystroke_latency.json"
# a small causal transformer at Gboard's vocabulary (2 layers, 96 wide, 4 heads)
TRANSFORMER = ModelConfig(arch="transformer", embedding_dim=96, hidden_dim=384, num_layers=2, num_heads=4)


def stats(times: list[float]) -> dict:
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90))}


def run_window(session, ids: list[list[int]], seq_len: int, weights: dict) -> np.ndarray:
    windows = np.full((len(ids), seq_len), PAD, dtype=np.int64)
    last = []
    for i, p in enumerate(ids):
        p = [BOS, *p[-(seq_len - 1):]]
        windows[i, : len(p)] = p
        last.append(len(p) - 1)
    return session.run(None, {"tokens": windows, **weights})[0][np.arange(len(ids)), last]


def round_robin(fns: dict, repeats: int) -> dict:
    """Median / p90 ms of each function, timed in turn so machine load hits each alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(5):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: stats(ts) for name, ts in times.items()}


def measure_transformer(cfg: ModelConfig, seq_len: int, repeats: int, threads: int, k: int,
                        pieces: int) -> dict:
    """Transformer: the window program vs the KV-cache step (`export/kv_step.py`), both with
    weight inputs; a keystroke is one step at the newest position, then k candidates x pieces
    steps from copies of the cache."""
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        window_program_with_weight_inputs(model, seq_len, Path(tmp) / "infer.onnx")
        kv_step_program(model, seq_len, Path(tmp) / "kv_step.onnx")
        sizes = {name: (Path(tmp) / name).stat().st_size for name in ("infer.onnx", "kv_step.onnx")}
        window, step = (load_session((Path(tmp) / name).read_bytes(), name, threads) for name in sizes)
    weights = {onnx_param_name(n): p.detach().numpy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    context = rng.integers(4, cfg.vocab_size, seq_len - 1 - pieces).tolist()
    keys, values = empty_cache(cfg, seq_len)
    for position, t in enumerate([BOS, *context[:-1]]):  # the cache before the newest token
        _, keys, values = step.run(None, {"token": np.array([t]), "position": np.array(position),
                                          "keys": keys, "values": values, **weights})
    newest = len(context)
    cand = rng.integers(4, cfg.vocab_size, (k, pieces)).tolist()

    def run_step(tokens, position, kk, vv):
        return step.run(None, {"token": np.array(tokens), "position": np.array(position), "keys": kk,
                               "values": vv, **weights})

    def window_keystroke():
        run_window(window, [context], seq_len, weights)
        for j in range(pieces):
            run_window(window, [context + row[: j + 1] for row in cand], seq_len, weights)

    def step_keystroke():
        _, kk, vv = run_step([context[-1]], newest, keys, values)
        kk, vv = np.repeat(kk, k, axis=1), np.repeat(vv, k, axis=1)
        for j in range(pieces):
            _, kk, vv = run_step([row[j] for row in cand], newest + 1 + j, kk, vv)

    fns = {"window_call": lambda: run_window(window, [context], seq_len, weights),
           "step_call": lambda: run_step([context[-1]], newest, keys, values),
           "window_keystroke": window_keystroke, "step_keystroke": step_keystroke}
    out = round_robin(fns, repeats)
    ratio = {kind: out[f"window_{kind}"]["median_ms"] / out[f"step_{kind}"]["median_ms"]
             for kind in ("call", "keystroke")}
    return {"config": cfg.to_dict(), "parameters": count_parameters(model), "program_bytes": sizes,
            "step": "KV cache of seq_len slots", **out, "window_over_step_median": ratio,
            "program_runs_per_keystroke": {"window": 1 + pieces, "step": 1 + pieces}}


def measure(cfg: ModelConfig, seq_len: int, repeats: int, threads: int, k: int, pieces: int) -> dict:
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        window_program_with_weight_inputs(model, seq_len, Path(tmp) / "infer.onnx")
        step_program(model, Path(tmp) / "step.onnx")
        onnx_program(model, seq_len, None, Path(tmp) / "infer_baked.onnx")
        step_program(model, Path(tmp) / "step_baked.onnx", weight_inputs=False)
        names = ("infer.onnx", "step.onnx", "infer_baked.onnx", "step_baked.onnx")
        sizes = {name: (Path(tmp) / name).stat().st_size for name in names}
        window, step, window_baked, step_baked = (
            load_session((Path(tmp) / name).read_bytes(), name, threads) for name in names)
    weights = {onnx_param_name(n): p.detach().numpy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    context = rng.integers(4, cfg.vocab_size, seq_len - 1 - pieces).tolist()
    h, c = initial_state(cfg, 1)
    for t in [BOS, *context[:-1]]:  # the state before the newest context token
        _, h, c = step.run(None, {"token": np.array([t]), "state_h": h, "state_c": c, **weights})
    cand = rng.integers(4, cfg.vocab_size, (k, pieces)).tolist()

    def window_call():
        run_window(window, [context], seq_len, weights)

    def step_call():
        step.run(None, {"token": np.array([context[-1]]), "state_h": h, "state_c": c, **weights})

    def baked_window_call():
        run_window(window_baked, [context], seq_len, {})

    def baked_step_call():
        step_baked.run(None, {"token": np.array([context[-1]]), "state_h": h, "state_c": c})

    def window_keystroke():
        run_window(window, [context], seq_len, weights)
        for j in range(pieces):
            run_window(window, [context + row[: j + 1] for row in cand], seq_len, weights)

    def step_keystroke():
        _, hh, cc = step.run(None, {"token": np.array([context[-1]]), "state_h": h, "state_c": c,
                                    **weights})
        hh, cc = np.repeat(hh, k, axis=1), np.repeat(cc, k, axis=1)
        for j in range(pieces):
            _, hh, cc = step.run(None, {"token": np.array([row[j] for row in cand]), "state_h": hh,
                                        "state_c": cc, **weights})

    fns = {"window_call": window_call, "step_call": step_call,
           "window_keystroke": window_keystroke, "step_keystroke": step_keystroke,
           "baked_window_call": baked_window_call, "baked_step_call": baked_step_call}
    out = round_robin(fns, repeats)
    ratio = {kind: out[f"window_{kind}"]["median_ms"] / out[f"step_{kind}"]["median_ms"]
             for kind in ("call", "keystroke")}
    return {"config": cfg.to_dict(), "parameters": count_parameters(model), "program_bytes": sizes,
            **out, "window_over_step_median": ratio,
            "program_runs_per_keystroke": {"window": 1 + pieces, "step": 1 + pieces}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = {
        name: measure(ModelConfig(tie_embeddings=tied), args.seq_len, args.repeats, args.threads, k=3,
                      pieces=3)
        for name, tied in (("gboard_cifg", False), ("gboard_cifg_tied", True))
    }
    results["transformer_10k"] = measure_transformer(TRANSFORMER, args.seq_len, args.repeats, args.threads,
                                                     k=3, pieces=3)
    import onnxruntime

    record = {
        "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "ort_threads": args.threads,
                 "torch_threads": torch.get_num_threads(), "loadavg_before": load_before,
                 "loadavg_after": os.getloadavg(), "onnxruntime": onnxruntime.__version__},
        "seq_len": args.seq_len, "repeats": args.repeats, "k": 3, "completion_pieces": 3,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for name, r in results.items():
        print(f"{name} ({r['parameters']:,} params): call window {r['window_call']['median_ms']:.3f} ms vs "
              f"step {r['step_call']['median_ms']:.3f} ms ({r['window_over_step_median']['call']:.1f}x); "
              f"keystroke window {r['window_keystroke']['median_ms']:.3f} ms vs step "
              f"{r['step_keystroke']['median_ms']:.3f} ms "
              f"({r['window_over_step_median']['keystroke']:.1f}x)"
              + (f"; baked window {r['baked_window_call']['median_ms']:.3f} ms, step "
                 f"{r['baked_step_call']['median_ms']:.3f} ms" if "baked_step_call" in r else ""))


if __name__ == "__main__":
    main()
