"""The keyboard's figures of a finished run (`coordinator/engine/keyboard_eval.py`): top-1 / top-3
word recall of the suggestion strip and keystroke savings of the final model's `suggest`, next to
the most-frequent-word strip, on a seeded sample of held-out words. By hand on the bigram of
test_suggest.py (known probabilities); through a run, summary.json's `keyboard` block equals a
direct call of field_metrics on the same sample; and the block reaches the result block,
`dpfleet compare`, TensorBoard and the status page."""

import copy
import json

import numpy as np
import pytest
import torch
from test_api import CONFIG, USERS, WORDS, TinyLM
from test_suggest import ID, Bigram, Pieces

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator.cli.result_block import result_lines
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.evaluation import split_held_out
from dpfleet.coordinator.engine.field_metrics import (
    frequent_word_strip,
    keystroke_savings,
    row_pieces,
    row_texts,
    strip_recall,
    text_cases,
)
from dpfleet.coordinator.engine.keyboard_eval import keyboard_block, sample_cases
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.coordinator.run import _UserTokenizer, user_records
from dpfleet.edge.suggest import Predictor
from dpfleet.edge.tokenizer import BOS, EOS, PAD, WordTokenizer

P = {piece: i for piece, i in ID.items()}


def row(*pieces: str, width: int = 6) -> list[int]:
    ids = [BOS, *(P.get(p, p) for p in pieces)]
    return ids + [PAD] * (width - len(ids))


# each row's first unit may be a word's tail (a row is a window of a longer text): context only.
# The last row is full, so its last unit ("see") may be a word's head: context only too.
ROWS = np.array([row("▁at", "▁no", "on"),  # ("at ", "noon")
                 row("▁at", "▁the"),  # ("at ", "the")
                 row("▁at", "▁north"),  # ("at ", "north")
                 row("▁at", "▁the", "▁no", "on", "▁see")])  # ("at ", "the"), ("at the ", "noon")
# the baseline's held-out rows: "now" 2, "north" 3, "the" 1 (first units not counted)
FIT = np.array([row("▁see", "▁no", "w", "▁no", "w", "▁the", width=8),
                row("▁see", "▁north", "▁north", "▁north", width=8)])


def test_rows_are_cut_at_eos_and_oov_and_a_windows_cut_words_are_context_only():
    rows = [np.array(row("▁see", "▁you", EOS, "▁at", "<unk>", "▁no", "on", width=9)),
            np.array(row("▁at", "▁the", "▁no", "on", "▁see", width=6))]
    decode = Pieces().decode
    assert row_pieces(rows[0], decode) == [("see you", 1, 2), ("at", 0, 1), ("noon", 0, 1)]
    assert row_pieces(rows[1], decode) == [("at the noon see", 1, 3)]  # full: "see" may go on
    assert row_pieces(rows[1], decode, whole_words=True) == [("at the noon see", 0, 4)]
    assert row_texts(rows, decode) == ["you", "at", "noon", "the noon"]
    assert text_cases(row_pieces(rows[1], decode), 5) == [("at ", "the"), ("at the ", "noon")]
    assert text_cases([("Hi, 'tis 2 cats.", 0, 4)], 5) == [("", "Hi"), ("Hi, 'tis 2 ", "cats")]


def test_the_most_frequent_word_strip_completes_the_typed_word():
    strip = frequent_word_strip(["now now the North north", "north"])
    assert strip("at ") == ["north", "now", "the"]
    assert strip("at N") == ["north", "now"]
    assert strip("at nor") == ["north"] and strip("at x") == []


