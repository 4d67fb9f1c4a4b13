"""The l_pub / KD rows of the public-pool benchmark (benchmarks/quality/lpub_kd.py and the
`--lpub-kd` arms of public_pool.py): teacher work restricted to part of the pool, no teacher run."""

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.tokenizer import PAD
from dpfleet.errors import DpfleetError
from dpfleet.public.matching import Pool, match_scores, top_fraction
from dpfleet.public.topk import TopKCorpus

QUALITY = Path(__file__).parents[1] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))  # the scripts import their siblings
try:
    _mods = {}
    for _name in ("lpub_kd", "public_pool"):
        _spec = importlib.util.spec_from_file_location(_name, QUALITY / f"{_name}.py")
        _mods[_name] = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = _mods[_name]
        _spec.loader.exec_module(_mods[_name])
finally:
    sys.path.remove(str(QUALITY))
    for _name in _mods:
        sys.modules.pop(_name, None)  # no benchmark module shadows another test's imports
lpub_kd, public_pool = _mods["lpub_kd"], _mods["public_pool"]


def _args(**over) -> argparse.Namespace:
    base = dict(pool=[10_000, 10_000, 3_000], q=[0.005, 0.02, 0.1], epochs=2.0, fewer_epochs=[],
                batch_size=32, seeds=[0, 1], noise=[0.7], momentum=[0.5], rounds=50,
                report_goal=20, eval_examples=1500, teacher="gemma3-270m", lpub_q=0.02,
                lpub_steps=144, candidates=0.04, match_beta=0.5, kd_beta=0.1)
    return argparse.Namespace(**(base | over))


def test_lpub_arms_differ_only_in_ranking_weight_and_kd():
    from dpfleet.public.pipeline import parse_pipeline

    args = _args()
    arms = public_pool.lpub_arms(args)
    assert [a["name"] for a in arms] == ["none", "match-q2%-144st", "lpub-q2%-144st",
                                         "kd-q2%-144st", "lpubkd-q2%-144st"]
    cfgs = {a["name"]: parse_pipeline(public_pool.config(args, a, 3)) for a in arms}
    assert all(c.simulation.dp.noise_seed == 3 for c in cfgs.values())  # paired noise draws
    weights = {n: (c.public.match_beta, c.public.kd_beta) for n, c in cfgs.items() if n != "none"}
    assert weights == {"match-q2%-144st": (1.0, 0.0), "lpub-q2%-144st": (0.5, 0.0),
                       "kd-q2%-144st": (1.0, 0.1), "lpubkd-q2%-144st": (0.5, 0.1)}
    rest = {json.dumps({**c.resolved(), "public": {**c.resolved()["public"], "match_beta": 0,
                                                   "kd_beta": 0}}, sort_keys=True)
            for n, c in cfgs.items() if n != "none"}
    assert len(rest) == 1  # everything else (q, steps, pool, private run) is the same
    pairs = public_pool.lpub_comparisons(arms)
    assert ("l_pub in the ranking (beta = 0.5 vs 1)", "lpub-q2%-144st", "match-q2%-144st") in pairs
    assert all(row != base for _, row, base in pairs)


def _pool(n: int) -> Pool:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 200, size=rng.integers(4, 9)).tolist() for _ in range(n)]
    return Pool(seqs, ["kjv"] * n, [f"text {i}" for i in range(n)])


def _teacher(pool: Pool, candidates=(), labelled=()):
    cfg = SimpleNamespace(public=SimpleNamespace(teacher="t", k=3, targets="teacher",
                                                 batch_tokens=0, precision="float32"))
    vocab = SimpleNamespace(meta={"teacher": "t", "vocab_size": 256})
    return lpub_kd.PartialTeacher(cfg, vocab, pool, False, candidates, labelled)


