"""One interface over the two vocabularies the papers compare.

* `SentencePieceTokenizer`: a public subword model (trained on public text, or taken from a public
  LLM teacher). Byte fallback means no out-of-vocabulary token ever appears.
* `WordTokenizer`: the papers' baseline, the top-k words of the *private* data plus an OOV token
  (building it from private data is itself a privacy cost the public tokenizer avoids).

Both reserve ids 0..3 for pad / bos / eos / unk so models, losses and metrics can treat them alike.
A tokenizer is saved as a folder holding `tokenizer.json` (kind + metadata) and its model file.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from dpfleet.edge.lexicon import LEXICON_FILE, Lexicon, is_word
from dpfleet.errors import DpfleetError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
_WORD_RE = re.compile(r"[\w']+|[^\w\s]")


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
        (folder / "tokenizer.json").write_text(json.dumps(meta, indent=2))
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


def split_words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks: the word-level baseline's units."""
    return _WORD_RE.findall(text.lower())


class WordTokenizer(_SpecialIds):
    """Top-k words of a corpus plus OOV (paper 000's private word-level baseline)."""

    kind = "word"

    def __init__(self, words: list[str]):
        self.words = ["<pad>", "<s>", "</s>", "<unk>", *words]
        self._index = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)
        self.lexicon = Lexicon(w for w in words if is_word(w))  # its words, not its punctuation

    @classmethod
    def build(cls, texts: Iterable[str], vocab_size: int) -> WordTokenizer:
        counts = collections.Counter(w for t in texts for w in split_words(t))
        top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        return cls(top[: max(0, vocab_size - 4)])

    def encode(self, text: str) -> list[int]:
        return [self._index.get(w, UNK) for w in split_words(text)]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.words[int(i)] for i in ids)

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "words": self.words[4:]}
        (folder / "tokenizer.json").write_text(json.dumps(meta))
        return folder


def load_tokenizer(folder: Path) -> SentencePieceTokenizer | WordTokenizer:
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
) -> SentencePieceTokenizer | WordTokenizer:
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
        return WordTokenizer(words)
    raise DpfleetError(f"{origin}: unknown tokenizer kind {kind!r}")