def test_keyboard_block_by_hand_on_the_bigram():
    """By hand from test_suggest.py's table: after "at" the strip is [the, noon, now]; after "at n"
    [noon, now, north]; after "the" [noon, now, no]. Words: noon, the, north, the, noon.
    Model: top-1 the, the, noon = 3/5; top-3 all but north = 4/5; north is offered after "n":
    saved 4 + 3 + 4 + 3 + 4 = 18 of 4 + 3 + 5 + 3 + 4 = 19 characters.
    Most frequent words [north, now, the]: top-1 north = 1/5; top-3 the, north, the = 3/5; noon
    never offered (after "no" [now], "noo" nothing): saved 0 + 3 + 5 + 3 + 0 = 11 of 19."""
    block = keyboard_block(Bigram(), Pieces(), ROWS, words=10, seed=0, fit_rows=FIT)
    assert block["model"] == pytest.approx({"top1_recall": 3 / 5, "top3_recall": 4 / 5,
                                            "keystroke_savings": 18 / 19})
    assert block["most_frequent_words"] == pytest.approx({"top1_recall": 1 / 5, "top3_recall": 3 / 5,
                                                          "keystroke_savings": 11 / 19})
    assert (block["words"], block["characters"]) == (5, 19)
    assert "held-out users' text only" in block["privacy"] and "no privacy cost" in block["privacy"]
    # the sample: seeded, and cut at `words`
    two = keyboard_block(Bigram(), Pieces(), ROWS, words=2, seed=0)
    assert two["words"] == 2 and "most_frequent_words" not in two
    assert sample_cases(ROWS, Pieces(), 2, seed=0) == sample_cases(ROWS, Pieces(), 2, seed=0)
    assert keyboard_block(Bigram(), Pieces(), ROWS, words=0, seed=0) is None


TOKENIZER_WORDS = WORDS
RUN = {**CONFIG, "rounds": 2, "tensorboard": True, "data": {**CONFIG["data"], "keyboard_words": 30}}


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
    """One tiny run on a word tokenizer (it decodes and has a lexicon)."""
    torch.manual_seed(5)
    tok = WordTokenizer(TOKENIZER_WORDS)
    result = dpfleet.simulate(copy.deepcopy(RUN), model=TinyLM(vocab=tok.vocab_size), users=USERS,
                              tokenizer=tok, progress=False, run_dir=tmp_path_factory.mktemp("kb") / "run")
    return result, tok


def test_the_summary_holds_what_field_metrics_give_on_the_same_sample(word_run):
    result, tok = word_run
    summary = json.loads((result.run_dir / "summary.json").read_text())
    block = summary["keyboard"]
    cfg = parse_config(copy.deepcopy(RUN))
    _, data = prepare_data(cfg, None, user_records(USERS), tok)
    rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None, cfg.data.test_fraction)
    run_tok = _UserTokenizer(tok)  # the run's view of a caller's tokenizer: its decode and lexicon
    cases = sample_cases(rows, run_tok, 30, cfg.seed)
    assert len(cases) == block["words"] == 30
    model = Predictor(result.model, tok, cfg.data.seq_len).suggest  # Result.suggest's predictor
    expected = {**strip_recall(cases, model), **keystroke_savings(cases, model)}
    assert block["model"] == {k: expected[k] for k in ("top1_recall", "top3_recall", "keystroke_savings")}
    fit = np.concatenate([c.examples for c in baseline_clients])
    strip = frequent_word_strip(row_texts(fit, tok.decode))
    base = {**strip_recall(cases, strip), **keystroke_savings(cases, strip)}
    assert block["most_frequent_words"] == {k: base[k] for k in ("top1_recall", "top3_recall",
                                                                  "keystroke_savings")}
    assert block["characters"] == expected["characters"] == sum(len(w) for _, w in cases)
    assert 0 < block["seconds"] < 30


def test_compare_has_a_keyboard_row_and_json(word_run, capsys):
    result, _ = word_run
    block = json.loads((result.run_dir / "summary.json").read_text())["keyboard"]
    main(["compare", str(result.run_dir), "--json", "--no-plot"])
    (figures,) = json.loads(capsys.readouterr().out)["runs"]
    assert figures["keyboard"] == {"model": block["model"], "words": 30,
                                   "most_frequent_words": block["most_frequent_words"]}
    main(["compare", str(result.run_dir), "--no-plot"])
    out = capsys.readouterr().out.splitlines()
    for label, strip in (("strip t1/t3/saved", "model"),
                         ("  frequent words", "most_frequent_words")):
        (line,) = [r for r in out if r.startswith(label)]
        rates = block[strip]
        assert line.endswith(f"{rates['top1_recall']:.3f} / {rates['top3_recall']:.3f} / "
                             f"{rates['keystroke_savings']:.3f}")


