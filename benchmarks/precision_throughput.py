"""Local training and the teacher at each precision this CPU does natively: float32, bfloat16.

Why: the cohort trainer sits near the float32 GEMM floor on the larger models, and a CPU with
AMX-BF16 or AVX512-BF16 multiplies bfloat16 at 2x or more the float32 rate. For each precision
the CPU supports (`dpfleet.edge.precision`: bfloat16 only with native BF16), this records

* steps/s (local SGD steps of all clients over wall seconds) of the cohort trainer and of the
  plain PyTorch loop over `nn.LSTM` (trainer_throughput.py's `NnLstmTrainer`; at bfloat16 under
  autocast), same torch threads, on the main job's CIFG (examples/shakespeare_cifg.toml)
  and on the Gboard-size CIFG (`[model] preset = "gboard_cifg"`, word vocabulary of
  `--gboard-vocab` words); the cohort's ratio to the plain float32 loop, from the two medians and
  again round by round, alternating, in one process (`cohort_over_plain_float32_paired`, the
  median of `--pairs` pairs' ratios, and `_ci95` the geometric mean's 95% interval: what a
  machine whose speed drifts still measures fairly).
  The cohort at bfloat16 is the hand-written LSTM's own bfloat16 path (bfloat16 GEMMs from
  weight copies cast once per local step; the elementwise work in the fused C kernels where they
  built, `bfloat16_elementwise` says; float32 weights; not autocast); at bfloat16 it is also
  timed against the cohort at float32 the same way (`cohort_bfloat16_over_float32_paired`);
* the cohort's achieved GFLOP/s (model FLOPs: 6 x the GEMM weights a token passes x real target
  tokens, padding not counted) against this CPU's square GEMM rate at the same precision;
* the teacher's tokens/s (body, and body + float32 head) on a random-weight Llama (`--teacher`:
  a packaged name or a Hugging Face folder instead);
* what "auto" resolves to for each workload (`edge.precision`: the CPU and the model's size,
  `AUTO_BF16_MIN_PARAMS`), and with `--profile` where a Gboard-size cohort round spends its time
  (fractions per part of `edge/cohort_lstm.py`: recurrence forward, output layer, recurrence
  backward, local derivatives, other), with the share of the round in GEMMs and the rate of the
  GEMMs alone at the shapes the kernel gives them (`gemm_only_gflop_s`: an upper bound on the
  achieved rate of any schedule of those GEMMs).

    python benchmarks/precision_throughput.py [--threads 1,2] [--clients 20] [--reps 3] [--pairs 5]
        [--profile] [--precisions bfloat16] [--workloads gboard]

Goals on a CPU with BF16: the Gboard-size cohort >= 3x the plain float32 loop, and >= 60% of
the bfloat16 GEMM rate. Saves results/precision_throughput.json with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cohort_roofline import _median_ms  # noqa: E402
from host_info import host  # noqa: E402
from trainer_throughput import PEER, NnLstmTrainer, build_workload  # noqa: E402

from dpfleet.edge.cohort import CohortTrainer  # noqa: E402
from dpfleet.edge.minibatch import batches  # noqa: E402
from dpfleet.edge.native_cell import cell  # noqa: E402
from dpfleet.edge.precision import AUTO_BF16_MIN_PARAMS, native_bf16, resolve_precision  # noqa: E402
from dpfleet.edge.tokenizer import PAD  # noqa: E402
from dpfleet.export.models import build_model  # noqa: E402
from dpfleet.export.params import get_flat  # noqa: E402
from dpfleet.public.teacher import load_teacher  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def workload_configs(gboard_vocab: int) -> dict[str, dict]:
    main = tomllib.loads((ROOT / "examples" / "shakespeare_cifg.toml").read_text())
    main.pop("pretrain", None)  # the trainer's speed, not the public model
    gboard = {**PEER, "model": {"preset": "gboard_cifg"},
              "tokenizer": {"kind": "word", "vocab_size": gboard_vocab, "allow_nonprivate_vocabulary": True}}
    return {"main": main, "gboard": gboard}


def model_flops_per_token(m) -> int:
    """6 x (gate, projection and output weights a token passes): forward 2, backward 4."""
    gates = (3 if m.arch == "cifg" else 4) * m.hidden_dim
    per_layer = gates * (m.embedding_dim + m.projection_dim) + m.hidden_dim * m.projection_dim
    return 6 * (m.num_layers * per_layer + m.projection_dim * m.vocab_size)


def gemm_gflop_s(dtype: torch.dtype, size: int, reps: int) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    c = torch.empty(size, size, dtype=dtype)
    return round(2 * size**3 / _median_s(lambda: torch.mm(a, b, out=c), reps) / 1e9, 1)


def _median_s(fn, reps: int) -> float:
    """Median wall seconds of `fn` over `reps` calls after a warm-up (cohort_roofline's timer)."""
    return _median_ms(fn, reps) / 1000


def measure_training(raw: dict, precision: str, clients: int, reps: int, pairs: int = 5) -> dict:
    cfg, model_cfg, data = build_workload(raw)
    bs = cfg.client.batch_size
    eligible = [c.examples for c in data.train if len(c.examples) >= bs]
    rng = np.random.default_rng(0)
    chosen = [eligible[i] for i in rng.choice(len(eligible), min(clients, len(eligible)), replace=False)]
    seeds = list(range(len(chosen)))
    steps = sum(len(batches(len(x), bs, s)) for x, s in zip(chosen, seeds, strict=True))
    tokens = sum(int((x[:, 1:] != PAD).sum()) for x in chosen)
    theta = get_flat(build_model(model_cfg))
    args = dict(lr=cfg.client.lr, batch_size=bs, clip_norm=1e6)
    cohort = CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=bs, device="cpu",
                           precision=precision)
    plain = NnLstmTrainer(model_cfg)
    chosen_p = resolve_precision(precision)
    seconds = {
        "cohort": _median_s(lambda: cohort.train_round(theta, chosen, seeds, **args), reps),
        "plain_float32": _median_s(lambda: plain.train_round(theta, chosen, seeds, **args), reps),
    }
    # the goal's ratio again, alternating round by round (the two medians above are minutes apart,
    # and this machine's speed drifts 10-25% in that time)
    paired = _paired_ratio(lambda: plain.train_round(theta, chosen, seeds, **args),
                           lambda: cohort.train_round(theta, chosen, seeds, **args), pairs,
                           "cohort_over_plain_float32_paired")
    if chosen_p.name == "bfloat16":
        with chosen_p.autocast():
            seconds["plain_bfloat16"] = _median_s(
                lambda: plain.train_round(theta, chosen, seeds, **args), reps)
        f32 = CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=bs, device="cpu",
                            precision="float32")
        paired |= _paired_ratio(lambda: f32.train_round(theta, chosen, seeds, **args),
                                lambda: cohort.train_round(theta, chosen, seeds, **args), max(reps, 3),
                                "cohort_bfloat16_over_float32_paired")
    flops = model_flops_per_token(model_cfg) * tokens
    m = model_cfg
    return {
        "model": f"{m.arch} {m.embedding_dim}/{m.hidden_dim}/{m.projection_dim}, vocab {m.vocab_size}, "
                 f"{sum(p.numel() for p in build_model(m).parameters()):,} parameters",
        "auto": resolve_precision("auto", params=len(theta)).reason,
        "clients": len(chosen), "local_steps": steps, "real_tokens": tokens, "chunk": cohort.chunk,
        "steps_per_s": {k: round(steps / s, 1) for k, s in seconds.items()},
        "cohort_over_plain_float32": round(seconds["plain_float32"] / seconds["cohort"], 2),
        "cohort_achieved_gflop_s": round(flops / seconds["cohort"] / 1e9, 2),
        **paired,
    }


