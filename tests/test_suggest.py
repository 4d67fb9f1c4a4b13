"""Keyboard predictions (`edge.suggest.Predictor`): subword pieces joined into whole words ranked by
their probability, the word being typed completed, next tokens with their probabilities, and the
model run the way it was trained (BOS + the training window, eval mode, no gradients).

The model is a bigram table with known probabilities, so each ranking is computed by hand here; the
tokenizer is SentencePiece-like ("▁" starts a word, decode drops the text's first space)."""

import math

import pytest
import torch
from torch import nn

from dpfleet.edge.suggest import Predictor
from dpfleet.edge.tokenizer import BOS, EOS, WordTokenizer
from dpfleet.errors import DpfleetError

PIECES = ["<pad>", "<s>", "</s>", "<unk>", "▁see", "▁you", "▁at", "▁no", "on", "w", "▁the", ",", "▁north"]
ID = {p: i for i, p in enumerate(PIECES)}
WORDS = {"see": ["▁see"], "you": ["▁you"], "at": ["▁at"], "no": ["▁no"], "noon": ["▁no", "on"],
         "now": ["▁no", "w"], "the": ["▁the"], "north": ["▁north"], ",": [","]}


class Pieces:
    """A subword tokenizer of the shape SentencePiece has."""

    vocab_size = len(PIECES)

    def encode(self, text: str) -> list[int]:
        return [ID[p] for w in text.replace(",", " ,").split() for p in WORDS.get(w.lower(), ["<unk>"])]

    def decode(self, ids) -> str:
        return "".join(PIECES[i] for i in ids).replace("▁", " ").removeprefix(" ")


# P(next | previous): the rest of each row is spread evenly over the other ids
NEXT = {"▁at": {"▁no": 0.45, "▁the": 0.35, "▁north": 0.1},
        "▁no": {"on": 0.5, "w": 0.3, "▁the": 0.1},
        "on": {"▁the": 0.9}, "w": {",": 0.8}, "▁north": {"▁the": 0.9}, "▁the": {"▁no": 0.5}}


class Bigram(nn.Module):
    """logits[b, t] = log P(. | ids[b, t]); records what it was called with."""

    def __init__(self):
        super().__init__()
        table = torch.full((len(PIECES), len(PIECES)), 1.0 / len(PIECES))
        for prev, nxt in NEXT.items():
            rest = (1 - sum(nxt.values())) / (len(PIECES) - len(nxt))
            table[ID[prev]] = rest
            for piece, p in nxt.items():
                table[ID[prev], ID[piece]] = p
        self.table = nn.Parameter(table.log())
        self.calls: list[tuple[torch.Tensor, bool, bool]] = []

    def forward(self, ids):
        self.calls.append((ids.clone(), self.training, torch.is_grad_enabled()))
        return self.table[ids]


def p(prev: str, nxt: str) -> float:
    row = NEXT.get(prev, {})
    return row.get(nxt, (1 - sum(row.values())) / (len(PIECES) - len(row)) if row else 1 / len(PIECES))


def boundary(prev: str) -> float:
    """P(the word ends after `prev`): the next piece starts a word, is punctuation, or is EOS."""
    return sum(p(prev, x) for x in PIECES[4:] if x.startswith("▁") or x == ",") + p(prev, "</s>")


def test_subword_pieces_are_joined_into_words_ranked_by_probability():
    # by hand: P(word) = P(its pieces) * P(a boundary after it)
    words = {"the": p("▁at", "▁the") * boundary("▁the"),
             "noon": p("▁at", "▁no") * p("▁no", "on") * boundary("on"),
             "now": p("▁at", "▁no") * p("▁no", "w") * boundary("w"),
             "north": p("▁at", "▁north") * boundary("▁north"),
             "no": p("▁at", "▁no") * boundary("▁no")}
    expected = sorted(words, key=words.get, reverse=True)
    assert expected[:3] == ["the", "noon", "now"]  # the table is built for this order
    predictor = Predictor(Bigram(), Pieces())
    assert predictor.suggest("see you at ", k=3) == expected[:3]
    assert predictor.suggest("see you at ", k=5) == expected


def test_the_word_being_typed_is_completed_case_insensitively():
    predictor = Predictor(Bigram(), Pieces())
    assert predictor.suggest("see you at no", k=3) == ["noon", "now", "north"]
    assert predictor.suggest("see you at NO", k=3) == ["noon", "now", "north"]
    assert predictor.suggest("see you at nor", k=1) == ["north"]
    assert all(w.startswith("north") for w in predictor.suggest("see you at nor", k=3))
    assert predictor.suggest("see you at x", k=3) == []


