"""The keyboard's figures of a finished run: top-1 / top-3 word recall of the suggestion strip and
keystroke savings (`field_metrics`, Hard et al. 2018) of the phone's `suggest`, next to the
most-frequent-word strip. A run scores its final model through `edge.suggest.Predictor`, which runs
the phone's word search (`edge.word_search`, kept to the tokenizer's lexicon) on the torch model;
`bundle_keyboard_block` scores a signed bundle through the phone's own client (`BundleClient`), and
both give the same figures on the same sample (up to a near-tie the runtimes' float rounding decides).

Why a sample: `suggest` is a beam search, asked before each word and after each typed prefix, so
every held-out word costs a few dozen model calls; `data.keyboard_words` held-out words (a seeded
choice of held-out rows) keep a run's finish within seconds. The text is held-out users' only,
scored like the held-out accuracy: no privacy cost. The baseline strip's word counts come from the
other held-out users (those the unigram baseline is fitted on), never from the training clients
(private data outside the guarantee) nor from the scored words.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

from dpfleet.coordinator.engine.field_metrics import (
    STRIP_SLOTS,
    frequent_word_strip,
    keyboard_metrics,
    row_pieces,
    row_texts,
    text_cases,
)
from dpfleet.edge.suggest import Predictor
from dpfleet.edge.tokenizer import oov_ids_of
from dpfleet.progress import progress_bar

if TYPE_CHECKING:
    from dpfleet.edge.device_client import BundleClient

PRIVACY = "held-out users' text only, like the held-out accuracy: no privacy cost"
FIT_ROWS = 5000  # held-out rows the baseline strip counts words in, at most (a decode each)
SAMPLE_STREAM = 41  # the sample's own seed stream, apart from every other use of the run's seed


def can_suggest(tokenizer: object) -> bool:
    """Whether the tokenizer lets `suggest` spell words: it decodes, and it is not a character
    vocabulary (a strip of words spelled a character at a time is not a keyboard's strip)."""
    return callable(getattr(tokenizer, "decode", None)) and getattr(tokenizer, "kind", "") != "char"


def sample_cases(rows: np.ndarray, tokenizer: object, words: int, seed: int) -> list[tuple[str, str]]:
    """Up to `words` (context, word) cases from held-out `rows`, the rows taken in a seeded order
    (`seed`: the run's) so the sample spreads over the held-out users."""
    order = np.random.default_rng([seed, SAMPLE_STREAM]).permutation(len(rows))
    cases: list[tuple[str, str]] = []
    for i in order:
        if len(cases) >= words:
            break
        cases += text_cases(row_pieces(rows[i], *_reading(tokenizer)), words - len(cases))
    return cases


def keyboard_block(model: nn.Module, tokenizer: object, rows: np.ndarray | None, *, words: int,
                   seed: int, seq_len: int | None = None, fit_rows: np.ndarray | None = None) -> dict | None:
    """summary.json's `keyboard` block: `model` (the final model's strip) and `most_frequent_words`
    (the strip of the words most frequent in the first FIT_ROWS of `fit_rows`; left out
    without them), each with
    top1_recall, top3_recall and keystroke_savings, over the same sampled words. None when the run
    has none to score (`words` = 0, no held-out rows, a tokenizer `can_suggest` refuses)."""
    if not can_suggest(tokenizer):
        return None
    return strip_block(Predictor(model, tokenizer, seq_len).suggest, tokenizer, rows, words=words, seed=seed,
                       fit_rows=fit_rows)


def bundle_keyboard_block(client: BundleClient, rows: np.ndarray | None, *, words: int, seed: int,
                          fit_rows: np.ndarray | None = None) -> dict | None:
    """`keyboard_block` through a phone bundle's own `suggest` (`BundleClient`, its ONNX Runtime
    programs and its weights, `set_inference_weights` for others): the same sample, so the same
    figures as the model's `Predictor` up to the runtimes' float differences deciding a near-tie
    (`edge.word_search` is the one search both run)."""
    if not can_suggest(client.tokenizer):
        return None
    return strip_block(client.suggest, client.tokenizer, rows, words=words, seed=seed, fit_rows=fit_rows)


def strip_block(suggest: Callable[..., list[str]], tokenizer: object, rows: np.ndarray | None, *,
                words: int, seed: int, fit_rows: np.ndarray | None = None) -> dict | None:
    """The block of `keyboard_block` for any `suggest(context, k=...)`."""
    if not words or rows is None or not len(rows):
        return None
    started = time.perf_counter()
    cases = sample_cases(rows, tokenizer, words, seed)
    if not cases:
        return None
    characters = sum(len(w) for _, w in cases)
    with progress_bar(total=characters, desc="keyboard metrics", unit="char", leave=False) as bar:
        def strip(context: str) -> list[str]:
            bar.update(1)
            return suggest(context, k=STRIP_SLOTS)

        block = {"model": _figures(keyboard_metrics(cases, strip))}
    if fit_rows is not None and len(fit_rows):
        baseline = frequent_word_strip(row_texts(fit_rows[:FIT_ROWS], *_reading(tokenizer)))
        block["most_frequent_words"] = _figures(keyboard_metrics(cases, baseline))
    return {**block, "words": len(cases), "characters": characters, "privacy": PRIVACY,
            "seconds": time.perf_counter() - started}


def _reading(tokenizer: object) -> tuple:
    """How `row_pieces` / `row_texts` read this tokenizer's rows: decode, OOV ids, whole words."""
    return (lambda ids: str(tokenizer.decode(ids)), oov_ids_of(tokenizer),
            getattr(tokenizer, "kind", "") == "word")


def _figures(metrics: dict) -> dict:
    """The rates of `keyboard_metrics` (the counts are the block's, the same for both strips)."""
    return {k: metrics[k] for k in ("top1_recall", f"top{STRIP_SLOTS}_recall", "keystroke_savings")}
