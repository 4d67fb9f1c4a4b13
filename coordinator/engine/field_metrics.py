"""The field's next-word metrics, computed the field's way, so a result can sit next to a paper's.

* TFF's three next-word-prediction accuracies (TFF `simulation/baselines/stackoverflow/
  word_prediction_tasks.py`, `keras_metrics.MaskedCategoricalAccuracy`): the fraction of target
  positions whose argmax prediction equals the target, over the positions left after masking
  targets that are PAD (`accuracy`), PAD or any OOV bucket (`accuracy_without_out_of_vocab`), or
  PAD, any OOV bucket or EOS (`accuracy_without_out_of_vocab_or_end_of_sentence`, what the DP-FTRL
  and matrix-factorization papers report). BOS is never a target in TFF's rows, so none masks it.
  Predicting an OOV id or EOS is simply a wrong prediction in the last two.
* Top-1 / top-3 recall of a three-slot suggestion strip (Hard et al. 2018, "Federated Learning
  for Mobile Keyboard Prediction"): over held-out words, the fraction that is the strip's first
  word / any of its words when the strip is shown after the words before it.
* Keystroke savings: the fraction of the held-out words' characters a user need not type when
  they tap the word as soon as it appears in the strip (shown after the previous words, then
  after each typed prefix). Tapping is not counted as a keystroke, nor are spaces.

Every count is kept as (correct, scored) so batches and clients add up before one division.
The held-out words a run scores the strip on are read off its token rows (`row_pieces`,
`text_cases`), and `frequent_word_strip` is the most-frequent-word baseline strip
(`keyboard_eval` puts them together at a run's end).
"""

from __future__ import annotations

import collections
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dpfleet.edge.lexicon import is_word
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK

TFF_ACCURACIES = ("accuracy", "accuracy_without_out_of_vocab",
                  "accuracy_without_out_of_vocab_or_end_of_sentence")
STRIP_SLOTS = 3  # a keyboard's suggestion strip


def tff_masks(targets: np.ndarray, oov_ids: Sequence[int] = (UNK,)) -> np.ndarray:
    """[3, *targets.shape] booleans: the positions each of TFF's three accuracies scores."""
    targets = np.asarray(targets)
    nonpad = targets != PAD
    in_vocab = nonpad & ~np.isin(targets, list(oov_ids))
    return np.stack([nonpad, in_vocab, in_vocab & (targets != EOS)])


def tff_counts(predictions: np.ndarray, targets: np.ndarray,
               oov_ids: Sequence[int] = (UNK,)) -> np.ndarray:
    """[3, 2] int64: (correct, scored) of TFF's three accuracies for argmax `predictions`."""
    masks = tff_masks(targets, oov_ids)
    hits = masks & (np.asarray(predictions) == np.asarray(targets))
    return np.stack([hits.reshape(3, -1).sum(1), masks.reshape(3, -1).sum(1)], axis=1).astype(np.int64)


def tff_accuracies(counts: np.ndarray, prefix: str = "tff_") -> dict[str, float | None]:
    """{prefix + name: correct / scored} of `tff_counts` (None when nothing was scored)."""
    return {prefix + name: (int(c) / int(s) if s else None)
            for name, (c, s) in zip(TFF_ACCURACIES, np.asarray(counts), strict=True)}


