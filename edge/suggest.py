"""What a keyboard does with a trained model: next-token predictions and word suggestions.

A keyboard shows a few words after what was typed: the next word, or the completion of the word
being typed. The model predicts *tokens*, which in a subword vocabulary are pieces of words, so
`Predictor.suggest` searches over tokens (a small beam search) until each candidate word ends (the
next token starts a new word, is punctuation or ends the text) and ranks whole words by their
probability; a word being typed constrains the search to words that start with it (the typed
piece is not fed to the model, whose tokenization of a word's start differs from the word's).
Word boundaries are read off the tokenizer's own `decode`, in context, so SentencePiece,
word-level and character-level vocabularies all work.

The model sees what it saw in training: BOS, then the text's tokens, the last `seq_len - 1` of
them at most (training rows are BOS-prefixed windows of `seq_len` tokens). It runs in eval mode,
without gradients, on the device of its parameters; its training flag is restored after.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dpfleet.edge.model_output import logits_of
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK
from dpfleet.errors import DpfleetError

SPECIAL = (PAD, BOS, EOS, UNK)
FIT_CACHE = 4096  # the masks a predictor keeps (each [vocab] booleans)
_WORD = re.compile(r"[\w'’-]*")
_TYPED = re.compile(r"[\w'’-]*\Z")


@dataclass(frozen=True)
class _Beam:
    ids: tuple[int, ...]  # tokens generated after the context
    word: str  # the word they spell so far ("" before its first letter)
    need_space: bool  # the next token must start with whitespace to start a new word
    logp: float


class Predictor:
    """`model` (token ids [batch, time] -> logits [batch, time, vocab]) with the `tokenizer` it was
    trained with (`encode`, and `decode` for text out); `seq_len`: the training window."""

    def __init__(self, model: nn.Module, tokenizer: object, seq_len: int | None = None):
        if not callable(getattr(tokenizer, "encode", None)):
            raise DpfleetError(f"tokenizer {type(tokenizer).__name__} has no encode(str) -> list[int]")
        self.model, self.tokenizer = model, tokenizer
        self.seq_len = seq_len if seq_len and seq_len > 1 else None
        self._texts: list[str] | None = None
        # (typed, word so far, needs a space) -> which tokens may follow: the same few keys recur
        # across calls (a keyboard asks after every typed letter), and each costs a pass over the
        # vocabulary in Python
        self._fits: dict[tuple[str, str, bool], torch.Tensor] = {}

    def probabilities(self, text: str) -> torch.Tensor:
        """The model's distribution over the vocabulary for the token after `text` ([vocab],
        float32, summing to 1; special ids included)."""
        return self._next_log_probs([self._encode(text)])[0].exp()

    def predict(self, text: str, k: int = 5) -> list[tuple[str, float]]:
        """The `k` likeliest next tokens after `text` as (the text each appends, probability),
        likeliest first; a token that starts a new word appends a leading space. Special tokens
        (PAD, BOS, EOS, UNK) are left out; the probabilities are the full distribution's."""
        k = _positive(k, "k")
        decode = self._decoder()
        ids = self._encode(text)
        probs = self.probabilities(text)
        ranked = probs.clone()
        ranked[list(SPECIAL)] = -1.0
        top = torch.topk(ranked, min(k, probs.numel() - len(SPECIAL))).indices.tolist()
        if not ids:  # at the start of a text: each token's text after a word, a word start's space shown
            return [(self._token_texts()[t], float(probs[t])) for t in top]
        base = decode(ids)
        return [(_appended(decode, ids, t, base), float(probs[t])) for t in top]

    def suggest(self, text: str, k: int = 3, max_pieces: int = 8) -> list[str]:
        """Up to `k` words a keyboard would offer after `text`, likeliest first: the next word when
        `text` ends in a space or punctuation, else completions of the word being typed (matched
        case-insensitively; "I will" completes "will", "I will " gives the next word). A word is
        built from up to `max_pieces` tokens. With a tokenizer that has a `lexicon` (dpfleet's do:
        the public corpus's words), only its words are offered, fewer than `k` rather than a
        spelling nobody types."""
        k, max_pieces = _positive(k, "k"), _positive(max_pieces, "max_pieces")
        _text(text)
        texts = self._token_texts()
        typed = _TYPED.search(text).group()
        context = self._encode(text[: len(text) - len(typed)])
        head = self._decoder()(context)
        if len(self._fits) > FIT_CACHE:
            self._fits.clear()
        search = _WordSearch(typed.casefold(), k, texts, getattr(self.tokenizer, "lexicon", None), self._fits)
        # at the very start a word needs no space (the token texts are read after an anchor word)
        beams = [_Beam((), "", not head or not head[-1].isspace(), 0.0)]
        for _ in range(max_pieces):
            rows = self._next_log_probs([[*context, *b.ids] for b in beams])
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

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(_text(text))]

    def _decoder(self):
        decode = getattr(self.tokenizer, "decode", None)
        if not callable(decode):
            raise DpfleetError(f"tokenizer {type(self.tokenizer).__name__} has no decode(ids) -> str, which "
                               "predict and suggest need to turn token ids into text (probabilities "
                               "needs only encode)")
        return lambda ids: str(decode(list(ids)))

    def _token_texts(self) -> list[str]:
        """What each token appends after a word (read once per predictor): a word start shows its
        leading space (SentencePiece drops it at the start of a text); special ids give ""."""
        if self._texts is None:
            decode = self._decoder()
            anchor = self._encode("a")[:1]
            base = decode(anchor)
            vocab = int(getattr(self.tokenizer, "vocab_size", 0)) or self._next_log_probs([[]]).shape[-1]
            self._texts = ["" if t in SPECIAL else _appended(decode, anchor, t, base) for t in range(vocab)]
        return self._texts

    def _next_log_probs(self, contexts: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [len(contexts), vocab] of the token after each context (all of one
        length), the model seeing BOS + the last seq_len - 1 tokens of each."""
        keep = None if self.seq_len is None else self.seq_len - 1
        windows = torch.tensor([[BOS, *(c[-keep:] if keep and len(c) > keep else c)] for c in contexts],
                               dtype=torch.int64)
        with _inference(self.model) as device:
            logits = logits_of(self.model(windows.to(device)))
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != windows.shape:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise DpfleetError(f"the model must map ids [batch, time] to logits [batch, time, vocab]; "
                               f"got {shape} for {tuple(windows.shape)}")
        return torch.log_softmax(logits[:, -1].float().cpu(), dim=-1)


class _WordSearch:
    """The words found so far (probabilities summed over the token paths and boundaries that spell
    them) and the rules that grow a beam by one token (`texts`: what each token appends). With a
    `lexicon` (`edge.lexicon`), a spelling outside it is never a word found."""

    def __init__(self, typed: str, k: int, texts: list[str], lexicon=None,
                 fits: dict[tuple[str, str, bool], torch.Tensor] | None = None):
        self.typed, self.k, self.texts, self.lexicon = typed, k, texts, lexicon
        self.fits = {} if fits is None else fits  # the predictor's cache of `candidates`' masks
        self.width, self.beams = max(4 * k, 16), max(2 * k, 4)  # tokens tried per beam, beams kept
        self.found: dict[str, float] = {}

    def candidates(self, beam: _Beam, row: torch.Tensor) -> list[int]:
        """The likeliest tokens to follow `beam` (EOS among them); while its word is shorter than
        what was typed, only tokens that keep it a completion of that."""
        row = row.clone()
        row[[PAD, BOS, UNK]] = -math.inf
        if len(beam.word) < len(self.typed):
            key = (self.typed, beam.word, beam.need_space)  # all `_step`'s answer depends on
            fit = self.fits.get(key)
            if fit is None:
                fit = torch.tensor([self._step(beam, text) is not None for text in self.texts])
                self.fits[key] = fit
            row[~fit[: row.numel()]] = -math.inf
        top = torch.topk(row, min(self.width, row.numel()))
        return [t for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True) if v > -math.inf]

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


def _appended(decode, ids: list[int], token: int, base: str) -> str:
    """The text `token` adds after `ids` (whose text is `base`), read off the decoder in context:
    a SentencePiece word start shows its space only after other text."""
    full = decode([*ids, token])
    return full[len(base):] if full.startswith(base) else decode([token])


def _text(text: object) -> str:
    if not isinstance(text, str):
        raise DpfleetError(f"text must be a str, not {type(text).__name__}")
    return text


def _positive(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DpfleetError(f"{name} must be a positive int, got {value!r}")
    return value


@contextlib.contextmanager
def _inference(model: nn.Module) -> Iterator[torch.device]:
    """`model` in eval mode without gradients (its training flag restored after), yielding the
    device its parameters are on."""
    training = model.training
    param = next(model.parameters(), None)
    model.eval()
    try:
        with torch.no_grad():
            yield param.device if param is not None else torch.device("cpu")
    finally:
        model.train(training)
