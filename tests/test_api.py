"""The Python API (`dpfleet.simulate`): the custom-model example end to end, the Result's fields
against the run directory, and one clear DpfleetError for each bad input, before any training."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import dpfleet
from dpfleet.errors import DpfleetError

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64

# a word-level toy tokenizer: ids 0-3 are the toolkit's PAD / BOS / EOS / UNK
WORDS = ["the", "a", "and", "of", "to", "i", "you", "my", "is", "that", "in", "not", "it", "me", "be",
         "with", "this", "your", "his", "he"]


class WordIds:
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return [4 + WORDS.index(w) if w in WORDS else 3 for w in text.lower().split()]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, out: int | None = None, embed_rows: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(embed_rows or vocab, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, out or vocab)

    def forward(self, ids):
        return self.head(self.gru(self.embed(ids))[0])


class Flat(TinyLM):
    def forward(self, ids):  # [batch, vocab]: the last step only
        return super().forward(ids)[:, -1]


USERS = {f"user{i}": [f"the {w} of my {x} is not in you" for w in WORDS[i % 7:] for x in WORDS[:3]]
         for i in range(30)}
CONFIG = {"rounds": 2, "eval_every": 1, "checkpoint_every": 0, "seed": 1,
          "data": {"seq_len": 8, "max_examples": 8, "test_fraction": 0.2, "eval_examples": 50},
          "client": {"lr": 0.5, "batch_size": 4},
          "dp": {"noise_multiplier": 0.5, "clip_norm": 1.0, "report_goal": 5}}


def run(tmp_path, **kw):
    args = dict(model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                run_dir=tmp_path / "run")
    return dpfleet.simulate(kw.pop("config", CONFIG), **{**args, **kw})


def test_result_fields_match_the_run_directory(tmp_path):
    result = run(tmp_path)
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert 0 <= result.accuracy <= 1 and 0 <= result.unigram_accuracy <= 1
    assert result.epsilon == privacy["epsilon"] and 0 < result.epsilon < float("inf")
    assert result.delta == privacy["delta"] == 1e-6  # the config's default
    assert result.accuracy == summary["final"]["accuracy"]
    assert [m["round"] for m in result.metrics] == [1, 2]
    assert result.metrics == [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    assert isinstance(result.model, TinyLM)
    assert result.client_trainer == "sequential"  # "auto" falls back for a custom model
    assert "sequential" in summary["client_trainer_note"]
    assert summary["data"] == "records given in Python"
    assert not (result.run_dir / "checkpoint" / "model_config.json").exists()  # no zoo config fits
    # the returned module holds the released weights, the ones the checkpoint saved
    saved = load_file(str(result.run_dir / "checkpoint" / "model.safetensors"))
    assert torch.equal(saved["head.weight"], result.model.head.weight.detach())


def test_pairs_and_mapping_give_the_same_run(tmp_path):
    """(user, text) pairs take the same split and rows as the mapping: identical metrics when
    the noise is seeded (research mode)."""
    config = {**CONFIG, "dp": {**CONFIG["dp"], "noise_seed": 7}}
    pairs = [(u, t) for u, texts in USERS.items() for t in texts]
    a = run(tmp_path / "a", config=config, model=_seeded())
    b = run(tmp_path / "b", config=config, model=_seeded(), users=iter(pairs))
    assert a.metrics == b.metrics and a.accuracy == b.accuracy


def _seeded() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


@pytest.mark.slow  # ~15 s in the default suite; test_extensions runs the custom parts by default
def test_example_custom_model_runs_with_dp_and_secagg(tmp_path):
    spec = importlib.util.spec_from_file_location("custom_model", ROOT / "examples" / "custom_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(tmp_path / "gru", progress=False)
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    assert isinstance(result.model, example.GRULanguageModel)
    assert result.epsilon == privacy["epsilon"] and 0 < result.epsilon < float("inf")
    assert privacy["noise_mechanism"].startswith("discrete Gaussian in the SecAgg ring")
    assert result.metrics[0]["aggregation"]["aggregation"] == "secagg"
    assert 0 <= result.accuracy <= 1 and len(result.metrics) == example.CONFIG["rounds"]


@pytest.mark.parametrize("model, message", [
    (Flat(), r"wrong shape: .* \[2, 8, 64\], got \[2, 64\]"),
    (TinyLM(out=VOCAB - 1), r"vocabulary mismatch: .*\[2, 8, 64\], got \[2, 8, 63\]"),
    (TinyLM(embed_rows=32), r"vocabulary mismatch: the model's token embedding has 32 rows"),
    ("not a module", r"model must be a torch.nn.Module, not str"),
])
def test_bad_model_is_one_clear_error_before_training(tmp_path, model, message):
    with pytest.raises(DpfleetError, match=message):
        run(tmp_path, model=model)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no round ran


def test_token_ids_beyond_the_embedding_are_a_vocabulary_mismatch(tmp_path):
    class Overflowing(WordIds):
        def encode(self, text):
            return [VOCAB + 5 for _ in text.split()]

    with pytest.raises(DpfleetError, match=r"token ids reach 68 .*largest id in the data 69|"
                                           r"embedding has 64 rows but token ids reach 69"):
        run(tmp_path, tokenizer=Overflowing())


def test_zoo_model_with_your_users_and_tokenizer(tmp_path):
    """No model: the config's zoo model, sized to the caller's tokenizer, on the cohort trainer;
    a tokenizer whose ids pass its own vocab_size is a clear error there too."""
    config = {**CONFIG, "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8}}
    result = run(tmp_path / "zoo", config=config, model=None)
    assert result.client_trainer == "cohort" and 0 <= result.accuracy <= 1
    assert result.model.embed.num_embeddings == VOCAB

    class Overflowing(WordIds):
        def encode(self, text):
            return [VOCAB + 5 for _ in text.split()]

    with pytest.raises(DpfleetError, match=r"vocabulary mismatch: the tokenizer gave token id 69 but "
                                           r"its vocab_size is 64"):
        run(tmp_path / "bad", config=config, model=None, tokenizer=Overflowing())


@pytest.mark.parametrize("users, message", [
    ({**USERS, "silent": []}, r"user 'silent' has no text"),
    ({**USERS, "blank": ["  ", ""]}, r"user 'blank' has no text"),
    ("alice: hello", r"users must be a mapping .* not str"),
    (42, r"users must be a mapping .* not int"),
    ([("alice", "hi", "extra")], r"\(user_id, text\) pairs"),
    ({"alice": "a single string"}, r"users\['alice'\] must be a list of texts"),
    ({"alice": [b"bytes"]}, r"user 'alice': texts must be str, got bytes"),
    ({}, r"users is empty"),
])
def test_bad_users_are_one_clear_error(tmp_path, users, message):
    with pytest.raises(DpfleetError, match=message):
        run(tmp_path, users=users)


def test_bad_tokenizer_and_config_are_one_clear_error(tmp_path):
    class NoVocab:
        def encode(self, text):
            return [4]

    with pytest.raises(DpfleetError, match=r"tokenizer.vocab_size must be an int"):
        run(tmp_path, tokenizer=NoVocab())
    with pytest.raises(DpfleetError, match=r"invalid config key 'dp.noise_multiplyer'"):
        run(tmp_path, config={**CONFIG, "dp": {"noise_multiplyer": 1.0}})
    with pytest.raises(DpfleetError, match=r"config must be a TOML path or a dict"):
        run(tmp_path, config=3)
    with pytest.raises(DpfleetError, match=r"config file not found"):
        run(tmp_path, config=tmp_path / "missing.toml")


def test_cli_on_a_jsonl_file_and_the_api_on_the_same_users_give_the_same_run(tmp_path):
    """One path: `dpfleet simulate` on a jsonl dataset and `dpfleet.simulate(users=...)` on the
    same records split, tokenise and train identically (seeded noise, research mode)."""
    from click.testing import CliRunner

    from dpfleet.coordinator.cli.simulate import simulate

    data = tmp_path / "users.jsonl"
    data.write_text("".join(json.dumps({"user": u, "text": t}) + "\n" for u, ts in USERS.items() for t in ts))
    toml = tmp_path / "tiny.toml"
    config = {**CONFIG, "dp": {**CONFIG["dp"], "noise_seed": 3},
              "data": {**CONFIG["data"], "dataset": "jsonl", "path": str(data)},
              "tokenizer": {"kind": "word", "vocab_size": 40, "allow_nonprivate_vocabulary": True},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8}}
    # TOML of flat tables: a JSON scalar is a TOML scalar
    toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items() if not isinstance(v, dict))
                    + "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
                              for name, table in config.items() if isinstance(table, dict)))
    cli = CliRunner().invoke(simulate, [str(toml), "--out", str(tmp_path / "cli"), "--quiet"])
    assert cli.exit_code == 0, cli.output
    api = dpfleet.simulate(toml, users=USERS, run_dir=tmp_path / "api", progress=False)
    cli_metrics = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").open()]
    for key in ("accuracy", "loss", "epsilon"):
        assert [m[key] for m in api.metrics] == [m[key] for m in cli_metrics], key
    assert f"model {api.accuracy:.4f}" in cli.output


def test_cohort_trainer_on_a_custom_model_matches_the_sequential_path():
    """client.trainer = 'cohort' with your module: torch.func's batched steps give each client's
    clipped delta as the sequential reference does (float rounding only)."""
    import numpy as np

    from dpfleet.coordinator.engine.backends import SequentialTrainer
    from dpfleet.edge.cohort import CohortTrainer
    from dpfleet.edge.runtime import EagerRuntime
    from dpfleet.export.models import ModelConfig
    from dpfleet.export.params import get_flat

    model, cfg = _seeded(), ModelConfig(vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    clients = [rng.integers(4, VOCAB, size=(n, 9)).astype(np.int32) for n in (3, 9, 6)]
    args = dict(lr=0.5, batch_size=4, clip_norm=0.05)  # small clip: some clients are clipped
    cohort = CohortTrainer(cfg, seq_len=8, batch_size=4, device="cpu", model=model, chunk=2)
    seq = SequentialTrainer(EagerRuntime(cfg, model=_seeded()))
    a = cohort.train_round(get_flat(model), clients, [1, 2, 3], **args)
    b = seq.train_round(get_flat(model), clients, [1, 2, 3], **args)
    for x, y in zip(a, b, strict=True):
        assert np.abs(x.delta).max() > 1e-4  # they trained
        np.testing.assert_allclose(x.delta, y.delta, atol=1e-6)
    assert [x.clipped for x in a] == [y.clipped for y in b]


def test_cohort_with_a_custom_model_runs_and_dropout_is_a_clear_error(tmp_path):
    config = {**CONFIG, "client": {**CONFIG["client"], "trainer": "cohort"}}
    assert run(tmp_path / "ok", config=config).client_trainer == "cohort"

    class Dropping(TinyLM):
        def forward(self, ids):
            return nn.functional.dropout(super().forward(ids), 0.5, self.training)

    with pytest.raises(DpfleetError, match=r"client.trainer = 'cohort' cannot batch this model"):
        run(tmp_path / "bad", config=config, model=Dropping())


def test_overrides_callback_and_warnings_reach_python_callers(tmp_path):
    seen = []
    with pytest.warns(dpfleet.DpfleetWarning) as caught:
        result = run(tmp_path, config={**CONFIG, "rounds": 3},
                     overrides={"rounds": 2, "dp.noise_multiplier": 0.0}, on_round=seen.append)
    assert [m["round"] for m in seen] == [1, 2] and seen == result.metrics  # each committed round
    assert json.loads((result.run_dir / "config.json").read_text())["dp"]["noise_multiplier"] == 0.0
    said = [str(w.message) for w in caught]
    assert said == [*result.privacy["caveats"], *result.warnings] and any("NOT PRIVATE" in s for s in said)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"dp.noise_multiplyer": 1.0},
     r"^overrides\['dp.noise_multiplyer'\]: \[dp\] has no key 'noise_multiplyer'; "
     r"did you mean 'noise_multiplier'\?"),
    ({"dp": 3}, r"^overrides\['dp'\]: \[dp\] is a section; set one of its keys, dp.KEY \("),
    (["rounds=2"], r"^overrides must be a dict of config keys, not list"),
])
def test_python_errors_name_python_arguments(tmp_path, overrides, message):
    with pytest.raises(DpfleetError, match=message) as raised:
        run(tmp_path, overrides=overrides)
    assert "--set" not in str(raised.value)
