"""Distillation-corpus throughput: the teacher's top-k extraction in tokens/s and bytes/token.

Builds the trimmed teacher vocabulary on WikiText-2 train (timed), cuts WikiText-2 valid into
`--seq-len`-token sequences and stores the teacher's top-k for `--sequences` of them with the
real job (`public.topk.build_corpus`). Default teacher: the packaged Gemma 3 270M on whatever
device `load_teacher` picks (cuda when present). Saves results/public_topk.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.edge.datasets import load_records
from dpfleet.public.teacher import load_teacher
from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm
from dpfleet.public.topk import TopKExtractor, build_corpus, student_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

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
        sequences = student_sequences(texts, vocab.tokenizer, args.seq_len)[: args.sequences]
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


if __name__ == "__main__":
    main()
