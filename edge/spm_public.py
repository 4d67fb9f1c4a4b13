"""The default on-device tokenizer: SentencePiece trained on a *public* corpus.

Training the vocabulary on public text costs no privacy (paper 000 Sec. 3.1), unlike the
word-level baseline built from the private data. Trained models are cached by corpus and size.
"""

from __future__ import annotations

from dpfleet.edge.datasets import load_records
from dpfleet.edge.notices import slow_step
from dpfleet.edge.tokenizer import SentencePieceTokenizer, train_sentencepiece
from dpfleet.edge.wheel_cache import cache_dir


def public_sentencepiece(corpus: str = "wikitext2", vocab_size: int = 4096) -> SentencePieceTokenizer:
    """Train (once) and load a byte-fallback SentencePiece model on a public corpus."""
    prefix = cache_dir() / "tokenizers" / f"spm-{corpus}-{vocab_size}"
    model_file = prefix.with_suffix(".model")
    if not model_file.is_file():
        records = load_records(corpus, "train")
        with slow_step(f"training the SentencePiece tokenizer ({vocab_size} pieces) on {corpus}, once "
                       f"(cached in {prefix.parent})"):
            train_sentencepiece((r.text for r in records), prefix, vocab_size)
    return SentencePieceTokenizer(model_file)