def test_tensorboard_has_the_keyboard_figures_at_the_last_step(word_run):
    from test_tensorboard import read_events

    result, _ = word_run
    block = json.loads((result.run_dir / "summary.json").read_text())["keyboard"]
    events = {(step, tag): value for step, tag, value in read_events(result.run_dir / "tensorboard")}
    assert events[2, "keyboard/model/top3_recall"] == pytest.approx(block["model"]["top3_recall"], rel=1e-6)
    assert events[2, "keyboard/most_frequent_words/keystroke_savings"] == pytest.approx(
        block["most_frequent_words"]["keystroke_savings"], rel=1e-6)


def test_the_result_block_line():
    keyboard = {"model": {"top1_recall": 0.25, "top3_recall": 0.5, "keystroke_savings": 0.125},
                "most_frequent_words": {"top1_recall": 0.0625, "top3_recall": 0.1875,
                                        "keystroke_savings": 0.03125}, "words": 100}
    privacy = {"min_separation": None, "epsilon": 1.0, "delta": 1e-5, "zcdp": 0.1,
               "noise_multiplier": 1.0, "max_participation": 1, "noise_mechanism": "tree"}
    common = dict(final={"accuracy": 0.5, "perplexity": 3.0}, baseline={"accuracy": 0.1, "perplexity": 9.0},
                  privacy=privacy, warnings=[], stopped_early=None, run_dir="run")
    lines = result_lines(**common, keyboard=keyboard)
    (line,) = [r for r in lines if r.startswith("word suggestions")]
    assert line.endswith("model top-1 0.250 top-3 0.500 keys saved 0.125   most frequent words "
                         "top-1 0.062 top-3 0.188 keys saved 0.031 (100 held-out words)")
    assert not [r for r in result_lines(**common) if r.startswith("word suggestions")]


def test_the_services_finish_scores_the_strip_and_the_status_page_shows_it(tmp_path):
    """The service's engine gets the baseline's held-out rows at boot (`service/boot.py`) and its
    finish writes the same block; the status page shows the finished run's figures."""
    from service_fleet import tiny_cfg

    from dpfleet.coordinator.state.state_store import finish_run
    from dpfleet.service.admin import public_status
    from dpfleet.service.boot import boot
    from dpfleet.service.rounds import HttpCollector
    from dpfleet.service.servelog import ServiceLog
    from dpfleet.service.status_page import render

    cfg = tiny_cfg(rounds=1, data={"keyboard_words": 10})
    booted = boot(cfg, tmp_path / "state", log=lambda s: None)
    log = ServiceLog(tmp_path / "service.log")
    try:
        driver = HttpCollector(booted, log)
        assert public_status(driver)["top3_recall"] is None  # not finished: no figure
        finish_run(booted.store, booted.engine, stopped_early=None, baseline=booted.baseline,
                   started=booted.started)
        block = json.loads((tmp_path / "state" / "summary.json").read_text())["keyboard"]
        driver.outcome = {"keyboard": block}  # what the driver's own finish keeps of summary.json
        status = public_status(driver)
    finally:
        log.close()
        booted.store.close()
    assert block["words"] == 10 and set(block["most_frequent_words"]) == {
        "top1_recall", "top3_recall", "keystroke_savings"}
    assert status["top3_recall"] == block["model"]["top3_recall"]
    assert status["baseline_keystroke_savings"] == block["most_frequent_words"]["keystroke_savings"]
    page = render(status, {"rounds": []})
    assert "top-3 word recall" in page and f"{block['model']['top3_recall']:.3f}" in page
    assert f"{block['most_frequent_words']['top3_recall']:.3f}" in page