# (with the C kernels the bfloat16 backward makes its local derivatives inside its step: 0 here)
PARTS = ("_layer_forward", "_output_layer", "_layer_backward", "_local_derivatives")


def profile_parts(raw: dict, precision: str, clients: int) -> dict:
    """Where one round of the cohort's hand-written LSTM step spends its time: wall seconds inside
    each part of `cohort_lstm` (the recurrence forward, the output layer with its softmax and
    gradient, the recurrence backward without its local derivatives, those) as fractions of the
    round, the rest (packing rows, the embedding update, Python) as "other". In this process
    (`processes=False`), timed by wrapping the parts: cheap next to the torch profiler."""
    from dpfleet.edge import cohort_lstm

    cfg, model_cfg, data = build_workload(raw)
    bs = cfg.client.batch_size
    chosen = [c.examples for c in data.train if len(c.examples) >= bs][:clients]
    theta = get_flat(build_model(model_cfg))
    trainer = CohortTrainer(model_cfg, seq_len=cfg.data.seq_len, batch_size=bs, device="cpu",
                            precision=precision, processes=False)
    seconds = dict.fromkeys(PARTS, 0.0)
    originals = {name: getattr(cohort_lstm, name) for name in PARTS}

    def timed(name):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0
        return run

    def one_round():
        trainer.train_round(theta, chosen, list(range(len(chosen))), lr=cfg.client.lr, batch_size=bs,
                            clip_norm=1e6)

    one_round()  # warm-up, untimed
    try:
        for name in PARTS:
            setattr(cohort_lstm, name, timed(name))
        t0 = time.perf_counter()
        one_round()
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(cohort_lstm, name, fn)
    seconds["_layer_backward"] -= seconds["_local_derivatives"]  # called inside it
    shares = {name.strip("_"): round(sec / total, 3) for name, sec in seconds.items()}
    flops = model_flops_per_token(model_cfg) * sum(int((x[:, 1:] != PAD).sum()) for x in chosen)
    return {"round_s": round(total, 2), **shares, "other": round(1 - sum(shares.values()), 3),
            **gemm_bound(one_round, flops)}


