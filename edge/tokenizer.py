"""One interface over the two vocabularies the papers compare.

* `SentencePieceTokenizer`: a public subword model (trained on public text, or taken from a public
  LLM teacher). Byte fallback means no out-of-vocabulary token ever appears.
* `WordTokenizer`: the papers' baseline, the top-k words of the *private* data plus an OOV token
  (building it from private data is itself a privacy cost the public tokenizer avoids), or, as
  TFF's StackOverflow task builds it, the top words of a *public* word-count file or a word list
  the user gives (`from_word_counts`, `from_word_list`), with any number of OOV hash buckets.
* `CharTokenizer`: TFF Shakespeare's next-character vocabulary (its 86 characters + OOV).

All reserve ids 0..3 for pad / bos / eos / unk so models, losses and metrics can treat them alike.
A word vocabulary with N OOV buckets uses ids 3 .. 3+N-1 for them (`oov_ids`; bucket 0 is unk),
and its words follow. TFF numbers the same tokens differently (pad 0, words from 1, then the OOV
buckets, BOS, EOS); the sets, the hashing and so the metrics are the same.
A tokenizer is saved as a folder holding `tokenizer.json` (kind + metadata) and its model file.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from dpfleet.edge.data_tff_sql import TFF_DOWNLOADS
from dpfleet.edge.lexicon import LEXICON_FILE, Lexicon, is_word
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import write_json

PAD, BOS, EOS, UNK = 0, 1, 2, 3
_WORD_RE = re.compile(r"[\w']+|[^\w\s]")
SPLITS = ("words", "tff")
# TFF Shakespeare's character set (char_prediction_preprocessing.CHAR_VOCAB, from the "Federated
# Learning for Text Generation" tutorial), in TFF's order
TFF_CHARS = ('dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)-159'
             '\r')


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, folder: Path) -> Path: ...


class _SpecialIds:
    pad_id = PAD
    bos_id = BOS
    eos_id = EOS
    unk_id = UNK


class SentencePieceTokenizer(_SpecialIds):
    """A SentencePiece model with pad=0, bos=1, eos=2, unk=3."""

    kind = "sentencepiece"

    def __init__(self, model_file: Path | None = None, *, model_proto: bytes | None = None,
                 lexicon: Lexicon | None = None):
        """From a `.model` file, or from its bytes (`model_proto`: bytes the caller has already
        verified, so nothing is re-read from disk). `lexicon`: the words suggestions are kept to
        (`edge.lexicon`; the public corpus's words), saved and shipped with the model."""
        import sentencepiece as spm

        self.lexicon = lexicon
        self.model_file = None if model_file is None else Path(model_file)
        self._proto = model_proto
        origin = self.model_file or "SentencePiece model"
        if model_proto is None:
            if self.model_file is None or not self.model_file.is_file():
                raise DpfleetError(f"SentencePiece model not found: {self.model_file}")
            model_proto = self.model_file.read_bytes()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except (RuntimeError, OSError, TypeError) as exc:  # a damaged file fails to parse here
            raise DpfleetError(f"{origin}: not a valid SentencePiece model ({exc})") from exc
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD, BOS, EOS, UNK):
            raise DpfleetError(
                f"{origin}: expected pad/bos/eos/unk ids 0/1/2/3, got {ids}; "
                "train it with dpfleet's train_sentencepiece or remap it"
            )
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / "spm.model"
        if self.model_file is None or target.resolve() != self.model_file.resolve():
            target.write_bytes(self._sp.serialized_model_proto())
        meta = {"kind": self.kind, "model_file": "spm.model", "vocab_size": self.vocab_size}
        if self.lexicon is not None:
            (folder / LEXICON_FILE).write_text(self.lexicon.to_text())
            meta["lexicon"] = LEXICON_FILE
        write_json(folder / "tokenizer.json", meta, indent=2)
        return folder


def train_sentencepiece(
    lines: Iterable[str], out_prefix: Path, vocab_size: int, model_type: str = "unigram"
) -> SentencePieceTokenizer:
    """Train a byte-fallback SentencePiece model on (public) text lines."""
    import sentencepiece as spm

    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    try:
        _train(spm, lines, out_prefix, vocab_size, model_type)
    except RuntimeError as exc:  # e.g. vocab smaller than bytes + required characters
        raise DpfleetError(f"SentencePiece training failed: {str(exc).splitlines()[-1]}") from exc
    return SentencePieceTokenizer(out_prefix.with_suffix(".model"))


def _train(spm, lines: Iterable[str], out_prefix: Path, vocab_size: int, model_type: str) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(out_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=0.9995,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        unk_id=UNK,
        input_sentence_size=200_000,
        shuffle_input_sentence=True,
        num_threads=2,
        minloglevel=2,
    )


