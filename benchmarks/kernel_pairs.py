"""The recurrent cohort kernel of this tree against the one at another commit, round-robin in one
process: what a machine whose speed drifts 10-25% within minutes still measures fairly.

Both `edge/cohort_lstm.py` files (the other read with `git show REV:edge/cohort_lstm.py`, with
that commit's C kernels, `edge/native_cell.py` and `edge/lstm_cell.c`, where it has them) train
the same k clients of one chunk, from the same weights, one local step each in turn (the order
reversed every other round), on the Gboard-size CIFG (or the main job's with `--main`). Prints
and saves each file's median ms per step and this tree's time over the other's: the geometric
mean of the paired ratios with a 95% interval (2 standard errors of the log ratios, sample sd),
and the largest weight difference after the run (0 where the kernels compute the same bits).

    python benchmarks/kernel_pairs.py --base 2126368 --dtype bfloat16 --reps 100
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_info import host  # noqa: E402

from dpfleet.edge.native_cell import cell  # noqa: E402
from dpfleet.edge.tokenizer import PAD  # noqa: E402
from dpfleet.export.models import PRESETS, ModelConfig, build_model  # noqa: E402
from dpfleet.heap import keep_freed_memory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "edge/cohort_lstm.py"
NATIVE = ("edge/native_cell.py", "edge/lstm_cell.c")  # the C kernels, since 6da8352's parent


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before it runs: a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _show(rev: str, path: str) -> str | None:
    out = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _base_kernel(rev: str, tmp: Path):
    """The commit's `cohort_lstm` module, importing that commit's C kernels (built from its own
    `lstm_cell.c`) where it has them, not this tree's."""
    source = _show(rev, KERNEL)
    if source is None:
        raise SystemExit(f"{rev} has no {KERNEL}")
    native = [_show(rev, path) for path in NATIVE]
    if all(text is not None for text in native):
        for path, text in zip(NATIVE, native, strict=True):
            (tmp / Path(path).name.replace("native_cell", "base_native_cell")).write_text(text)
        _module(tmp / "base_native_cell.py", "base_native_cell")
        source = source.replace("from dpfleet.edge.native_cell import", "from base_native_cell import")
    (tmp / "base_kernel.py").write_text(source)
    return _module(tmp / "base_kernel.py", "base_kernel")


def _workload(main: bool, k: int) -> tuple[ModelConfig, dict, torch.Tensor]:
    shape = dict(arch="cifg", embedding_dim=32, hidden_dim=64, projection_dim=32, num_layers=1,
                 tie_embeddings=True) if main else dict(PRESETS["gboard_cifg"])
    cfg = ModelConfig(vocab_size=1024 if main else 10004, **shape)
    params = {n: p.detach().unsqueeze(0).repeat(k, *[1] * p.dim()).contiguous()
              for n, p in build_model(cfg).named_parameters()}
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(4, cfg.vocab_size, (k, 16, 21), generator=g)
    lens = torch.randint(3, 22, (k, 16), generator=g)
    rows[torch.arange(21).view(1, 1, 21) >= lens.unsqueeze(-1)] = PAD
    return cfg, params, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit whose kernel this tree's is timed against")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--clients", type=int, default=6, help="clients in the chunk (the Gboard size's chunk)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--main", action="store_true", help="the main job's CIFG instead of the Gboard size")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_pairs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    tmp = tempfile.TemporaryDirectory()  # the base's C source is read when its kernel first runs
    kernels = {"base": _base_kernel(args.base, Path(tmp.name)), "this": _module(ROOT / KERNEL, "this_kernel")}
    cfg, params0, rows = _workload(args.main, args.clients)
    params = {name: {n: p.clone() for n, p in params0.items()} for name in kernels}
    for _ in range(2):
        for name, mod in kernels.items():
            mod.recurrent_grads(cfg, params[name], rows, lr=0.01, dtype=dtype)
    seconds = {name: [] for name in kernels}
    for r in range(args.reps):
        for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
            t0 = time.perf_counter()
            kernels[name].recurrent_grads(cfg, params[name], rows, lr=0.01, dtype=dtype)
            seconds[name].append(time.perf_counter() - t0)
    logs = [math.log(b / a) for a, b in zip(seconds["base"], seconds["this"], strict=True)]
    mean, half = statistics.mean(logs), 2.0 * statistics.stdev(logs) / math.sqrt(len(logs))
    result = {
        "host": host(args.threads), "base": args.base, "dtype": args.dtype, "reps": args.reps,
        "model": "main job's CIFG" if args.main else "Gboard-size CIFG", "clients": args.clients,
        "elementwise": cell().reason if dtype == torch.bfloat16 else "torch ops (float32)",
        "median_ms": {name: round(statistics.median(s) * 1e3, 1) for name, s in seconds.items()},
        "this_over_base": round(math.exp(mean), 3),
        "ci95": [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)],
        "max_weight_diff": max(float((params["this"][n] - params["base"][n]).abs().max()) for n in params0),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