GEMMS = ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm")


def gemm_bound(one_round, flops: int) -> dict:
    """The round's GEMMs alone, at the shapes the kernel gives them (torch profiler, self time of
    the GEMM ops; in-place variants included): their share of the round and the model FLOPs over
    their seconds. No schedule of the same GEMMs runs faster than this rate, so it bounds the
    achieved rate from above: the part of the gap to the square GEMM rate the shapes explain."""
    from torch.profiler import profile

    with profile() as prof:
        t0 = time.perf_counter()
        one_round()
        total = time.perf_counter() - t0
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages()
               if e.key.rstrip("_") in GEMMS) / 1e6
    if not gemm:  # the chunks ran on other threads, which this profiler does not see
        return {"gemm_share_profiled": None, "gemm_only_gflop_s": None}
    return {"gemm_share_profiled": round(gemm / total, 3), "gemm_only_gflop_s": round(flops / gemm / 1e9, 1)}


def _paired_ratio(slow, fast, reps: int, key: str) -> dict:
    """{key: the median over `reps` pairs of seconds(slow) / seconds(fast), key + "_ci95": the
    geometric mean's 95% interval (t, sample sd of the log ratios), key + "_pairs": reps}. The two
    alternate which runs first (after one warm-up each): load that comes and goes hits both sides
    of a pair alike."""
    slow(), fast()
    ratios = []
    for i in range(reps):
        order = (slow, fast) if i % 2 == 0 else (fast, slow)
        seconds = {}
        for fn in order:
            t0 = time.perf_counter()
            fn()
            seconds[fn] = time.perf_counter() - t0
        ratios.append(seconds[slow] / seconds[fast])
    logs = np.log(ratios)
    half = stats.t.ppf(0.975, reps - 1) * logs.std(ddof=1) / np.sqrt(reps)
    return {key: round(float(np.median(ratios)), 2),
            f"{key}_ci95": [round(float(np.exp(logs.mean() + d)), 2) for d in (-half, half)],
            f"{key}_pairs": reps}


