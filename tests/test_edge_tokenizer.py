import pytest

from dpfleet.edge.tokenizer import (
    BOS,
    PAD,
    UNK,
    SentencePieceTokenizer,
    WordTokenizer,
    load_tokenizer,
    train_sentencepiece,
)
from dpfleet.errors import DpfleetError


@pytest.fixture(scope="module")
def spm(tmp_path_factory, shakespeare_records):
    lines = [r.text for r in shakespeare_records[:4000]]
    return train_sentencepiece(lines, tmp_path_factory.mktemp("spm") / "m", vocab_size=600)


def test_sentencepiece_round_trip_and_no_oov(spm, shakespeare_records):
    assert (spm.pad_id, spm.bos_id, spm.unk_id) == (PAD, BOS, UNK)
    for r in shakespeare_records[5000:5300]:
        ids = spm.encode(r.text)
        assert spm.decode(ids) == r.text.strip() or spm.decode(ids) == " ".join(r.text.split())
        assert UNK not in ids
    ids = spm.encode("Zebra-crossing ✓ ünïcödé 漢字")  # unseen characters use byte fallback
    assert UNK not in ids and spm.decode(ids) == "Zebra-crossing ✓ ünïcödé 漢字"


def test_word_tokenizer_top_k_with_oov():
    tok = WordTokenizer.build(["the cat sat", "the dog sat", "the end"], vocab_size=6)
    assert tok.vocab_size == 6 and tok.words[4:] == ["the", "sat"]
    assert tok.encode("The cat SAT!") == [4, UNK, 5, UNK]
    assert tok.decode(tok.encode("the sat")) == "the sat"


def test_save_and_load_both_kinds(tmp_path, spm):
    word = WordTokenizer.build(["a b c a"], 10)
    for tok, folder in ((spm, tmp_path / "s"), (word, tmp_path / "w")):
        loaded = load_tokenizer(tok.save(folder))
        assert loaded.kind == tok.kind and loaded.vocab_size == tok.vocab_size
        assert loaded.encode("a b c thee") == tok.encode("a b c thee")
    with pytest.raises(DpfleetError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nothing")
    with pytest.raises(DpfleetError, match="not found"):
        SentencePieceTokenizer(tmp_path / "missing.model")
