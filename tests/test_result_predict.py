"""A `Result` for its user: the run's tokenizer, keyboard suggestions and next-token predictions from
the trained model (a zoo model here; a custom module in test_export_custom_model.py, the search
itself against hand-computed probabilities in test_suggest.py), and `Result.load` reading a
finished run back, as a user of the CLI needs."""

import pytest
import torch
from test_api import CONFIG, USERS, WORDS

import dpfleet
from dpfleet.edge.tokenizer import BOS, PAD, UNK, WordTokenizer
from dpfleet.errors import DpfleetError

TOKENIZER = WordTokenizer(WORDS)
ZOO = {**CONFIG, "model": {"arch": "cifg", "vocab_size": TOKENIZER.vocab_size, "embedding_dim": 8,
                           "hidden_dim": 16, "projection_dim": 8}}


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    torch.manual_seed(0)
    return dpfleet.simulate(ZOO, users=USERS, tokenizer=TOKENIZER, progress=False,
                            run_dir=tmp_path_factory.mktemp("zoo") / "run")


def test_suggest_ranks_the_models_words_and_predict_gives_its_probabilities(zoo_run):
    assert zoo_run.tokenizer is TOKENIZER
    # a word vocabulary: P(word) = P(its token) * P(what follows starts a word: not PAD/BOS/UNK)
    probs = zoo_run.probabilities("the ")
    score = {}
    for word in WORDS:
        after = zoo_run.probabilities(f"the {word}")
        score[word] = float(probs[TOKENIZER.encode(word)[0]]) * float(1 - after[[PAD, BOS, UNK]].sum())
    expected = sorted(score, key=score.get, reverse=True)[:3]
    assert zoo_run.suggest("the ", k=3) == expected
    assert zoo_run.suggest("the t", k=3) == [w for w in sorted(score, key=score.get, reverse=True)
                                             if w.startswith("t")][:3]
    top = zoo_run.predict("the", k=4)
    assert [p for _, p in top] == sorted((p for _, p in top), reverse=True)
    for text, p in top:  # each a word of the vocabulary, with the model's probability
        assert p == pytest.approx(float(zoo_run.probabilities("the")[TOKENIZER.encode(text)[0]]))


def test_load_reads_a_finished_run_back(zoo_run):
    loaded = dpfleet.Result.load(zoo_run.run_dir)  # a zoo model: rebuilt from the checkpoint
    assert (loaded.accuracy, loaded.unigram_accuracy, loaded.perplexity, loaded.epsilon, loaded.delta) == (
        zoo_run.accuracy, zoo_run.unigram_accuracy, zoo_run.perplexity, zoo_run.epsilon, zoo_run.delta)
    assert loaded.metrics == zoo_run.metrics and loaded.privacy == zoo_run.privacy
    assert (loaded.stopped_early, loaded.client_trainer) == (zoo_run.stopped_early, zoo_run.client_trainer)
    for (name, a), (_, b) in zip(loaded.model.named_parameters(), zoo_run.model.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert loaded.tokenizer.kind == "word" and loaded.tokenizer.words == TOKENIZER.words
    assert loaded.suggest("the ") == zoo_run.suggest("the ")


def test_load_of_a_folder_that_is_no_finished_run_says_so(tmp_path):
    with pytest.raises(DpfleetError, match=r"is not a run directory \(no config.json\)"):
        dpfleet.Result.load(tmp_path)