def split_words(text: str, split: str = "words") -> list[str]:
    """A text's units. "words": lower-cased words and punctuation marks (dpfleet's word-level
    baseline). "tff": TFF StackOverflow's way, lower-cased and split on single spaces (its
    `tokens` field is already tokenized, so `tf.strings.split(sep=' ')` is all it does; two
    spaces make an empty word, which is OOV, as in TFF)."""
    if split == "tff":
        return text.lower().split(" ") if text else []
    return _WORD_RE.findall(text.lower())


def oov_ids_of(tokenizer: object) -> tuple[int, ...]:
    """The ids a tokenizer gives unknown text: its OOV buckets, else unk alone (SentencePiece's
    byte fallback and a caller's own tokenizer)."""
    return tuple(getattr(tokenizer, "oov_ids", (UNK,)))


def oov_bucket(word: str, buckets: int) -> int:
    """The OOV bucket of `word`, TFF's way: `tf.lookup.StaticVocabularyTable` hashes an unknown
    key with `tf.strings.to_hash_bucket_fast`, FarmHash Fingerprint64 of its UTF-8 bytes modulo
    the number of buckets (so a word falls in the same bucket as in a TFF run)."""
    if buckets == 1:
        return 0
    import farmhash  # pyfarmhash: Google's FarmHash, the Fingerprint64 TensorFlow uses

    return farmhash.fingerprint64(word) % buckets


class WordTokenizer(_SpecialIds):
    """Top-k words plus OOV bucket(s): of the private clients (paper 000's word-level baseline,
    chosen with DP or outside the guarantee), or of a public word-count file or word list."""

    kind = "word"

    def __init__(self, words: list[str], oov_buckets: int = 1, split: str = "words",
                 source: str = ""):
        """`oov_buckets` N: unknown words are hashed into ids 3 .. 3+N-1 (`oov_bucket`). `split`:
        how text becomes words (`split_words`). `source`: where the words came from, for the
        privacy report ("" when they are the private clients')."""
        if oov_buckets < 1:
            raise DpfleetError(f"oov_buckets must be >= 1, got {oov_buckets}")
        if split not in SPLITS:
            raise DpfleetError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.oov_buckets, self.split, self.source = oov_buckets, split, source
        self.oov_ids = tuple(range(UNK, UNK + oov_buckets))
        extra = [f"<unk{b}>" for b in range(1, oov_buckets)]
        self.words = ["<pad>", "<s>", "</s>", "<unk>", *extra, *words]
        self._first = UNK + oov_buckets  # the first word's id
        self._index = {w: i for i, w in enumerate(words, self._first)}
        self.vocab_size = len(self.words)
        self.lexicon = Lexicon(w for w in words if is_word(w))  # its words, not its punctuation

    @classmethod
    def build(cls, texts: Iterable[str], vocab_size: int) -> WordTokenizer:
        counts = collections.Counter(w for t in texts for w in split_words(t))
        top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        return cls(top[: max(0, vocab_size - 4)])

    @classmethod
    def from_word_counts(cls, path: Path, vocab_size: int, oov_buckets: int = 1,
                         split: str = "tff") -> WordTokenizer:
        """The most frequent words of a public word-count file in TFF's format (`word count` per
        line, as `stackoverflow.word_count`), enough to fill `vocab_size` ids with the special
        tokens and OOV buckets. Ties keep the file's order (TFF takes the file's first lines,
        which that file sorts by count)."""
        rows = []
        for number, line in _lines(path):
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise DpfleetError(f"{path}, line {number}: expected 'word count' (a word, a space, "
                                   f"a whole number), got {line[:60]!r}")
            rows.append((parts[0], int(parts[1])))
        ranked = [w for w, _ in sorted(rows, key=lambda wc: -wc[1])]
        return cls._public(ranked, path, vocab_size, oov_buckets, split, "word counts")

    @classmethod
    def from_word_list(cls, path: Path, vocab_size: int, oov_buckets: int = 1,
                       split: str = "tff") -> WordTokenizer:
        """The first words of a public list, one a line, likeliest first."""
        words = [line.strip() for _, line in _lines(path)]
        return cls._public(words, path, vocab_size, oov_buckets, split, "word list")

    @classmethod
    def _public(cls, ranked: list[str], path: Path, vocab_size: int, oov_buckets: int, split: str,
                what: str) -> WordTokenizer:
        room = vocab_size - 3 - oov_buckets
        if room < 1:
            raise DpfleetError(f"vocab_size {vocab_size} leaves no room for words after pad, bos, eos "
                               f"and {oov_buckets} OOV bucket(s)")
        words = list(dict.fromkeys(ranked))[:room]
        return cls(words, oov_buckets, split, source=f"public {what} {Path(path).name}")

    def token_id(self, word: str) -> int:
        i = self._index.get(word)
        return UNK + oov_bucket(word, self.oov_buckets) if i is None else i

    def encode(self, text: str) -> list[int]:
        return [self.token_id(w) for w in split_words(text, self.split)]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.words[int(i)] for i in ids)

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "words": self.words[self._first:]}
        if self.oov_buckets != 1 or self.split != "words" or self.source:  # older files stay as they were
            meta.update(oov_buckets=self.oov_buckets, split=self.split, source=self.source)
        write_json(folder / "tokenizer.json", meta)
        return folder


