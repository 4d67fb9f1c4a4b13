"""The default on-device tokenizer: SentencePiece trained on a *public* corpus.

Training the vocabulary on public text costs no privacy (paper 000 Sec. 3.1), unlike the
word-level baseline built from the private data. Trained models are cached by corpus and size.
"""

from __future__ import annotations

from dpfleet.edge.datasets import load_records
from dpfleet.edge.lexicon import Lexicon
from dpfleet.edge.notices import slow_step
from dpfleet.edge.tokenizer import SentencePieceTokenizer, train_sentencepiece
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.io import atomic_write


def public_sentencepiece(corpus: str = "wikitext2", vocab_size: int = 4096) -> SentencePieceTokenizer:
    """Train (once) and load a byte-fallback SentencePiece model on a public corpus, with the
    corpus's words as its lexicon (what suggestions are kept to)."""
    prefix = cache_dir() / "tokenizers" / f"spm-{corpus}-{vocab_size}"
    model_file, words_file = prefix.with_suffix(".model"), prefix.with_suffix(".words.txt")
    if not model_file.is_file():
        records = load_records(corpus, "train")
        with slow_step(f"training the SentencePiece tokenizer ({vocab_size} pieces) on {corpus}, once "
                       f"(cached in {prefix.parent})"):
            train_sentencepiece((r.text for r in records), prefix, vocab_size)
    if not words_file.is_file():  # also for a model cached before tokenizers carried a lexicon
        atomic_write(words_file, Lexicon.from_texts(r.text for r in load_records(corpus, "train")).to_text())
    return SentencePieceTokenizer(model_file, lexicon=Lexicon.from_text(words_file.read_text()))
