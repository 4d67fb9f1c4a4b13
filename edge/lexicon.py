"""The words a keyboard may suggest: a lexicon carried with the tokenizer.

Why: a subword model spells whatever its pieces can join, and a beam over pieces finishes
"brotheron" as readily as "brother". A keyboard's strip shows words a person could have typed,
so suggestions are kept to a word list and the strip shows fewer than k words rather than a
non-word. The list is public: the words of the public corpus a SentencePiece model was trained on
(seen at least `MIN_COUNT` times), or a word tokenizer's own vocabulary. It is saved beside the
tokenizer (`words.txt`, one word a line, likeliest first), so a checkpoint and a phone bundle
carry it with the tokenizer they already ship.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

LEXICON_FILE = "words.txt"
MIN_COUNT = 2  # a word seen once in a corpus is as likely a typo as a word
MAX_WORDS = 200_000
# starts with a letter that no apostrophe precedes (WikiText's "Wikipedia 's" has no word "s"),
# ends with a letter or digit; apostrophes and hyphens inside
_WORD = re.compile(r"(?<![\w'’])[^\W\d_](?:[\w'’-]*\w)?")


class Lexicon:
    """A set of words, matched without regard to case."""

    def __init__(self, words: Iterable[str]):
        self.words = list(dict.fromkeys(words))  # the saved order (likeliest first), no repeats
        self._folded = frozenset(w.casefold() for w in self.words)

    @classmethod
    def from_texts(cls, texts: Iterable[str], min_count: int = MIN_COUNT,
                   max_words: int = MAX_WORDS) -> Lexicon:
        """The words of `texts` seen at least `min_count` times (case folded), most frequent first."""
        counts = collections.Counter(w.casefold() for text in texts for w in _WORD.findall(text))
        ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls(ranked[:max_words])

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and word.casefold() in self._folded

    def __len__(self) -> int:
        return len(self.words)

    def to_text(self) -> str:
        return "".join(f"{w}\n" for w in self.words)

    @classmethod
    def from_text(cls, text: str) -> Lexicon:
        return cls(line.strip() for line in text.splitlines() if line.strip())


def is_word(text: str) -> bool:
    """Whether `text` is one word by the lexicon's rule (a word tokenizer's punctuation is not)."""
    return _WORD.fullmatch(text) is not None
