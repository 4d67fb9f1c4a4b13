"""The keyboard's word search, one for the Python `Predictor` and the phone's `BundleClient`.

A keyboard shows a few words after what was typed: the next word, or the completion of the word
being typed. The model predicts *tokens*, which in a subword vocabulary are pieces of words, so
`suggest_words` searches over tokens (a small beam search) until each candidate word ends (the
next token starts a new word, is punctuation or ends the text) and ranks whole words by their
probability; a word being typed constrains the search to words that start with it (the typed
piece is not fed to the model, whose tokenization of a word's start differs from the word's).
Word boundaries are read off the tokenizer's own `decode`, in context, so SentencePiece,
word-level and character-level vocabularies all work.

Why one module, without torch: the figures a run reports (strip recall, keystroke savings) are
meant to be those of the phone's `suggest`, and the phone's client runs on numpy alone. Both
callers hand `suggest_words` a function giving next-token logits for a batch of candidates (the
torch model, or the bundle's step / window programs) and share everything else, so the same
model gives the same strip on both (up to the runtimes' float differences deciding a near-tie).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK

SPECIAL = (PAD, BOS, EOS, UNK)
FIT_CACHE = 4096  # the masks a caller's cache keeps (each [vocab] booleans)
_WORD = re.compile(r"[\w'’-]*")
_TYPED = re.compile(r"[\w'’-]*\Z")

# (context ids, the candidates' tokens after it, all of one length) -> next-token logits [n, vocab]
NextLogits = Callable[[list[int], list[tuple[int, ...]]], np.ndarray]


@dataclass(frozen=True)
class _Beam:
    ids: tuple[int, ...]  # tokens generated after the context
    word: str  # the word they spell so far ("" before its first letter)
    need_space: bool  # the next token must start with whitespace to start a new word
    logp: float


def typed_word(text: str) -> str:
    """The word being typed at the end of `text` ("" after a space or punctuation)."""
    return _TYPED.search(text).group()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, in float64 (both callers' logits are float32)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_texts(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                vocab: int) -> list[str]:
    """What each of `vocab` tokens appends after a word: a word start shows its leading space
    (SentencePiece drops it at the start of a text); special ids give ""."""
    anchor = encode("a")[:1]
    base = decode(anchor)
    return ["" if t in SPECIAL else appended(decode, anchor, t, base) for t in range(vocab)]


def appended(decode, ids: list[int], token: int, base: str) -> str:
    """The text `token` adds after `ids` (whose text is `base`), read off the decoder in context:
    a SentencePiece word start shows its space only after other text."""
    full = decode([*ids, token])
    return full[len(base):] if full.startswith(base) else decode([token])


def suggest_words(text: str, *, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                  texts: Sequence[str], next_logits: NextLogits, k: int, max_pieces: int, lexicon=None,
                  fits: dict | None = None) -> list[str]:
    """Up to `k` words after `text`, likeliest first (`Predictor.suggest` states the rules);
    `texts`: `token_texts` of the vocabulary; `fits`: the caller's cache of candidate masks."""
    typed = typed_word(text)
    context = [int(i) for i in encode(text[: len(text) - len(typed)])]
    head = decode(context)
    if fits is not None and len(fits) > FIT_CACHE:
        fits.clear()
    search = _WordSearch(typed.casefold(), k, texts, lexicon, fits)
    # at the very start a word needs no space (the token texts are read after an anchor word)
    beams = [_Beam((), "", not head or not head[-1].isspace(), 0.0)]
    for _ in range(max_pieces):
        rows = log_softmax(next_logits(context, [b.ids for b in beams]))
        grown = []
        for beam, row in zip(beams, rows, strict=True):
            for token in search.candidates(beam, row):
                score = beam.logp + float(row[token])
                if token == EOS:
                    search.finish(beam.word, score)
                else:
                    grown += search.extend(beam, token, score)
        beams = sorted(grown, key=lambda b: -b.logp)[: search.beams]
        if not beams or search.settled(beams[0].logp):
            break
    for beam in beams:  # words longer than max_pieces: what was spelled, at its probability so far
        search.finish(beam.word, beam.logp)
    return search.best()


