"""The DP word vocabulary as a tokenizer: the users' texts split into words, the mechanism's
selection (`mechanisms.dp_vocabulary`), a `WordTokenizer` over the kept words.

Why here and not beside the mechanism: the privacy layer (mechanisms, accounting) depends on no
tokenizer; how a text becomes words is the tokenizer's (`edge.tokenizer.split_words`), so the
engine, which builds the run's tokenizer, turns texts into words and words into a tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from dpfleet.coordinator.config import check_delta
from dpfleet.coordinator.mechanisms.dp_vocabulary import VocabularyDP, select_words
from dpfleet.edge.tokenizer import WordTokenizer, split_words
from dpfleet.errors import DpfleetError


def words_by_user(users: Iterable[Iterable[str]]) -> Iterator[list[str]]:
    """Each user's words, one user at a time (a generator over a file stays one user in memory)."""
    for texts in users:
        yield [w for t in texts for w in split_words(t)]


def build_dp_vocabulary(users: Iterable[Iterable[str]], vocab_size: int, params: VocabularyDP,
                        key: bytes | None = None, train_delta: float = 0.0) -> tuple[WordTokenizer, dict]:
    """A `WordTokenizer` over the DP-selected words of the users' texts, and the summary for the
    privacy report. A `params.delta` not below 1/N for the N users is refused (`check_delta`),
    before anything is released, and so is a sum with `train_delta` (the training's dp.delta)
    not below 1/N: the run's guarantee is stated at the sum of the two."""
    counted = [0]

    def each_user() -> Iterator[Iterable[str]]:
        for texts in users:
            counted[0] += 1
            yield texts

    kept, info = select_words(words_by_user(each_user()), vocab_size, params, key)
    # the same rule as dp.delta's: at delta_vocab >= 1/N a word only one user holds may be kept
    check_delta(params.delta, counted[0], "tokenizer.dp_delta")
    if train_delta:
        check_delta(params.delta + train_delta, counted[0], "dp.delta + tokenizer.dp_delta")
    if not kept:
        raise DpfleetError(
            f"the DP vocabulary kept no word: no word's noisy user count passed the threshold "
            f"{info['threshold']:.3g} (in units of 1/sqrt(k)); lower tokenizer.dp_noise, raise "
            "tokenizer.dp_delta, or use the public SentencePiece tokenizer")
    return WordTokenizer(kept), info
