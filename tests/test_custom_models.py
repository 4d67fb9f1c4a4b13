"""Ordinary custom models train in `dpfleet.simulate`: a transformer with a learned positional
embedding (its 8-row position table is not the vocabulary) and a Hugging Face causal LM, whose
forward returns an object with `.logits`. The vocabulary check looks at the embedding the token
ids index, so a token table that is too small is still refused in one line."""

import pytest
import torch
from test_api import CONFIG, USERS, VOCAB, WordIds
from torch import nn

import dpfleet
from dpfleet.errors import DpfleetError

SEQ = CONFIG["data"]["seq_len"]


class PositionalLM(nn.Module):
    """A one-layer transformer with learned positions: nn.Embedding(SEQ, d) next to the tokens'."""

    def __init__(self, vocab: int = VOCAB, d: int = 16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(SEQ, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.block(x, src_mask=causal, is_causal=True))


def simulate(tmp_path, model):
    return dpfleet.simulate(CONFIG, model=model, users=USERS, tokenizer=WordIds(), progress=False,
                            run_dir=tmp_path / "run")


def test_a_transformer_with_positional_embeddings_trains(tmp_path):
    model = PositionalLM()
    before = model.tokens.weight.detach().clone()
    result = simulate(tmp_path, model)
    assert result.model is model and 0 <= result.accuracy <= 1
    assert not torch.equal(before, model.tokens.weight)  # the released weights are in the module
    assert [m["round"] for m in result.metrics] == [1, 2]


def test_a_small_token_table_is_refused_even_next_to_positions(tmp_path):
    model = PositionalLM()
    model.tokens = nn.Embedding(VOCAB // 2, 16)
    with pytest.raises(DpfleetError, match=rf"token embedding has {VOCAB // 2} rows but token ids reach"):
        simulate(tmp_path, model)
    assert not (tmp_path / "run").exists()


def test_a_hugging_face_causal_lm_trains_and_predicts(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.transformer.wpe.num_embeddings == SEQ < VOCAB  # the check once refused exactly this
    before = model.transformer.wte.weight.detach().clone()
    result = simulate(tmp_path, model)
    assert 0 <= result.accuracy <= 1 and result.perplexity < float("inf")
    assert not torch.equal(before, model.transformer.wte.weight)
    probs = result.probabilities("the of my")  # read through `.logits` too
    assert probs.shape == (VOCAB,) and abs(float(probs.sum()) - 1) < 1e-5