def test_predict_gives_the_next_tokens_with_their_probabilities():
    predictor = Predictor(Bigram(), Pieces())
    top = predictor.predict("see you at", k=3)
    assert [text for text, _ in top] == [" no", " the", " north"]  # a word start shows its space
    assert [prob for _, prob in top] == pytest.approx([0.45, 0.35, 0.1], abs=1e-6)
    assert predictor.predict("see you at no", k=2)[0][0] == "on"  # a piece inside the word
    probs = predictor.probabilities("see you at")
    assert probs.shape == (len(PIECES),) and float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
    assert float(probs[ID["▁no"]]) == pytest.approx(0.45, abs=1e-6)


def test_the_model_sees_bos_and_at_most_the_training_window_in_eval_mode_without_grad():
    model = Bigram().train()
    predictor = Predictor(model, Pieces(), seq_len=3)
    predictor.probabilities("see you at no")
    ids, training, grad = model.calls[-1]
    assert ids.tolist() == [[BOS, ID["▁at"], ID["▁no"]]]  # BOS + the last seq_len - 1 tokens
    assert not training and not grad
    assert model.training  # the caller's mode is restored
    Predictor(model, Pieces()).probabilities("see you at no")
    assert model.calls[-1][0].tolist() == [[BOS, ID["▁see"], ID["▁you"], ID["▁at"], ID["▁no"]]]


def test_a_word_level_vocabulary_suggests_its_words():
    tok = WordTokenizer(["see", "you", "at", "noon", "now"])
    table = torch.full((tok.vocab_size, tok.vocab_size), -9.0)
    table[tok.encode("at")[0], tok.encode("noon")[0]] = 0.0
    table[tok.encode("at")[0], tok.encode("now")[0]] = -1.0
    table[:, EOS] = -0.5

    class WordBigram(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(table)

        def forward(self, ids):
            return self.table[ids]

    predictor = Predictor(WordBigram(), tok)
    assert predictor.suggest("see you at ", k=2) == ["noon", "now"]
    assert predictor.suggest("see you at now", k=2) == ["now"]
    assert predictor.predict("see you at", k=1)[0][0] == " noon"


def test_mistakes_are_one_clear_error():
    class NoDecode:
        vocab_size = len(PIECES)

        def encode(self, text):
            return Pieces().encode(text)

    predictor = Predictor(Bigram(), NoDecode())
    with pytest.raises(DpfleetError, match="NoDecode has no decode"):
        predictor.suggest("see you ")
    with pytest.raises(DpfleetError, match="NoDecode has no decode"):
        predictor.predict("see you ")
    assert math.isclose(float(predictor.probabilities("see you at").sum()), 1.0, abs_tol=1e-6)
    with pytest.raises(DpfleetError, match="k must be a positive int"):
        Predictor(Bigram(), Pieces()).suggest("see", k=0)
    with pytest.raises(DpfleetError, match="text must be a str"):
        Predictor(Bigram(), Pieces()).predict(["see"])
    with pytest.raises(DpfleetError, match="text must be a str, not int"):  # was a raw TypeError
        Predictor(Bigram(), Pieces()).suggest(123)

    class Flat(nn.Module):
        def forward(self, ids):
            return torch.zeros(ids.shape[0], len(PIECES))

    with pytest.raises(DpfleetError, match=r"logits \[batch, time, vocab\]"):
        Predictor(Flat(), Pieces()).probabilities("see")


def test_only_the_lexicons_words_are_offered_fewer_rather_than_non_words():
    """"noon" is the model's second word after "at": with a lexicon that lacks it (as a public
    corpus's word list would lack "brotheron"), the strip keeps the words it has, in the same
    order, and shows fewer than k rather than fill a slot with a spelling nobody types."""
    from dpfleet.edge.lexicon import Lexicon

    class WithLexicon(Pieces):
        lexicon = Lexicon(["the", "now", "North"])  # matched without regard to case

    predictor = Predictor(Bigram(), WithLexicon())
    assert Predictor(Bigram(), Pieces()).suggest("see you at ", k=3) == ["the", "noon", "now"]
    assert predictor.suggest("see you at ", k=3) == ["the", "now", "north"]
    assert predictor.suggest("see you at ", k=5) == ["the", "now", "north"]  # 3 words, not 5
    assert predictor.suggest("see you at noo", k=3) == []


def test_a_lexicon_counts_a_corpus_words_and_travels_with_the_tokenizer(tmp_path):
    from dpfleet.edge.lexicon import Lexicon
    from dpfleet.edge.tokenizer import load_tokenizer

    lexicon = Lexicon.from_texts(["The brother's house, the Brother brother", "Wikipedia 's 2 x-ray x-ray",
                                  "a house of the state-of-the-art ab1"], min_count=2)
    assert lexicon.words == ["the", "brother", "house", "x-ray"]  # counts 3, 2 (case folded), 2, 2
    assert "The" in lexicon and "s" not in lexicon and "2" not in lexicon and "brother's" not in lexicon
    word = WordTokenizer(["the", ",", "house", "'s"])
    assert word.lexicon.words == ["the", "house"]  # a word tokenizer's words, not its punctuation
    assert load_tokenizer(word.save(tmp_path / "w")).lexicon.words == ["the", "house"]
