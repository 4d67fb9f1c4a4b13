"""Per-step training latency on CPU: eager torch vs the exported ExecuTorch and ORT programs.

One step = forward + masked loss + backward + SGD update on a [batch, seq_len] minibatch, as a
device runs it in `train_epoch`. For each zoo model: median step time of eager (1 and 2
threads), ExecuTorch (.pte + XNNPACK) and ONNX Runtime (1 and 2 threads), the time to set a
round's weights, export times and program sizes. Target: exported <= eager at equal threads.

    python benchmarks/edge_step.py            # main-job sizes, all three architectures
    python benchmarks/edge_step.py --gboard   # plus Gboard's CIFG (vocab 10k, hidden 670)
    python benchmarks/edge_step.py --gboard --profile-steps 10   # plus ETDump per-op profiles

Where the .pte falls short of eager, and why (ETDump op profiles, results/edge_step.json):
* What remains outside XNNPACK runs in ExecuTorch's portable (scalar) kernels: the bias and
  LayerNorm gradient reductions (`sum.IntList_out`, 5-9% of a step in the last run), the embedding gradient
  (`index_put`/`scatter_add`), `where`, and the transformer's LayerNorm. The worst one, the
  [batch, length, vocab] `log_softmax` (22% of a Gboard step), is gone: the program's loss is
  logsumexp - target logit (export/training.py).
* Trainable weights are not static, so each XNNPACK fully-connected call re-packs its weights
  and the backward transposes them (`Transpose (ND)`, 8-14%); eager's MKL/oneDNN GEMMs read them
  in place.
* The recurrent loop is unrolled into ~30 small delegate partitions, each with call overhead.
Timings on a 2-core machine shared with other jobs are noisy (+-20% between runs); the runtimes
are timed round-robin so that load hits each alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

# Runtimes are timed round-robin; threads that spin-wait after a run (OpenMP's default) would
# steal the next runtime's cores, so every pool here sleeps when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import platform
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.minibatch import fixed_shape_batches
from dpfleet.edge.pte_module import set_threads
from dpfleet.edge.runtime_executorch import PteTrainingProgram
from dpfleet.edge.runtime_onnx import OnnxTrainingProgram
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig, build_model, count_parameters, next_token_loss
from dpfleet.export.params import ParamLayout, get_flat
from dpfleet.export.training import ProgramSpec, training_program

RESULTS = Path(__file__).parent / "results" / "edge_step.json"
SMALL = dict(vocab_size=4096, embedding_dim=96, hidden_dim=256, projection_dim=96, num_heads=4)
GBOARD = ModelConfig(arch="cifg", vocab_size=10_000, embedding_dim=96, hidden_dim=670, projection_dim=96)


def minibatch(cfg: ModelConfig, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """One realistic minibatch: rows of 6..seq_len+1 tokens, PAD tails."""
    rng = np.random.default_rng(0)
    rows = rng.integers(4, cfg.vocab_size, (batch, seq_len + 1))
    for i, keep in enumerate(rng.integers(6, seq_len + 2, batch)):
        rows[i, keep:] = PAD
    ((x, y),) = fixed_shape_batches(rows, batch, 0, seq_len, pad_rows=True)
    return x, y


def interleaved_ms(steps: dict[str, object], repeats: int) -> dict[str, float]:
    """Median ms per step of each callable, run round-robin so that load from other processes
    on a shared machine hits every runtime alike."""
    for fn in steps.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts) * 1e3) for name, ts in times.items()}


def pte_op_profile(program, layout: ParamLayout, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                   steps: int, top: int = 12) -> dict:
    """Per-op time inside the `.pte` training step from ExecuTorch's own profiler (ETDump, read
    with `executorch.devtools.Inspector`): ms per step of each operator (portable kernels by name,
    XNNPACK delegate calls as `DELEGATE_CALL` plus the delegate's own events), summed over events
    of the same name, largest first. The program is loaded a second time with ETDump on."""
    from executorch.devtools import Inspector
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    pte = PteTrainingProgram(program, layout)
    pte._pte.module = _load_for_executorch_from_buffer(pte._pte.buffer, enable_etdump=True)
    pte.set_flat(flat)
    for _ in range(steps):
        pte.step(x, y, 0.01)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.etdp"
        pte._pte.module.write_etdump_result_to_file(str(path))
        inspector = Inspector(etdump_path=str(path))
    totals: dict[str, float] = {}
    for block in inspector.event_blocks:
        for event in block.events:
            if event.perf_data is not None:
                name = re.sub(r" #\d+$", "", event.name)  # XNNPACK numbers its operator instances
                totals[name] = totals.get(name, 0.0) + float(np.sum(event.perf_data.raw))
    runs = steps + 1  # the all-PAD run of set_flat is profiled too
    step = totals.get("Method::execute", 0.0)
    wrappers = {"Method::execute", "Program::load_method", "Method::init", "DELEGATE_CALL", "OPERATOR_CALL"}
    ops = sorted(((n, t) for n, t in totals.items() if n not in wrappers), key=lambda kv: -kv[1])

    def label(name: str) -> str:
        portable = name.startswith("native_call_")
        return f"portable:{name[len('native_call_'):]}" if portable else f"xnnpack:{name}"

    return {"steps_profiled": runs, "execute_ms_per_step": round(step / runs, 2),
            "xnnpack_calls_ms_per_step": round(totals.get("DELEGATE_CALL", 0.0) / runs, 2),
            "portable_calls_ms_per_step": round(totals.get("OPERATOR_CALL", 0.0) / runs, 2),
            "top_ops": [{"op": label(n), "ms_per_step": round(t / runs, 3),
                         "share_of_step": round(t / step, 3)} for n, t in ops[:top]]}


def bench_model(cfg: ModelConfig, batch: int, seq_len: int, repeats: int, cache: Path,
                profile_steps: int = 0) -> dict:
    x, y = minibatch(cfg, batch, seq_len)
    model = build_model(cfg)
    layout = ParamLayout.of(model)
    flat = get_flat(model)
    row = {
        "arch": cfg.arch,
        "config": cfg.to_dict(),
        "params": count_parameters(model),
        "batch": batch,
        "seq_len": seq_len,
    }
    programs = {}
    for fmt, prog_batch in (("pte", batch), ("onnx", None)):
        start = time.perf_counter()
        programs[fmt] = training_program(ProgramSpec(cfg, seq_len, prog_batch, fmt), cache)
        row[f"{fmt}_export_s"] = round(time.perf_counter() - start, 1)
        row[f"{fmt}_bytes"] = programs[fmt].path.stat().st_size

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def eager_step():
        loss = next_token_loss(model(xt), yt, PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    views = layout.split(flat.copy())
    pte = None
    for threads in (1, 2):
        torch.set_num_threads(threads)
        pte = None  # ExecuTorch's threadpool may only be resized with no program loaded
        gc.collect()
        set_threads(threads)
        pte = PteTrainingProgram(programs["pte"], layout)
        pte.set_flat(flat)
        ort = OnnxTrainingProgram(programs["onnx"], layout, threads)
        ms = interleaved_ms(
            {
                "eager": eager_step,
                "pte": lambda p=pte: p.step(x, y, 0.01),
                "onnx": lambda o=ort: o.step(views, x, y, 0.01),
            },
            repeats,
        )
        for name, value in ms.items():
            row[f"{name}_ms_{threads}t"] = round(value, 2)
        for fmt in ("pte", "onnx"):
            row[f"{fmt}_vs_eager_{threads}t"] = round(ms[fmt] / ms["eager"], 2)
    row["pte_set_weights_ms"] = round(interleaved_ms({"set": lambda: pte.set_flat(flat)}, 20)["set"], 3)
    if profile_steps:
        pte = None  # one loaded program at a time: the threadpool goes back to 1 thread
        gc.collect()
        set_threads(1)
        row["pte_profile_1t"] = pte_op_profile(programs["pte"], layout, flat, x, y, profile_steps)
    torch.set_num_threads(1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gboard", action="store_true", help="add Gboard's CIFG as a row")
    parser.add_argument("--archs", default="cifg,lstm,transformer")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="also profile this many .pte steps per model with ETDump (per-op ms)")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="program cache (default: a fresh one, so export times are measured)",
    )
    args = parser.parse_args()
    configs = [ModelConfig(arch=a, **SMALL) for a in args.archs.split(",")]
    if args.gboard:
        configs.append(GBOARD)
    rows = []
    tmp = tempfile.TemporaryDirectory()
    cache = args.cache or Path(tmp.name)
    for cfg in configs:
        row = bench_model(cfg, args.batch, args.seq_len, args.repeats, cache, args.profile_steps)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "torch_threads_timed": [1, 2],
        },
        "versions": {"torch": torch.__version__},
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