class _WordSearch:
    """The words found so far (probabilities summed over the token paths and boundaries that spell
    them) and the rules that grow a beam by one token (`texts`: what each token appends). With a
    `lexicon` (`edge.lexicon`), a spelling outside it is never a word found."""

    def __init__(self, typed: str, k: int, texts: Sequence[str], lexicon=None,
                 fits: dict[tuple[str, str, bool], np.ndarray] | None = None):
        self.typed, self.k, self.texts, self.lexicon = typed, k, texts, lexicon
        self.fits = {} if fits is None else fits
        self.width, self.beams = max(4 * k, 16), max(2 * k, 4)  # tokens tried per beam, beams kept
        self.found: dict[str, float] = {}

    def candidates(self, beam: _Beam, row: np.ndarray) -> list[int]:
        """The likeliest tokens to follow `beam` (EOS among them); while its word is shorter than
        what was typed, only tokens that keep it a completion of that. Rows past the vocabulary
        (a model's spare rows) are never candidates."""
        row = row.copy()
        row[[PAD, BOS, UNK]] = -math.inf
        row[len(self.texts):] = -math.inf
        if len(beam.word) < len(self.typed):
            key = (self.typed, beam.word, beam.need_space)  # all `_step`'s answer depends on
            fit = self.fits.get(key)
            if fit is None:
                fit = np.array([self._step(beam, text) is not None for text in self.texts], dtype=bool)
                self.fits[key] = fit
            n = min(len(fit), row.size)
            row[:n][~fit[:n]] = -math.inf
        width = min(self.width, row.size)
        top = np.argpartition(-row, width - 1)[:width]
        top = top[np.lexsort((top, -row[top]))]  # likeliest first, ties by id
        return [int(t) for t in top if row[t] > -math.inf]

    def finish(self, word: str, logp: float) -> None:
        if word and word.casefold().startswith(self.typed) and (self.lexicon is None or word in self.lexicon):
            old = self.found.get(word, -math.inf)
            self.found[word] = max(old, logp) + math.log1p(math.exp(-abs(old - logp)))

    def extend(self, beam: _Beam, token: int, logp: float) -> list[_Beam]:
        """`beam` followed by `token`: a longer beam, or none (the word ended here and is
        finished, or the token cannot continue it)."""
        step = self._step(beam, self.texts[token])
        if step is None:
            return []
        word, done = step
        if done:
            self.finish(word, logp)
            return []
        return [_Beam((*beam.ids, token), word, False, logp)]

    def _step(self, beam: _Beam, text: str) -> tuple[str, bool] | None:
        """(the word after a token appending `text`, whether that word is complete), or None when
        the token cannot follow (it would glue onto the previous word, starts with punctuation,
        or leaves what was typed)."""
        if not text:
            return None
        if beam.word:
            piece = _WORD.match(text).group()
            if not piece:  # whitespace or punctuation: the word ended before this token
                return beam.word, True
            word = beam.word + piece
        else:
            if beam.need_space and not text[0].isspace():
                return None
            text = text.lstrip()
            if not text:  # a lone space token: the word starts after it
                return "", False
            piece = _WORD.match(text).group()
            if not piece:  # punctuation is not a word
                return None
            word = piece
        folded = word.casefold()
        if not (folded.startswith(self.typed) or self.typed.startswith(folded)):
            return None
        return word, len(piece) < len(text)  # a token ending in punctuation or a space completes it

    def settled(self, best_open: float) -> bool:
        """No open beam can beat the k-th word found (a beam's probability only falls)."""
        return len(self.found) >= self.k and sorted(self.found.values())[-self.k] >= best_open

    def best(self) -> list[str]:
        """The k likeliest words, spellings that differ only in case counted as one word (shown in
        its likeliest casing)."""
        merged: dict[str, tuple[float, float, str]] = {}  # folded -> (total logp, best logp, spelling)
        for word, logp in self.found.items():
            total, top, shown = merged.get(word.casefold(), (-math.inf, -math.inf, word))
            total = max(total, logp) + math.log1p(math.exp(-abs(total - logp)))
            merged[word.casefold()] = (total, *max((top, shown), (logp, word)))
        ranked = sorted(merged.values(), key=lambda v: (-v[0], v[2]))
        return [shown for _, _, shown in ranked[: self.k]]
