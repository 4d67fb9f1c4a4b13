"""Distribution matching, KD public training and the Algorithm 1 pipeline (tiny teacher, CPU)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from crashes import Crash, failing_on_round
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.edge.cohort import model_params
from dpfleet.edge.precision import resolve_precision
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat, set_flat
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_evaluate, kd_train
from dpfleet.public.matching import (
    match_scores,
    random_fraction,
    source_report,
    student_logprobs,
    teacher_logprobs,
    top_fraction,
)
from dpfleet.public.pipeline import load_pipeline, parse_pipeline, run_pipeline
from dpfleet.public.teacher import load_teacher
from dpfleet.public.topk import TopKCorpus, TopKExtractor, build_corpus, student_sequences

TINY = {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16}


def _model_cfg(vocab) -> ModelConfig:
    return ModelConfig(vocab_size=vocab.tokenizer.vocab_size, **TINY)


def _theta0(model_cfg: ModelConfig) -> np.ndarray:
    torch.manual_seed(0)
    return get_flat(build_model(model_cfg))


def _style(n: int, words: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(6, 12))) for _ in range(n)]


PRIVATE_WORDS = ["thou", "art", "my", "lord", "and", "thy", "sweet", "love", "doth", "make", "me",
                 "king", "of", "heaven"]
OTHER_WORDS = ["the", "city", "council", "approved", "a", "budget", "for", "new", "roads", "in",
               "the", "northern", "district"]


def test_matching_selects_planted_in_distribution_records(tiny_teacher_vocab):
    """A pool of 80 off-style records with 20 planted in the private style: l_priv from an LM
    trained on private-style text ranks the planted ones first."""
    tok = tiny_teacher_vocab.tokenizer
    model_cfg = _model_cfg(tiny_teacher_vocab)
    private = PlainCorpus(student_sequences(_style(200, PRIVATE_WORDS, 0), tok, 16))
    theta, _ = kd_train(model_cfg, _theta0(model_cfg), private, None,
                        KDTrainConfig(steps=60, batch_size=32, lr=1e-2, beta=0.0), progress=False)
    texts = _style(80, OTHER_WORDS, 1) + _style(20, PRIVATE_WORDS, 2)
    planted = set(range(80, 100))
    order = random.Random(3).sample(range(100), 100)  # planted records scattered in the pool
    pool = [tok.encode(texts[i])[:16] for i in order]
    model = build_model(model_cfg)
    set_flat(model, theta)
    l_priv = student_logprobs(model, pool)
    chosen = top_fraction(match_scores(None, l_priv, beta=1.0), 0.2)
    hits = sum(order[i] in planted for i in chosen)
    assert hits >= 18, hits
    # an untrained LM cannot tell them apart
    set_flat(model, _theta0(model_cfg))
    blind = top_fraction(student_logprobs(model, pool), 0.2)
    assert sum(order[i] in planted for i in blind) < hits
    report = source_report(["p" if order[i] in planted else "o" for i in range(100)], chosen)
    assert report["p"]["pool"] == 20 and report["p"]["selected"] == hits


def test_weighting_follows_app_d3():
    l_pub, l_priv = np.array([-1.0, -4.0, -2.0]), np.array([-3.0, -1.0, -2.0])
    assert np.allclose(match_scores(l_pub, l_priv, 0.5), [-2.0, -2.5, -2.0])
    assert list(top_fraction(match_scores(l_pub, l_priv, 0.0), 1 / 3)) == [0]  # l_pub only
    assert list(top_fraction(match_scores(l_pub, l_priv, 1.0), 1 / 3)) == [1]  # l_priv only
    with pytest.raises(DpfleetError, match="teacher"):
        match_scores(None, l_priv, 0.5)
    with pytest.raises(DpfleetError, match="beta"):
        match_scores(l_pub, l_priv, 1.5)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 0), min_size=1, max_size=60), st.floats(0.01, 1.0))
def test_top_fraction_keeps_the_best_q(scores, q):
    scores = np.array(scores)
    chosen = top_fraction(scores, q)
    assert len(chosen) == max(1, int(np.ceil(q * len(scores) - 1e-9)))
    assert len(set(chosen.tolist())) == len(chosen)
    rest = np.setdiff1d(np.arange(len(scores)), chosen)
    if len(rest):
        assert scores[chosen].min() >= scores[rest].max()
    assert len(random_fraction(len(scores), q, 0)) == len(chosen)


def _teacher_total(teacher, bos: int, teacher_ids: list[int]) -> float:
    ids = torch.tensor([[bos, *teacher_ids]])
    logp = torch.log_softmax(teacher.logits(ids, torch.ones_like(ids))[0, :-1], -1)
    return logp[torch.arange(len(teacher_ids)), ids[0, 1:]].sum().item()


TEXTS = ("In the beginning God created", "Now is the winter of our discontent",
         "The municipality of Quahog", "A b")


def test_teacher_logprobs_read_the_teachers_own_tokenization(tiny_teacher_dir, tiny_teacher_vocab):
    """l_pub = the teacher's log-likelihood of the decoded text in *its* segmentation, per
    on-device token; trimming makes the two segmentations differ on rare words."""
    teacher = load_teacher(str(tiny_teacher_dir), device="cpu")
    extractor = TopKExtractor(teacher, tiny_teacher_vocab, k=5)
    tok = tiny_teacher_vocab.tokenizer
    own = spm.SentencePieceProcessor(model_file=str(tiny_teacher_dir / "tokenizer.model"))
    seqs = [tok.encode(t)[:12] for t in TEXTS]
    got = teacher_logprobs(extractor, tok, seqs, batch_tokens=16, progress=False)
    mapped = [[int(tiny_teacher_vocab.student_to_teacher[i]) for i in s] for s in seqs]
    canonical = [own.encode(tok.decode(s)) for s in seqs]
    assert any(m != c for m, c in zip(mapped, canonical, strict=True))  # the case that matters
    for seq, ids, score in zip(seqs, canonical, got, strict=True):
        want = _teacher_total(teacher, extractor.teacher_bos, ids) / len(seq)
        assert score == pytest.approx(want, abs=1e-4)


def test_teacher_logprobs_ignore_the_on_device_segmentation(tiny_teacher_dir, tiny_teacher_vocab):
    """The same text in a non-canonical on-device segmentation (BPE dropout) keeps its teacher
    log-likelihood: only the per-token denominator changes."""
    extractor = TopKExtractor(load_teacher(str(tiny_teacher_dir), device="cpu"),
                              tiny_teacher_vocab, k=5)
    tok = tiny_teacher_vocab.tokenizer
    student = spm.SentencePieceProcessor(model_file=str(tok.model_file))
    spm.set_random_generator_seed(0)
    text = "Now is the winter of our discontent made glorious summer"
    canonical = tok.encode(text)
    split = student.encode(text, enable_sampling=True, alpha=0.5, nbest_size=-1)
    assert tok.decode(split) == text and len(split) > len(canonical)
    a, b = teacher_logprobs(extractor, tok, [canonical, split], progress=False)
    assert a * len(canonical) == pytest.approx(b * len(split), abs=1e-4)
    with pytest.raises(DpfleetError, match="no text"):
        teacher_logprobs(extractor, tok, [[tok.bos_id]], progress=False)


def test_kd_training_reduces_the_kd_loss(tiny_teacher_dir, tiny_teacher_vocab, tmp_path):
    extractor = TopKExtractor(load_teacher(str(tiny_teacher_dir), device="cpu"),
                              tiny_teacher_vocab, k=10)
    seqs = student_sequences(_style(60, PRIVATE_WORDS + OTHER_WORDS, 5), tiny_teacher_vocab.tokenizer, 12)
    build_corpus(extractor, seqs, tmp_path / "kd", progress=False)
    corpus = TopKCorpus(tmp_path / "kd")
    model_cfg = _model_cfg(tiny_teacher_vocab)
    theta0, every = _theta0(model_cfg), range(len(corpus))
    before = kd_evaluate(model_cfg, theta0, corpus, every)
    cfg = KDTrainConfig(steps=40, batch_size=16, lr=1e-2, beta=1.0)
    theta, history = kd_train(model_cfg, theta0, corpus, None, cfg, progress=False)
    after = kd_evaluate(model_cfg, theta, corpus, every)
    assert after["kd"] < before["kd"] - 0.3 and after["lm"] < before["lm"]
    assert history[-1]["kd"] < history[0]["kd"]
    # beta = 0 trains on the same tokens but ignores the teacher: less KD progress
    lm_only, _ = kd_train(model_cfg, theta0, corpus, None, KDTrainConfig(40, 16, 1e-2, 0.0),
                          progress=False)
    assert kd_evaluate(model_cfg, lm_only, corpus, every)["kd"] > after["kd"]


def test_kd_training_resumes_to_the_same_weights(tiny_teacher_vocab, tmp_path):
    seqs = student_sequences(_style(40, OTHER_WORDS, 3), tiny_teacher_vocab.tokenizer, 12)
    model_cfg, cfg = _model_cfg(tiny_teacher_vocab), KDTrainConfig(steps=12, batch_size=8, lr=1e-2)
    theta0 = _theta0(model_cfg)
    reference, ref_history = kd_train(model_cfg, theta0, PlainCorpus(seqs), None, cfg, progress=False)

    class DiesAtBatch8(PlainCorpus):
        calls = 0

        def batch(self, indices):
            DiesAtBatch8.calls += 1
            if DiesAtBatch8.calls == 8:
                raise Crash
            return super().batch(indices)

    state = tmp_path / "state.pt"
    with pytest.raises(Crash):
        kd_train(model_cfg, theta0, DiesAtBatch8(seqs), None, cfg, progress=False, state_file=state,
                 save_every=5)
    assert torch.load(state, weights_only=True)["step"] == 5
    theta, history = kd_train(model_cfg, theta0, PlainCorpus(seqs), None, cfg, progress=False,
                              state_file=state, save_every=5)
    assert np.array_equal(theta, reference) and history == ref_history
    with pytest.raises(DpfleetError, match="another job"):  # other settings: refused, not mixed
        kd_train(model_cfg, theta0, PlainCorpus(seqs), None, KDTrainConfig(12, 8, 5e-3),
                 progress=False, state_file=state)


def _pipeline_values(teacher_dir, vocab, **public) -> dict:
    return {
        "public": {"teacher": str(teacher_dir), "first_stage_rounds": 2, "fraction": 0.25,
                   "steps": 10, "batch_size": 8, "kd_beta": 0.1, **public},
        "pool": {"sources": ["wikitext2", "kjv", "shakespeare-collab"], "records": [20, 10, 10],
                 "seq_len": 12},
        "simulation": {
            "rounds": 4, "eval_every": 2,
            "data": {"dataset": "shakespeare-solo", "seq_len": 12, "max_clients": 20,
                     "max_examples": 16, "eval_examples": 100},
            "tokenizer": {"path": str(vocab.tokenizer.model_file.parent)},
            "model": TINY,
            "dp": {"report_goal": 4, "noise_multiplier": 0.5},
        },
    }


def _toml(values: dict, prefix: str = "") -> str:
    """Nested dicts of scalars and lists as TOML (JSON scalars and arrays are valid TOML)."""
    flat = "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items() if not isinstance(v, dict))
    head = f"[{prefix}]\n" if prefix and flat else ""
    return head + flat + "".join(_toml(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
                                 for k, v in values.items() if isinstance(v, dict))


def test_pipeline_end_to_end_on_cpu(tiny_teacher_dir, tiny_teacher_vocab, tmp_path):
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab)
    config = tmp_path / "pipeline.toml"
    config.write_text(_toml(values))
    out = tmp_path / "run"
    assert main(["public", "pipeline", str(config), "--out", str(out), "--quiet"]) in (0, None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["selected"] == 10 and summary["switch_round"] == 2
    assert sum(v["selected"] for v in summary["sources"].values()) == 10
    assert summary["rounds_completed"] == 4 and 0 < summary["epsilon"] < float("inf")
    # public.precision's default, as this CPU resolves it: the teacher by the CPU, the student by
    # the CPU and its size (a small student keeps float32 where the CPU has BF16)
    teacher = resolve_precision("auto")
    student = resolve_precision("auto", params=model_params(
        ModelConfig(vocab_size=tiny_teacher_vocab.tokenizer.vocab_size, **TINY)))
    assert summary["precision"] == {"teacher": {"used": teacher.name, "reason": teacher.reason},
                                    "public_training": {"used": student.name, "reason": student.reason}}
    # the server continued: one tree over all T rounds, privacy accounted over all of them
    privacy = json.loads((out / "simulation" / "privacy.json").read_text())
    assert privacy["rounds"] == 4 and privacy["restarts"] == []
    report = (out / "simulation" / "privacy_report.md").read_text()  # public data is listed
    assert ("public pool wikitext2 (20 records), kjv (10 records), shakespeare-collab (10 records)"
            in report.split("## Not covered by the guarantee")[1])
    with np.load(out / "scores.npz") as z:
        assert z["l_pub"].shape == (40,) and np.all(z["l_pub"] < 0) and np.all(z["l_priv"] < 0)
        l_pub = z["l_pub"]
    cached = list(cache_dir().glob("public/pool-*/l_pub_teacher_tokens.npy"))
    assert any(np.array_equal(np.load(f), l_pub) for f in cached)  # reused by the next variant
    chosen = summary["selected_indices"]
    with np.load(out / "scores.npz") as z:
        h = 0.5 * z["l_pub"] + 0.5 * z["l_priv"]
    assert h[chosen].min() >= np.delete(h, chosen).max()
    # mid-training changed the model the second stage started from
    metrics = [json.loads(line) for line in (out / "simulation" / "metrics.jsonl").open()]
    assert [m["round"] for m in metrics] == [1, 2, 3, 4]
    with pytest.raises(DpfleetError, match="finished pipeline"):
        run_pipeline(parse_pipeline(values), out, progress=False)


@pytest.mark.slow
def test_pipeline_resumes_without_redoing_the_public_stage(tiny_teacher_dir, tiny_teacher_vocab,
                                                           tmp_path, monkeypatch):
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab)
    values["simulation"]["checkpoint_every"] = 1
    values["simulation"]["dp"]["noise_seed"] = 0  # research mode: the reference has the same noise
    cfg = parse_pipeline(values)
    reference = run_pipeline(cfg, tmp_path / "ref", progress=False, log=lambda s: None)
    import dpfleet.public.pipeline as pipeline

    failing_on_round(monkeypatch, 4)  # the crash comes while round 4's clients train
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_pipeline(cfg, out, progress=False, log=lambda s: None)
    with pytest.raises(DpfleetError, match=r"another pipeline config.*\[public\]"):
        run_pipeline(parse_pipeline(_pipeline_values(tiny_teacher_dir, tiny_teacher_vocab,
                                                     fraction=0.5)), out, resume=True)

    def no_public_training(*args, **kwargs):
        raise AssertionError("the public stage finished before the crash and was redone")

    monkeypatch.setattr(pipeline, "kd_train", no_public_training)
    resumed = run_pipeline(cfg, out, resume=True, progress=False, log=lambda s: None)
    for key in ("final", "epsilon", "selected_indices", "sources", "accuracy_before_public_training"):
        assert resumed[key] == reference[key], key
    assert (out / "simulation" / "metrics.jsonl").read_text() == \
        (tmp_path / "ref" / "simulation" / "metrics.jsonl").read_text()


def test_teacher_cache_is_keyed_by_the_body_precision(tiny_teacher_dir, tiny_teacher_vocab, tmp_path,
                                                      monkeypatch):
    """A float32 l_pub is never served to a bfloat16 run, nor the reverse: the bfloat16 body gives
    other log-probs, so a shared entry would silently change which records are selected."""
    import dpfleet.edge.precision as precision
    from dpfleet.public.matching import build_pool
    from dpfleet.public.pipeline import TeacherWork

    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path))
    # a CPU with native BF16, whatever this one has (the tiny body runs on any kernels)
    monkeypatch.setattr(precision, "native_bf16", lambda: "AMX-BF16")
    pool = build_pool(["wikitext2"], [6], tiny_teacher_vocab.tokenizer, 12)

    def work(requested: str) -> TeacherWork:
        values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, precision=requested)
        return TeacherWork(parse_pipeline(values), tiny_teacher_vocab, pool, False)

    f32, bf16 = work("float32"), work("bfloat16")
    assert (f32.precision.name, bf16.precision.name) == ("float32", "bfloat16")
    assert f32.folder != bf16.folder and work("auto").folder == bf16.folder
    a, b = f32.logprobs(), bf16.logprobs()
    assert not np.array_equal(a, b)  # labelled again, by the bfloat16 body
    np.testing.assert_allclose(b, a, rtol=0.05)
    assert np.array_equal(work("float32").logprobs(), a)  # each run gets its own precision's entry
    assert np.array_equal(work("auto").logprobs(), b)


def test_pipeline_precision_errors(tiny_teacher_dir, tiny_teacher_vocab, tmp_path, monkeypatch):
    import dpfleet.edge.precision as precision

    with pytest.raises(DpfleetError, match="public.precision must be one of"):
        parse_pipeline(_pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, precision="float16"))
    monkeypatch.setattr(precision, "native_bf16", lambda: None)
    cfg = parse_pipeline(_pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, precision="bfloat16"))
    with pytest.raises(DpfleetError, match=r"^public.precision = 'bfloat16' but this CPU has no native BF16"):
        run_pipeline(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_example_pipeline_config_is_valid():
    cfg = load_pipeline(Path(__file__).parents[1] / "examples" / "public_pipeline.toml")
    assert cfg.switch_round == cfg.simulation.rounds // 2 and cfg.public.selection == "match"
    assert cfg.simulation.rounds * cfg.simulation.dp.report_goal <= cfg.simulation.data.max_clients


def test_pipeline_config_errors(tiny_teacher_dir, tiny_teacher_vocab, tmp_path):
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, first_stage_rounds=0)
    with pytest.raises(DpfleetError, match="DP checkpoint"):
        parse_pipeline(values)
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, fracton=0.1)
    with pytest.raises(DpfleetError, match="did you mean 'public.fraction'"):
        parse_pipeline(values)
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, selection="best")
    with pytest.raises(DpfleetError, match="selection"):
        parse_pipeline(values)
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, targets="both")
    with pytest.raises(DpfleetError, match="public.targets"):
        parse_pipeline(values)
    values = _pipeline_values(tiny_teacher_dir, tiny_teacher_vocab, student_device="tpu")
    with pytest.raises(DpfleetError, match="student device"):
        parse_pipeline(values)
    with pytest.raises(SystemExit) as exit_info:  # a user error: one line, exit status 2
        main(["public", "pipeline", str(tmp_path / "none.toml"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2


def test_pretrain_cli_with_kd_corpus(tiny_teacher_dir, tiny_teacher_vocab, tmp_path, capsys):
    folder = tiny_teacher_vocab.tokenizer.model_file.parent
    extractor = TopKExtractor(load_teacher(str(tiny_teacher_dir), device="cpu"),
                              tiny_teacher_vocab, k=10)
    seqs = student_sequences(_style(40, OTHER_WORDS, 9), tiny_teacher_vocab.tokenizer, 12)
    build_corpus(extractor, seqs, tmp_path / "kd", progress=False)
    args = ["public", "pretrain", "--tokenizer", str(folder), "--out", str(tmp_path / "ckpt"),
            "--kd-corpus", str(tmp_path / "kd"), "--beta", "0.5", "--steps", "30",
            "--batch-size", "8", "--embedding-dim", "16", "--hidden-dim", "32",
            "--projection-dim", "16", "--lr", "0.01"]
    assert main(args) in (0, None)
    result = json.loads((tmp_path / "ckpt" / "pretrain.json").read_text())
    assert result["after"]["kd"] < result["before"]["kd"]
    from dpfleet.export.checkpoint import load_checkpoint

    cfg, _, tok = load_checkpoint(tmp_path / "ckpt")
    assert cfg.vocab_size == tok.vocab_size == tiny_teacher_vocab.tokenizer.vocab_size
    with pytest.raises(SystemExit) as exit_info:  # an existing checkpoint is kept
        main(args)
    assert exit_info.value.code == 2
    assert not (tmp_path / "ckpt" / "pretrain_state.pt").exists()  # gone once finished
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"step": 3}, other / "pretrain_state.pt")  # a foreign training state
    args[args.index("--out") + 1] = str(other)
    for extra, message in (([], "pass --resume"), (["--resume"], "another job")):
        with pytest.raises(SystemExit) as exit_info:
            main(args + extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