def _lines(path: Path) -> list[tuple[int, str]]:
    """(1-based number, text) of a UTF-8 file's non-blank lines; a missing or binary file is one
    DpfleetError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DpfleetError(f"word file not found: {path} (TFF StackOverflow's word counts: "
                           f"{TFF_DOWNLOADS}stackoverflow.word_count.tar.bz2, tar xjf it)") from None
    except (UnicodeDecodeError, IsADirectoryError) as exc:
        raise DpfleetError(f"{path}: not a UTF-8 text file ({exc})") from exc
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise DpfleetError(f"{path}: no words in the file")
    return lines


class CharTokenizer(_SpecialIds):
    """TFF Shakespeare's next-character vocabulary: its 86 characters (`TFF_CHARS`) and one OOV.
    Text is split into UTF-8 bytes as TFF's `tf.strings.bytes_split` does, so a non-ASCII
    character is one OOV per byte, as in TFF; no lexicon (suggestions are characters)."""

    kind = "char"
    lexicon = None
    oov_ids = (UNK,)
    source = "TFF Shakespeare's character set"

    def __init__(self, chars: str = TFF_CHARS):
        self.chars = chars
        self._index = {c.encode("utf-8"): i for i, c in enumerate(chars, UNK + 1)}
        self.vocab_size = UNK + 1 + len(chars)

    def encode(self, text: str) -> list[int]:
        return [self._index.get(bytes([b]), UNK) for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i - UNK - 1] if i > UNK else ("\ufffd" if i == UNK else "")
                       for i in map(int, ids))

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "chars": self.chars}
        write_json(folder / "tokenizer.json", meta)
        return folder


def load_tokenizer(folder: Path) -> SentencePieceTokenizer | WordTokenizer | CharTokenizer:
    """Load a tokenizer saved with `save`; a damaged or malformed folder is a DpfleetError."""
    folder = Path(folder)
    meta_file = folder / "tokenizer.json"
    if not meta_file.is_file():
        raise DpfleetError(f"no tokenizer.json in {folder}")

    def read(name: str) -> bytes:
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.is_file():
            raise DpfleetError(f"{meta_file}: model file {name!r} not found in {folder}")
        return path.read_bytes()

    return tokenizer_from_bytes(meta_file.read_bytes(), read, str(meta_file))


def tokenizer_from_bytes(
    meta: bytes, read: Callable[[str], bytes], origin: str = "tokenizer.json"
) -> SentencePieceTokenizer | WordTokenizer | CharTokenizer:
    """A tokenizer from its `tokenizer.json` bytes; `read(name)` returns the bytes of the model
    file it names. Malformed metadata is one DpfleetError naming `origin`, never a traceback."""
    try:
        info = json.loads(meta)
        kind = info.get("kind")
    except (ValueError, AttributeError) as exc:
        raise DpfleetError(f"{origin}: malformed tokenizer metadata ({exc})") from exc
    if kind == "sentencepiece":
        name = info.get("model_file")
        if not isinstance(name, str):
            raise DpfleetError(f"{origin}: model_file must name the SentencePiece model")
        words = info.get("lexicon")
        if words is not None and not isinstance(words, str):
            raise DpfleetError(f"{origin}: lexicon must name the word list file")
        lexicon = None
        if words is not None:
            try:
                lexicon = Lexicon.from_text(read(words).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise DpfleetError(f"{origin}: the word list {words!r} is not UTF-8 text") from exc
        return SentencePieceTokenizer(model_proto=read(name), lexicon=lexicon)
    if kind == "word":
        words = info.get("words")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DpfleetError(f"{origin}: words must be a list of strings")
        buckets, split = info.get("oov_buckets", 1), info.get("split", "words")
        source = info.get("source", "")
        if not isinstance(buckets, int) or isinstance(buckets, bool) or not isinstance(source, str):
            raise DpfleetError(f"{origin}: oov_buckets must be a whole number and source a string")
        try:
            return WordTokenizer(words, buckets, split, source)
        except DpfleetError as exc:
            raise DpfleetError(f"{origin}: {exc}") from None
    if kind == "char":
        chars = info.get("chars")
        if not isinstance(chars, str) or not chars:
            raise DpfleetError(f"{origin}: chars must be a string of characters")
        return CharTokenizer(chars)
    raise DpfleetError(f"{origin}: unknown tokenizer kind {kind!r}")
