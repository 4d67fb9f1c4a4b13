"""Distillation-corpus throughput: the teacher's top-k extraction in tokens/s and bytes/token.

Builds the trimmed teacher vocabulary on WikiText-2 train (the main job's 1,024 pieces; timed),
cuts the King James Bible (the main job's public corpus) into `--seq-len`-token rows and stores
the teacher's top-k for `--sequences` of them with the real job (`public.topk.build_corpus`),
once per LM head in `--heads`: the int8 screen (public/teacher_screen.py) and the float32 head.
It records each head's tokens/s and achieved GFLOP/s, this CPU's GEMM speed at the teacher's
own shapes (float32 body and head, int8 head) with the roofline tokens/s they allow, and how the
int8 labels agree with the float32 ones (top-1, top-k sets, KL of the stored top-k
distributions). Default teacher: the packaged Gemma 3 270M on whatever device `load_teacher`
picks (cuda when present: the float32/TF32 head only). Saves results/public_topk.json.

`--scaling` instead measures how the teacher's memory and speed scale with the batch size (the
tokens one loader batch hands over): teacher tokens/s and peak memory of top-k extraction
(teacher- and student-space targets) and of l_pub scoring at several `--batch-sizes`, the body
in micro-batches of `--body-tokens` and the head in `--chunk-tokens` chunks
(public/teacher_head.py), and in one pass per batch with one head chunk (the old behaviour:
full [tokens x vocab] logits; `--one-shot-max` caps the batch sizes it is tried at, and a
point that runs out of memory is recorded as such). Each point runs in a fresh process; CPU
peak memory is the resident set sampled every 2 ms above the level after loading and a
warm-up, plus tracemalloc's peak of Python/numpy allocations; on CUDA it is
`torch.cuda.max_memory_allocated` above the allocated level after the warm-up (and in total).
Without `--teacher`, on CPU, the model is a random-weight Llama (hidden 256, 4 layers) over a
real SentencePiece vocabulary of `--teacher-vocab` pieces trained on WikiText-2 (speed and
memory only: random weights make meaningless labels). Saves results/public_topk_scaling.json.

`--device cuda` runs the sweep on the GPU with the packaged Gemma 3 270M, which must be staged
(docs/offline_gpu_server.md): GPU defaults are batches of 4,096..65,536 tokens, 262,144 tokens
per point, 128-token sequences, the body pass sized from free memory; it records the machine
and saves results/public_topk_scaling_cuda.json. Unattended: nothing is asked, a missing
teacher or dataset is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import torch

from dpfleet.edge.datasets import load_records
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.public.teacher import PACKAGED, load_teacher, resolve_teacher
from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm
from dpfleet.public.topk import TopKCorpus, TopKExtractor, build_corpus, student_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--vocab-size", type=int, default=1024, help="the main job's")
    parser.add_argument("--sequences", type=int, default=600,
                        help="KJV rows labelled by each head (600: ~10,000 positions)")
    parser.add_argument("--dataset", default="kjv", help="the text labelled")
    parser.add_argument("--heads", default="int8,float32",
                        help="LM heads to run (public/teacher_screen.py); both: the agreement")
    parser.add_argument("--seq-len", type=int, default=None, help="default 20 CPU, 128 CUDA")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--scaling", action="store_true", help="memory/speed vs batch size")
    parser.add_argument("--batch-sizes", default=None,
                        help="default 512..16384 on CPU, 4096..65536 on CUDA")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default 512 CPU, 2048 CUDA")
    parser.add_argument("--body-tokens", type=int, default=None,
                        help="tokens per body pass; default 512 on CPU, 0 (free memory) on CUDA")
    parser.add_argument("--one-shot-max", type=int, default=None,
                        help="largest batch for the one-pass comparison; default 16384 CPU, "
                             "16384 CUDA")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per measured point; default 16384 CPU, 262144 CUDA")
    parser.add_argument("--teacher-vocab", type=int, default=16_384)
    parser.add_argument("--modes", default="topk,topk-student,lpub",
                        help="what the sweep measures; a subset is saved under its own name")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; default 2 for labelling, 1 for --scaling")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: one measurement as JSON
    args = parser.parse_args()
    if args.threads is None:
        args.threads = 1 if args.scaling else 2
    if args.point:
        print(json.dumps(_point(**json.loads(args.point))))
        return
    if args.scaling or (args.device or "").startswith("cuda"):
        _scaling(args)
        return

    _labelling(args)


def _labelling(args) -> None:
    """Label `--sequences` KJV rows with each head; record speed, agreement and the roofline."""
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    teacher = load_teacher(args.teacher, args.device)
    load_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        vocab = build_teacher_vocab(
            load_teacher_spm(teacher.path),
            [r.text for r in load_records("wikitext2", "train")],
            args.vocab_size, Path(tmp) / "tok", args.teacher,
        )
        vocab_s = time.perf_counter() - start
        texts = [r.text for r in load_records(args.dataset, "train")]
        sequences = student_sequences(texts, vocab.tokenizer, args.seq_len or 20)
        sequences = [s for s in sequences if len(s) >= 4][: args.sequences]
        runs = {}
        for head in args.heads.split(","):
            extractor = TopKExtractor(teacher, vocab, args.k, head=head)
            manifest = build_corpus(extractor, sequences, Path(tmp) / f"corpus-{head}",
                                    batch_tokens=args.batch_tokens)
            runs[extractor.head_mode] = (manifest, TopKCorpus(Path(tmp) / f"corpus-{head}"))
    tokens = runs[next(iter(runs))][0]["tokens"]
    flops = teacher_flops(teacher.model.config, args.seq_len or 20)
    roof = gemm_roofline(teacher, args.threads)
    result = {
        **_machine(str(teacher.device)),
        "cpu_model": _cpu_model(), "cpu_int8_bf16_flags": _cpu_flags(),
        "teacher": args.teacher, "torch_threads": torch.get_num_threads(),
        "load_1min_before": os.getloadavg()[0],
        "k": args.k, "vocab_size": vocab.meta["vocab_size"],
        "teacher_vocab_size": vocab.meta["teacher_vocab_size"],
        "dataset": args.dataset, "sequences": len(sequences), "tokens": tokens,
        "flops_per_token": flops,
        "heads": {mode: {"tokens_per_s": round(m["tokens_per_s"], 1),
                         "achieved_gflop_s": round(m["tokens_per_s"] * flops["total"] / 1e9, 1),
                         "bytes_per_token": round(m["bytes_per_token"], 2)}
                  for mode, (m, _) in runs.items()},
        "gemm": roof,
        "roofline_tokens_per_s": {
            "float32": round(1e9 / (flops["total"] / roof["float32_head_gflop_s"]), 1),
            "int8_head": round(1e9 / (flops["body"] / roof["float32_body_gflop_s"]
                                      + flops["head"] / roof["int8_head_gop_s"]), 1),
        },
        "teacher_load_s": round(load_s, 2), "vocab_build_s": round(vocab_s, 2),
    }
    if {"int8", "float32"} <= runs.keys():
        result["agreement"] = label_agreement(runs["float32"][1], runs["int8"][1])
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "public_topk.json").write_text(json.dumps(result, indent=2) + "\n")


def _cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def _cpu_flags() -> list[str]:
    """The int8 / bf16 instructions the CPU reports (what decides the screen's speed)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("flags")), []))
    return sorted(f for f in flags if "vnni" in f or "bf16" in f or f.startswith("amx"))


def teacher_flops(config, seq_len: int) -> dict:
    """Multiply-adds x 2 per token: the body's projections and MLP, its attention over a
    `seq_len` context (half of it on average, causal), and the LM head."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    d, inner, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", d // cfg.num_attention_heads)
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    projections = d * (2 * q + 2 * kv) + 3 * d * inner
    attention = 2 * cfg.num_attention_heads * head_dim * seq_len / 2
    body = 2 * layers * (projections + attention)
    head = 2 * d * cfg.vocab_size
    return {"body": body, "head": head, "total": body + head}


def gemm_roofline(teacher, threads: int) -> dict:
    """This CPU's GEMM speed at the teacher's own shapes: float32 for the body's MLP and the head,
    int8 (oneDNN u8s8; its output dtype by CPU) for the head as the screen runs it."""
    from dpfleet.edge.precision import native_bf16
    from dpfleet.public.teacher_screen import SCREEN_CHUNK_TOKENS, Int8Screen

    torch.set_num_threads(threads)
    cfg = getattr(teacher.model.config, "get_text_config", lambda: teacher.model.config)()
    d, inner, vocab = cfg.hidden_size, cfg.intermediate_size, teacher.vocab_size

    def rate(fn, ops: float) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return ops / best / 1e9

    x = torch.randn(1024, d)
    w_mlp = torch.randn(inner, d)
    rows = torch.randn(SCREEN_CHUNK_TOKENS, d)
    w = teacher.head_weight
    screen = Int8Screen(w)
    return {
        "float32_body_gflop_s": round(rate(lambda: x @ w_mlp.T, 2 * 1024 * d * inner), 1),
        "float32_head_gflop_s": round(rate(lambda: rows @ w.T, 2 * len(rows) * d * vocab), 1),
        "int8_head_gop_s": round(rate(lambda: screen.approximate(rows),
                                      2 * len(rows) * d * vocab), 1),
        "native_bf16": native_bf16(),  # None: bfloat16 is emulated here, slower than float32
        "shapes": {"body_mlp": [1024, d, inner], "head": [len(rows), d, vocab]},
    }


def label_agreement(reference, fast) -> dict:
    """How the int8-screened labels compare with the float32 head's on the same positions: top-1
    id equal, the stored top-k sets equal, and KL(float32 || int8) of the softmax over the stored
    top-k (the distribution L_KD trains on; an id missing from one side has probability 0 there)."""
    import numpy as np

    ids_r, ids_f = reference.topk_ids, fast.topk_ids
    log_r = torch.log_softmax(torch.from_numpy(reference.topk_logits).double(), -1).numpy()
    log_f = torch.log_softmax(torch.from_numpy(fast.topk_logits).double(), -1).numpy()
    kl = np.zeros(len(ids_r))
    for j in range(ids_r.shape[1]):
        p = np.exp(log_r[:, j])
        match = ids_f == ids_r[:, j : j + 1]
        q_log = np.where(match.any(1), (np.where(match, log_f, 0.0)).sum(1), -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            kl += np.where(p > 0, p * (log_r[:, j] - q_log), 0.0)
    same_sets = (np.sort(ids_r, 1) == np.sort(ids_f, 1)).all(1)
    return {"positions": int(len(ids_r)),
            "top1_equal": float((ids_r[:, 0] == ids_f[:, 0]).mean()),
            "topk_sets_equal": float(same_sets.mean()),
            "mean_kl_topk": float(kl.mean()), "max_kl_topk": float(kl.max())}


def _synthetic_teacher(folder: Path, teacher_vocab: int) -> Path:
    """A random-weight Llama saved as a Hugging Face folder with a real SentencePiece model
    (Gemma's special-id order) trained on WikiText-2 train."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    lines = [r.text for r in load_records("wikitext2", "train")]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"), model_type="bpe",
        vocab_size=teacher_vocab, byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        num_threads=1, minloglevel=2,
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=teacher_vocab, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _point(teacher: str, vocab_dir: str, mode: str, batch_tokens: int, chunk_tokens: int,
           body_tokens: int, tokens: int, seq_len: int, k: int, threads: int,
           device: str | None) -> dict:
    """One measurement in this (fresh) process."""
    from dpfleet.public.matching import teacher_logprobs
    from dpfleet.public.teacher_tokenizer import TeacherVocab
    from dpfleet.public.topk import token_batches

    torch.set_num_threads(threads)
    vocab = TeacherVocab.load(Path(vocab_dir))
    ext = TopKExtractor(load_teacher(teacher, device), vocab, k,
                        "student" if mode == "topk-student" else "teacher", chunk_tokens,
                        body_tokens)
    cuda = ext.teacher.device.type == "cuda"
    texts = [r.text for r in load_records("wikitext2", "valid")]
    sequences = [s for s in student_sequences(texts, vocab.tokenizer, seq_len) if len(s) == seq_len]
    n = tokens // seq_len
    sequences = (sequences * -(-n // len(sequences)))[:n]  # repeated when the split is short

    def run(seqs) -> None:
        if mode == "lpub":
            teacher_logprobs(ext, vocab.tokenizer, seqs, batch_tokens, progress=False)
        else:
            for batch in token_batches(seqs, batch_tokens):
                ext.rows(batch)
        if cuda:
            torch.cuda.synchronize()

    run(sequences[:2])  # warm-up on a tiny batch
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base, cuda_base, peak, stop = _rss(), _cuda_allocated(cuda), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    tracemalloc.start()
    sampler.start()
    start = time.perf_counter()
    run(sequences)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    point = {"mode": mode, "batch_tokens": batch_tokens, "chunk_tokens": chunk_tokens,
             "body_tokens": ext.body_tokens, "tokens": n * seq_len,
             "tokens_per_s": round(n * seq_len / seconds, 1),
             "peak_rss_above_base_mib": round(max(0, peak[0] - base) / 2**20, 1),
             "tracemalloc_peak_mib": round(py_peak / 2**20, 2),
             "max_rss_process_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "teacher_vocab": ext.teacher.vocab_size, "device": str(ext.teacher.device)}
    if cuda:
        point["cuda_peak_above_base_mib"] = round(
            (torch.cuda.max_memory_allocated() - cuda_base) / 2**20, 1)
        point["cuda_peak_total_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return point


def _cuda_allocated(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else 0


def _machine(device: str) -> dict:
    """What the figures were measured on."""
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
               "processor": platform.processor(), "python": platform.python_version(),
               "torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        machine.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       compute_capability=f"{props.major}.{props.minor}",
                       cuda=torch.version.cuda, gpu_count=torch.cuda.device_count())
    return machine


def _defaults(args) -> bool:
    """Fill the sweep's unset options for the device; True on CUDA."""
    cuda = (args.device or "cpu").startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device (a CPU torch build?)")
    pick = (lambda gpu, cpu: gpu) if cuda else (lambda gpu, cpu: cpu)
    args.batch_sizes = args.batch_sizes or pick("4096,16384,65536", "512,1024,2048,4096,8192,16384")
    args.chunk_tokens = args.chunk_tokens or pick(2048, 512)
    args.body_tokens = pick(0, 512) if args.body_tokens is None else args.body_tokens
    args.one_shot_max = args.one_shot_max or 16384
    args.tokens = args.tokens or pick(262_144, 16_384)
    args.seq_len = args.seq_len or pick(128, 20)
    return cuda


def _scaling(args) -> None:
    cuda = _defaults(args)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        staged = (cache_dir() / "teachers" / args.teacher / "config.json").is_file()
        if cuda and args.teacher in PACKAGED and not staged:
            sys.exit(f"error: teacher {args.teacher} is not staged in {cache_dir() / 'teachers'}; "
                     "see docs/offline_gpu_server.md")
        synthetic = args.teacher == "synthetic" or (args.teacher in PACKAGED and not staged)
        teacher = str(_synthetic_teacher(Path(tmp), args.teacher_vocab)) if synthetic else args.teacher
        folder = resolve_teacher(teacher)
        student_vocab = min(args.vocab_size, args.teacher_vocab // 2) if synthetic else args.vocab_size
        build_teacher_vocab(load_teacher_spm(folder),
                            [r.text for r in load_records("wikitext2", "train")],
                            student_vocab, Path(tmp) / "tok", teacher)
        points = []
        huge = max(sizes) * 4
        for mode in args.modes.split(","):
            for batch in sizes:
                variants = [(args.body_tokens, args.chunk_tokens)]
                if batch <= args.one_shot_max:
                    variants.append((huge, huge))  # one body pass and one head chunk per batch
                for body, chunk in variants:
                    spec = {"teacher": teacher, "vocab_dir": str(Path(tmp) / "tok"), "mode": mode,
                            "batch_tokens": batch, "chunk_tokens": chunk, "body_tokens": body,
                            "tokens": args.tokens, "seq_len": args.seq_len, "k": args.k,
                            "threads": args.threads, "device": args.device}
                    out = subprocess.run([sys.executable, __file__, "--point", json.dumps(spec)],
                                         capture_output=True, text=True)
                    if out.returncode == 0:
                        point = json.loads(out.stdout.strip().splitlines()[-1])
                    else:  # e.g. the one-pass variant running out of memory: recorded, not fatal
                        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                        point = {"mode": mode, "batch_tokens": batch, "error": last[-300:]}
                    point["micro_batched"] = chunk != huge
                    point["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
                    print(json.dumps(point), flush=True)
                    points.append(point)
                    _save(args, cuda, synthetic, student_vocab, points)  # a killed sweep keeps its points


def _save(args, cuda: bool, synthetic: bool, student_vocab: int, points: list) -> None:
    result = {
        "teacher": "random-weight Llama (hidden 256, 4 layers, 4 heads, MLP 1024), real "
                   f"{args.teacher_vocab}-piece SentencePiece vocabulary" if synthetic else args.teacher,
        "student_vocab": student_vocab, "k": args.k, "seq_len": args.seq_len,
        "chunk_tokens": args.chunk_tokens, "body_tokens": args.body_tokens,
        "torch_threads": args.threads, "machine": _machine(args.device or "cpu"),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "points": points,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "public_topk_scaling" + ("_cuda" if cuda else "")
    if args.modes != "topk,topk-student,lpub":
        name += "_" + args.modes.replace(",", "_")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