def _write_lpub(work, pool: Pool, values: np.ndarray) -> None:
    """Stand-in for the teacher: cache chunk files as score_candidates writes them."""
    work.lpub_folder.mkdir(parents=True, exist_ok=True)
    for chunk in lpub_kd._chunks(work.candidates):
        keys = [lpub_kd.record_key(pool.sequences[i]) for i in chunk]
        np.savez(work.lpub_folder / f"{lpub_kd._chunk_name(keys)}.npz", keys=np.array(keys),
                 l_pub=values[chunk])


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.0, 0.99))
def test_no_record_outside_the_candidates_is_ever_selected(seed, beta):
    """However high a non-candidate's (unscored) l_pub would be, h_beta cannot rank it in."""
    rng = np.random.default_rng(seed)
    pool = _pool(200)
    l_priv = rng.normal(-6, 1, 200)
    candidates = top_fraction(l_priv, 0.2)
    work = _teacher(pool, candidates)
    shutil.rmtree(work.lpub_folder, ignore_errors=True)  # one cache per example
    truth = rng.normal(-4, 1, 200)
    truth[np.setdiff1d(np.arange(200), candidates)] = 10.0  # best l_pub of all, never scored
    _write_lpub(work, pool, truth)
    l_pub = work.logprobs()
    assert np.isneginf(l_pub[np.setdiff1d(np.arange(200), candidates)]).all()
    np.testing.assert_array_equal(l_pub[candidates], truth[candidates])
    picked = top_fraction(match_scores(l_pub, l_priv, beta), 0.1)
    assert set(picked.tolist()) <= set(candidates.tolist())


def test_a_cache_file_of_other_records_or_a_missing_one_is_refused():
    pool = _pool(100)
    work = _teacher(pool, range(70))
    with pytest.raises(DpfleetError, match="no cached l_pub"):
        work.logprobs()
    _write_lpub(work, pool, np.zeros(100))
    path = sorted(work.lpub_folder.glob("*.npz"))[0]
    with np.load(path) as z:
        keys = z["keys"].copy()
    keys[[0, 1]] = keys[[1, 0]]  # two records' scores swapped
    np.savez(path, keys=keys, l_pub=np.arange(len(keys), dtype=float))
    with pytest.raises(DpfleetError, match="other records"):
        work.logprobs()


def _write_topk(folder: Path, seqs, k: int, rng) -> None:
    """A top-k corpus in the shard format of public/topk.py, with random labels."""
    tokens = np.concatenate([np.asarray(s, np.uint16) for s in seqs])
    tokens[np.cumsum([0, *map(len, seqs[:-1])])] |= np.uint16(1 << 15)
    ids = rng.integers(5, 200, size=(len(tokens), k)).astype(np.uint16)
    rel = -np.sort(rng.random((len(tokens), k - 1)), 1).astype(np.float16)
    folder.mkdir(parents=True)
    np.savez(folder / "shard-00000.npz", tokens=tokens, topk_ids=ids, topk_logits=rel)
    (folder / "manifest.json").write_text(json.dumps({"shards": ["shard-00000.npz"]}))


def test_subset_corpus_batches_like_one_corpus_and_refuses_unlabelled_records(tmp_path):
    rng = np.random.default_rng(1)
    pool = _pool(300)
    labelled = sorted(rng.choice(300, size=150, replace=False).tolist())
    work = _teacher(pool, labelled=labelled)
    chunks = lpub_kd._chunks(labelled)
    for c, chunk in enumerate(chunks):
        _write_topk(work.topk_folder / f"{c:04x}", [pool.sequences[i] for i in chunk], 3, rng)
    corpus = work.corpus()
    assert len(corpus) == 300  # indexed by pool index, like the full-pool corpus
    pick = rng.choice(labelled, size=32, replace=False)
    got = corpus.batch(pick)
    # the same records' labels, read chunk by chunk and collated by hand
    for b, i in enumerate(pick):
        c, chunk = next((c, chunk) for c, chunk in enumerate(chunks) if i in chunk)
        one = TopKCorpus(work.topk_folder / f"{c:04x}").batch([chunk.index(i)])
        n = len(pool.sequences[i])
        assert got.targets[b, :n].tolist() == pool.sequences[i]
        assert (got.targets[b, n:] == PAD).all() and torch.isneginf(got.topk_logits[b, n:]).all()
        torch.testing.assert_close(got.topk_logits[b, :n], one.topk_logits[0, :n])
        assert torch.equal(got.topk_ids[b, :n], one.topk_ids[0, :n])
    outside = next(i for i in range(300) if i not in labelled)
    with pytest.raises(DpfleetError, match="no teacher labels"):
        corpus.batch([labelled[0], outside])