def finite_number(value: object) -> float | None:
    """A finite number, else None (an edited file's text, NaN, a bool)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    # compared, not math.isfinite, which raises on an int beyond float range (run_record refuses
    # such a file before compare reads it)
    return value if number and -math.inf < value < math.inf else None


def tff_figures(evaluation: object, baseline: object) -> dict[str, dict[str, float | None]]:
    """TFF's three accuracies of a model and of the two constant baselines, as `dpfleet compare`,
    the result block and the status page show them: {"model" | "unigram" | "most_frequent_word":
    {name: value}}. `evaluation` is an evaluation or a metrics record (its `tff_` keys),
    `baseline` what `unigram_baseline` returns (its `tff` block). The shape is always the same so a
    reader need not test for it; a figure the run does not have (a run of an older dpfleet, an
    unfinished run's baselines, nothing scored) or that is no finite number is None."""
    def named(figures: object, prefix: str = "") -> dict[str, float | None]:
        figures = figures if isinstance(figures, Mapping) else {}
        return {name: finite_number(figures.get(prefix + name)) for name in TFF_ACCURACIES}

    constants = baseline.get("tff") if isinstance(baseline, Mapping) else None
    constants = constants if isinstance(constants, Mapping) else {}
    return {"model": named(evaluation, "tff_"), "unigram": named(constants.get("unigram")),
            "most_frequent_word": named(constants.get("most_frequent_word"))}


def last_evaluated(metrics: Sequence[Mapping]) -> Mapping:
    """The last metrics record with TFF's accuracies ({} before any evaluated round, and for a
    run of an older dpfleet): the released model's figures while a run goes on."""
    return next((m for m in reversed(metrics) if m.get("tff_accuracy") is not None), {})


def constant_baselines(train_targets: Iterable[np.ndarray], test_targets: np.ndarray,
                       oov_ids: Sequence[int] = (UNK,)) -> dict[str, dict]:
    """TFF's three accuracies of the two baselines that always predict one token:
    `unigram`, the most frequent non-PAD training target (the argmax of the unigram model, which
    may be EOS or an OOV bucket), and `most_frequent_word`, the most frequent training target
    that is a word (not PAD, BOS, EOS nor OOV). Ties go to the smaller id."""
    counts: dict[int, int] = {}
    for targets in train_targets:
        ids, n = np.unique(np.asarray(targets), return_counts=True)
        for i, c in zip(ids.tolist(), n.tolist(), strict=True):
            counts[i] = counts.get(i, 0) + c
    special = {PAD, BOS, EOS, *oov_ids}
    out = {}
    rules = (("unigram", lambda i: i != PAD), ("most_frequent_word", lambda i: i not in special))
    for name, allowed in rules:
        pool = {i: c for i, c in counts.items() if allowed(i)}
        if not pool:
            continue
        token = min(pool, key=lambda i: (-pool[i], i))
        predictions = np.full_like(np.asarray(test_targets), token)
        out[name] = {"token": int(token),
                     **tff_accuracies(tff_counts(predictions, test_targets, oov_ids), prefix="")}
    return out


def strip_recall(cases: Iterable[tuple[str, str]], suggest: Callable[[str], list[str]],
                 slots: int = STRIP_SLOTS) -> dict[str, float | int | None]:
    """Top-1 and top-`slots` recall of the strip `suggest(context)` over (context, word) cases:
    the context is the text before the word (ending in a space, or empty), the word what the user
    typed next. Words are compared without regard to case."""
    top1 = topk = words = 0
    for context, word in cases:
        strip = [s.casefold() for s in suggest(context)[:slots]]
        words += 1
        top1 += bool(strip) and strip[0] == word.casefold()
        topk += word.casefold() in strip
    return {"top1_recall": top1 / words if words else None,
            f"top{slots}_recall": topk / words if words else None, "words": words}


def keystroke_savings(cases: Iterable[tuple[str, str]], suggest: Callable[[str], list[str]],
                      slots: int = STRIP_SLOTS) -> dict[str, float | int | None]:
    """The fraction of the words' characters saved when each word is tapped as soon as the strip
    offers it: the strip is asked after `context`, then after each prefix of the word typed so
    far; a word first offered after i typed characters saves len(word) - i, one never offered
    saves 0."""
    saved = typed = 0
    for context, word in cases:
        typed += len(word)
        target = word.casefold()
        for i in range(len(word)):
            if target in (s.casefold() for s in suggest(context + word[:i])[:slots]):
                saved += len(word) - i
                break
    return {"keystroke_savings": saved / typed if typed else None, "characters": typed,
            "characters_saved": saved}


def word_cases(texts: Iterable[str], split: Callable[[str], list[str]], limit: int) -> list[tuple[str, str]]:
    """Up to `limit` (context, word) cases from held-out texts: each word (punctuation is not one:
    a strip offers words) with the units before it in its text joined by spaces (so a word-level
    suggest sees the same units it encodes)."""
    cases: list[tuple[str, str]] = []
    for text in texts:
        words = split(text)
        for n, word in enumerate(words):
            if len(cases) >= limit:
                return cases
            if is_word(word):
                    cases.append(("".join(f"{w} " for w in words[:n]), word))
    return cases


_TYPED = re.compile(r"[\w'’-]*\Z")  # the word being typed at the end of a context (edge.suggest's rule)
_UNIT = re.compile(r"[\w'’-]+")


def row_pieces(row: np.ndarray, decode: Callable[[list[int]], str], oov_ids: Sequence[int] = (UNK,),
               whole_words: bool = False) -> list[tuple[str, int, int]]:
    """The texts of one held-out row [seq_len + 1]: its tokens after BOS up to its first PAD, cut at
    EOS (a text ended) and at OOV ids (a word the vocabulary lacks: no strip can offer it, and its
    placeholder is no word), each piece decoded, as (text, first, end): its units (`_UNIT`) from
    index `first` up to `end` are whole words. A row is a window of a longer text, so unless each
    token is a whole word (`whole_words`: a word vocabulary) the row's first unit may be a word's
    tail and, in a full row, its last unit a word's head: neither counts (both stay as context)."""
    ids = [int(i) for i in np.asarray(row)[1:]]
    full = PAD not in ids
    ids = ids if full else ids[: ids.index(PAD)]
    cuts, pieces = {EOS, *oov_ids}, [[]]
    for i in ids:
        if i in cuts:
            pieces.append([])
        elif i != BOS:
            pieces[-1].append(i)
    out = []
    for n, piece in enumerate(pieces):
        text = decode(piece) if piece else ""
        units = len(_UNIT.findall(text))
        first = int(n == 0 and not whole_words)
        end = units - int(n == len(pieces) - 1 and full and not whole_words)
        if end > first:
            out.append((text, first, end))
    return out


def row_texts(rows: np.ndarray, decode: Callable[[list[int]], str], oov_ids: Sequence[int] = (UNK,),
              whole_words: bool = False) -> list[str]:
    """The whole-word text of held-out rows (`row_pieces`, a cut word's part left out), to count."""
    texts = []
    for row in rows:
        for text, first, end in row_pieces(row, decode, oov_ids, whole_words):
            units = list(_UNIT.finditer(text))
            texts.append(text[units[first].start(): units[end - 1].end()])
    return texts


def text_cases(pieces: Iterable[tuple[str, int, int]], limit: int) -> list[tuple[str, str]]:
    """Up to `limit` (context, word) cases from held-out texts as a keyboard meets them: each whole
    word of each (text, first, end) of `row_pieces` (the lexicon's rule, `edge.lexicon.is_word`:
    punctuation and numbers are no word) with the text before it, as typed (case and punctuation
    kept, so a subword model sees what it was trained on)."""
    cases: list[tuple[str, str]] = []
    for text, first, end in pieces:
        for n, match in enumerate(_UNIT.finditer(text)):
            if len(cases) >= limit:
                return cases
            if first <= n < end and is_word(match.group()):
                cases.append((text[: match.start()], match.group()))
    return cases


def frequent_word_strip(texts: Iterable[str], slots: int = STRIP_SLOTS) -> Callable[[str], list[str]]:
    """The most-frequent-word strip (the unigram model's suggestions): after a context, the
    `slots` words of `texts` seen most often (case folded; ties in alphabetical order) that start
    with the word being typed; with nothing typed, the `slots` most frequent words."""
    counts = collections.Counter(w.casefold() for text in texts for w in _UNIT.findall(text) if is_word(w))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))

    @functools.lru_cache(maxsize=4096)
    def strip(typed: str) -> tuple[str, ...]:
        return tuple(w for w in ranked if w.startswith(typed))[:slots]

    return lambda context: list(strip(_TYPED.search(context).group().casefold()))


def keyboard_metrics(cases: Sequence[tuple[str, str]], suggest: Callable[[str], list[str]],
                     slots: int = STRIP_SLOTS) -> dict[str, float | int | None]:
    """Top-1 / top-`slots` recall (`strip_recall`) and keystroke savings (`keystroke_savings`) of
    one strip on the same cases; each context's strip is asked once (both metrics ask it before
    each word)."""
    asked = functools.lru_cache(maxsize=None)(lambda context: tuple(suggest(context)))
    strip = lambda context: list(asked(context))  # noqa: E731
    return {**strip_recall(cases, strip, slots), **keystroke_savings(cases, strip, slots)}
