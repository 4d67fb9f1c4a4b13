"""A labelling job to kill: `build_corpus` in its own process, slowed after each teacher batch.

    python tests/topk_labeller.py TEACHER_DIR VOCAB_DIR SEQUENCES_JSON OUT SHARD_SEQUENCES DELAY

Why a process of its own: test_public_topk_cache.py SIGKILLs it once its first shard is in the
manifest (no `finally`, no flush: what a power cut or the OOM killer does) and resumes in-process.
The delay only spaces the shards out, so the kill lands mid-job; it does not change the labels.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dpfleet.public.teacher import load_teacher
from dpfleet.public.teacher_tokenizer import TeacherVocab
from dpfleet.public.topk import TopKExtractor, build_corpus


def main(argv: list[str]) -> None:
    teacher_dir, vocab_dir, sequences_file, out, shard_sequences, delay = argv
    torch.set_num_threads(1)  # as the tests' own process: the same float results
    extractor = TopKExtractor(load_teacher(teacher_dir, "cpu"), TeacherVocab.load(Path(vocab_dir)), 4)
    rows = extractor.rows

    def slow_rows(batch):
        result = rows(batch)
        time.sleep(float(delay))
        return result

    extractor.rows = slow_rows
    sequences = json.loads(Path(sequences_file).read_text())
    build_corpus(extractor, sequences, Path(out), int(shard_sequences), progress=False)


if __name__ == "__main__":
    main(sys.argv[1:])
