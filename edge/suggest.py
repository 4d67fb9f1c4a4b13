"""What a keyboard does with a trained model: next-token predictions and word suggestions.

`Predictor.suggest` runs the keyboard's word search (`edge.word_search`, the one the phone's
`BundleClient.suggest` runs too, so a run's keyboard figures are the phone's) with the torch
model supplying next-token logits.

The model sees what it saw in training: BOS, then the text's tokens, the last `seq_len - 1` of
them at most (training rows are BOS-prefixed windows of `seq_len` tokens). It runs in eval mode,
without gradients, on the device of its parameters; its training flag is restored after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from dpfleet.edge.model_output import logits_of
from dpfleet.edge.tokenizer import BOS
from dpfleet.edge.word_search import SPECIAL, appended, suggest_words, token_texts
from dpfleet.errors import DpfleetError


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
        self._fits: dict[tuple[str, str, bool], np.ndarray] = {}

    def probabilities(self, text: str) -> torch.Tensor:
        """The model's distribution over the vocabulary for the token after `text` ([vocab],
        float32, summing to 1; special ids included)."""
        return torch.softmax(self._next_logits([self._encode(text)])[0], dim=-1)

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
        return [(appended(decode, ids, t, base), float(probs[t])) for t in top]

    def suggest(self, text: str, k: int = 3, max_pieces: int = 8) -> list[str]:
        """Up to `k` words a keyboard would offer after `text`, likeliest first: the next word when
        `text` ends in a space or punctuation, else completions of the word being typed (matched
        case-insensitively; "I will" completes "will", "I will " gives the next word). A word is
        built from up to `max_pieces` tokens. With a tokenizer that has a `lexicon` (dpfleet's do:
        the public corpus's words), only its words are offered, fewer than `k` rather than a
        spelling nobody types."""
        k, max_pieces = _positive(k, "k"), _positive(max_pieces, "max_pieces")
        return suggest_words(
            _text(text), encode=self._encode, decode=self._decoder(), texts=self._token_texts(),
            next_logits=lambda context, beams: self._next_logits([[*context, *b] for b in beams]).numpy(),
            k=k, max_pieces=max_pieces, lexicon=getattr(self.tokenizer, "lexicon", None), fits=self._fits)

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
            vocab = int(getattr(self.tokenizer, "vocab_size", 0)) or self._next_logits([[]]).shape[-1]
            self._texts = token_texts(self._encode, self._decoder(), vocab)
        return self._texts

    def _next_logits(self, contexts: list[list[int]]) -> torch.Tensor:
        """Float32 logits [len(contexts), vocab] on the CPU of the token after each context (all of one
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
        return logits[:, -1].float().cpu()


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