def synthetic_teacher(folder: Path, hidden: int, layers: int, vocab: int) -> str:
    """A random-weight Llama (speed only) saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=512,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def measure_teacher(spec: str, precision: str, batch: int, seq_len: int, reps: int) -> dict:
    teacher = load_teacher(spec, device="cpu", precision=precision)
    ids = torch.randint(4, teacher.vocab_size, (batch, seq_len))
    mask = torch.ones_like(ids)
    body = _median_s(lambda: teacher.body(ids, mask), reps)
    both = _median_s(lambda: teacher.head(teacher.body(ids, mask)), reps)
    return {"precision": teacher.precision.name, "body_tokens_per_s": round(ids.numel() / body, 1),
            "body_and_head_tokens_per_s": round(ids.numel() / both, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=5,
                    help="alternating rounds timed for the goal's paired ratio (with its 95%% interval)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--workloads", default="main,gboard")
    ap.add_argument("--gboard-vocab", type=int, default=10000)
    ap.add_argument("--gemm-size", type=int, default=1024)
    ap.add_argument("--precisions", default="",
                    help="comma-separated subset of the precisions this CPU supports (default all: "
                         "float32 and, with native BF16, bfloat16; the goal's ratio is bfloat16's)")
    ap.add_argument("--teacher", default="", help="packaged name or HF folder (default: random Llama)")
    ap.add_argument("--teacher-hidden", type=int, default=640)
    ap.add_argument("--teacher-layers", type=int, default=6)
    ap.add_argument("--teacher-tokens", type=int, default=1024, help="tokens per body pass (x 128 long)")
    ap.add_argument("--profile", action="store_true",
                    help="also record where a Gboard-size cohort round spends its time, per part (1 thread)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "precision_throughput.json")
    args = ap.parse_args()
    precisions = ["float32"] + (["bfloat16"] if native_bf16() else [])
    if args.precisions:
        asked = args.precisions.split(",")
        if unknown := [p for p in asked if p not in precisions]:
            raise SystemExit(f"--precisions: {', '.join(unknown)} not supported on this CPU ({precisions})")
        precisions = [p for p in precisions if p in asked]
    threads_list = [int(t) for t in args.threads.split(",")]
    configs = workload_configs(args.gboard_vocab)
    result = {"host_start": host(threads_list[0]), "native_bf16": native_bf16(),
              "bfloat16_elementwise": cell().reason,
              "auto": resolve_precision("auto").reason, "auto_min_params": AUTO_BF16_MIN_PARAMS,
              "by_torch_threads": {}}
    if not native_bf16():
        result["note"] = ("no native BF16 here: float32 only. On an Intel Xeon with AMX-BF16 (results/"
                          "precision_throughput_gboard_1thread_s20*.json) the Gboard-size cohort at "
                          "bfloat16 ran 3.04x and 3.09x the plain float32 loop (1 thread, 30 and 40 "
                          "pairs) and its square bfloat16 GEMM 836-1,020 GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.teacher or synthetic_teacher(Path(tmp), args.teacher_hidden, args.teacher_layers, 32000)
        for threads in threads_list:
            torch.set_num_threads(threads)
            entry = {}
            for precision in precisions:
                dtype = resolve_precision(precision).dtype
                entry[precision] = {"gemm_gflop_s": gemm_gflop_s(dtype, args.gemm_size, args.reps)}
                for name in args.workloads.split(","):
                    one = measure_training(configs[name], precision, args.clients, args.reps, args.pairs)
                    one["cohort_of_gemm_rate"] = round(one["cohort_achieved_gflop_s"]
                                                       / entry[precision]["gemm_gflop_s"], 3)
                    entry[precision][name] = one
                if args.profile and threads == 1:  # with 2+ the chunks' parts overlap in time
                    entry[precision]["gboard_step_profile"] = profile_parts(
                        configs["gboard"], precision, args.clients)
                rows = max(1, args.teacher_tokens // 128)
                entry[precision]["teacher"] = measure_teacher(spec, precision, rows, 128, args.reps)
                print(json.dumps({threads: {precision: entry[precision]}}, indent=1), flush=True)
            result["by_torch_threads"][str(threads)] = entry
    result["teacher"] = args.teacher or (f"random-weight Llama hidden {args.teacher_hidden}, "
                                         f"{args.teacher_layers} layers, vocab 32,000")
    result["host_end"] = host(threads_list[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