def test_labels_are_found_by_content_not_by_position(tmp_path):
    rng = np.random.default_rng(2)
    pool = _pool(80)
    work = _teacher(pool, labelled=range(40))
    wrong = [pool.sequences[i] for i in range(40)]
    wrong[3] = pool.sequences[60]  # a shard that holds another record's labels in that slot
    _write_topk(work.topk_folder / "00", wrong, 3, rng)
    with pytest.raises(DpfleetError, match="no teacher labels for pool record 3"):
        work.corpus()  # record 3 is not labelled, whatever sits in its position
    _write_topk(work.topk_folder / "01", [pool.sequences[3]], 3, rng)
    corpus = work.corpus()
    assert corpus.batch([3]).targets[0].tolist()[: len(pool.sequences[3])] == pool.sequences[3]
    np.testing.assert_array_equal(  # found in the second shard, where its own tokens are
        corpus.batch([3]).topk_ids[0, : len(pool.sequences[3])].numpy(),
        TopKCorpus(work.topk_folder / "01").topk_ids[: len(pool.sequences[3])])


def test_exact_selection_estimate_weighs_the_sample_for_the_unscored_rest():
    """30 scored candidates; 10 sampled records stand for 100 unscored ones each. When the
    sample's h is the highest, the extrapolated top 2% (21 of 1,030) comes from outside."""
    n_cand, n_sample, n_out = 30, 10, 1000
    sources = ["kjv"] * n_cand + ["wikitext2"] * n_out
    pool = Pool([[5, 6, 7, 8]] * (n_cand + n_out), sources, [""] * (n_cand + n_out))
    union = np.arange(n_cand)
    sample = np.arange(n_cand, n_cand + n_sample)
    l_priv = np.zeros(n_cand + n_out)
    l_pub = np.full(n_cand + n_out, -5.0)
    args = SimpleNamespace(match_beta=0.5, lpub_q=0.02)
    high = public_pool.exact_selection_estimate(args, pool, union, sample, l_priv, l_pub,
                                                np.full(n_sample, -1.0), list(union), n_out)
    assert high["estimated_exact_share_from_candidates"] == 0.0
    assert high["estimated_exact_sources"] == {"wikitext2": 1.0, "kjv": 0.0,
                                               "shakespeare-collab": 0.0}
    low = public_pool.exact_selection_estimate(args, pool, union, sample, l_priv, l_pub,
                                               np.full(n_sample, -9.0), list(union), n_out)
    assert low["estimated_exact_share_from_candidates"] == 1.0
    assert low["estimated_exact_sources"]["kjv"] == 1.0
    l_pub[:25] = -9.0  # only 5 candidates stay above the sample: 16 of the 21 come from outside
    mixed = public_pool.exact_selection_estimate(args, pool, union, sample, l_priv, l_pub,
                                                 np.full(n_sample, -6.0), list(union), n_out)
    assert mixed["estimated_exact_share_from_candidates"] == pytest.approx(5 / 21)


def test_score_candidates_caches_exactly_the_teacher_scores_of_the_candidates(monkeypatch):
    """The claimed-chunk loop (`work_through`) with a stand-in teacher (scores = record length
    plus its first token): every candidate's cached l_pub is its own score, nothing else is."""
    import dpfleet.public.matching as matching

    pool = _pool(150)
    candidates = list(range(0, 150, 2))
    work = _teacher(pool, candidates)
    monkeypatch.setattr(work, "extractor", lambda: None)
    work.vocab.tokenizer = None
    monkeypatch.setattr(lpub_kd, "_teacher_tokens", lambda w, seqs: sum(len(s) for s in seqs))
    monkeypatch.setattr(matching, "teacher_logprobs",
                        lambda ex, tok, seqs, batch, progress: np.array(
                            [len(s) + s[0] for s in seqs], dtype=float))
    work.score_candidates(lambda path: True)
    l_pub = work.logprobs()
    want = np.array([len(s) + s[0] for s in pool.sequences], dtype=float)
    np.testing.assert_array_equal(l_pub[candidates], want[candidates])
    assert np.isneginf(np.delete(l_pub, candidates)).all()
    assert work.teacher_stats["lpub_tokens"] == sum(len(pool.sequences[i]) for i in candidates)


def test_work_through_waits_for_chunks_another_worker_claimed():
    left = list(range(300))
    calls = []

    def do_chunk(chunk):  # the first pass finds every chunk claimed; the "other worker" ends them
        calls.append(len(chunk))
        if len(calls) <= len(lpub_kd._chunks(range(300))):
            return False
        del left[: len(chunk)]
        return True

    lpub_kd.work_through(300, lambda: list(left), do_chunk, "test", False, pause_s=0.0)
    assert left == [] and sum(calls) == 600
