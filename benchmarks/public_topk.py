"""Distillation-corpus throughput: the teacher's top-k extraction in tokens/s and bytes/token.

Builds the trimmed teacher vocabulary on WikiText-2 train (timed), cuts WikiText-2 valid into
`--seq-len`-token sequences and stores the teacher's top-k for `--sequences` of them with the
real job (`public.topk.build_corpus`). Default teacher: the packaged Gemma 3 270M on whatever
device `load_teacher` picks (cuda when present). Saves results/public_topk.json.

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
from dpfleet.public.topk import TopKExtractor, build_corpus, student_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("--sequences", type=int, default=64)
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: one measurement as JSON
    args = parser.parse_args()
    if args.point:
        print(json.dumps(_point(**json.loads(args.point))))
        return
    if args.scaling or (args.device or "").startswith("cuda"):
        _scaling(args)
        return

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
        texts = [r.text for r in load_records("wikitext2", "valid")]
        sequences = student_sequences(texts, vocab.tokenizer, args.seq_len or 20)[: args.sequences]
        manifest = build_corpus(
            TopKExtractor(teacher, vocab, args.k), sequences, Path(tmp) / "corpus",
            batch_tokens=args.batch_tokens,
        )
    result = {
        "teacher": args.teacher,
        "device": manifest["device"],
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "k": args.k,
        "vocab_size": vocab.meta["vocab_size"],
        "teacher_vocab_size": vocab.meta["teacher_vocab_size"],
        "token_coverage_wikitext_train": round(vocab.meta["token_coverage"], 4),
        "sequences": manifest["sequences"],
        "tokens": manifest["tokens"],
        "batch_tokens": args.batch_tokens,
        "tokens_per_s": round(manifest["tokens_per_s"], 1),
        "bytes_per_token": round(manifest["bytes_per_token"], 2),
        "array_bytes_per_token": 4 * args.k,
        "teacher_load_s": round(load_s, 2),
        "vocab_build_s": round(vocab_s, 2),
    }
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "public_topk.json").write_text(json.dumps(result, indent=2) + "\n")


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
