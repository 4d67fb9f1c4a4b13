"""Public means public: a public source that shares records with the private dataset is refused
(by name at config time, by normalised text when the pool is built), and the defaults agree."""

import json

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import make_tokenizer
from dpfleet.edge.datasets import load_records
from dpfleet.edge.overlap import check_public_texts, sources_overlap
from dpfleet.errors import DpfleetError
from dpfleet.public.matching import Pool
from dpfleet.public.pipeline import check_pool_is_public, parse_pipeline

VERSE = "In the beginning God created the heaven and the earth."


def test_named_overlaps():
    assert sources_overlap("shakespeare-collab", "shakespeare")
    assert sources_overlap("shakespeare", "shakespeare-solo")
    assert sources_overlap("kjv", "kjv")
    assert sources_overlap("shakespeare-collab", "shakespeare-solo") is None
    assert sources_overlap("wikitext2", "shakespeare") is None
    assert sources_overlap("jsonl", "jsonl") is None  # two files: compared by text


def test_collab_is_inside_shakespeare_and_solo_is_its_clean_complement():
    """The claim the name check rests on, verified on the real data."""
    key = lambda records: {(r.user, r.text) for r in records}  # noqa: E731
    full, collab, solo = (key(load_records(n)) for n in
                          ("shakespeare", "shakespeare-collab", "shakespeare-solo"))
    assert collab <= full and collab and not collab & solo and solo | collab == full
    assert not {u for u, _ in collab} & {u for u, _ in solo}
    with pytest.raises(DpfleetError, match="not public"):  # and no long text is shared either
        check_public_texts([("shakespeare-collab", t) for _, t in collab], (t for _, t in full),
                           "shakespeare")
    check_public_texts([("shakespeare-collab", t) for _, t in collab], (t for _, t in solo),
                       "shakespeare-solo")


def test_pipeline_refuses_collab_next_to_private_shakespeare():
    values = {"pool": {"sources": ["wikitext2", "shakespeare-collab"], "records": [10, 10]}}
    with pytest.raises(DpfleetError, match="'shakespeare-collab' is not public next to the "
                                           "private dataset 'shakespeare'"):
        parse_pipeline(values)
    values["simulation"] = {"data": {"dataset": "shakespeare-solo"}}
    parse_pipeline(values)
    with pytest.raises(DpfleetError, match="'kjv' is not public"):
        parse_pipeline({"pool": {"sources": ["kjv"], "records": [5]},
                        "simulation": {"data": {"dataset": "kjv"}}})
    with pytest.raises(DpfleetError, match="teacher vocabulary's corpus 'wikitext2'"):
        parse_pipeline({"pool": {"sources": ["kjv"], "records": [5]},
                        "simulation": {"data": {"dataset": "wikitext2"}}})


def test_defaults_are_consistent():
    cfg = parse_pipeline({})
    assert cfg.simulation.data.dataset == "shakespeare"
    assert not any(s.startswith("shakespeare") for s in cfg.pool.sources)


def test_jsonl_private_file_holding_public_text_is_refused(tmp_path):
    path = tmp_path / "private.jsonl"
    path.write_text(json.dumps({"user": "a", "text": "  in the BEGINNING god created the heaven "
                                                     "and the earth.\n"}) + "\n"
                    + json.dumps({"user": "b", "text": "Amen."}) + "\n")
    cfg = parse_pipeline({"pool": {"sources": ["kjv"], "records": [3]},
                          "simulation": {"data": {"dataset": "jsonl", "path": str(path)}}})
    clean = Pool([[5, 6, 7, 8]] * 2, ["kjv"] * 2,
                 ["And God said, Let there be light: and there was light.", "Amen."])
    check_pool_is_public(cfg, clean)  # "Amen." is too short to count as a shared record
    leaked = Pool([[5, 6, 7, 8]] * 3, ["kjv"] * 3, clean.texts + [VERSE])
    with pytest.raises(DpfleetError, match=r"repeats private records of 'jsonl'.*kjv: 1 records"):
        check_pool_is_public(cfg, leaked)


def test_public_tokenizer_corpus_must_not_be_the_private_data():
    cfg = parse_config({"data": {"dataset": "shakespeare-solo"},
                        "tokenizer": {"kind": "sentencepiece", "corpus": "shakespeare"}})
    with pytest.raises(DpfleetError, match="tokenizer.corpus 'shakespeare' is not public"):
        make_tokenizer(cfg, [])


def test_cli_names_the_overlap_in_one_line(tmp_path, capsys):
    config = tmp_path / "p.toml"
    config.write_text('[pool]\nsources = ["shakespeare-collab"]\nrecords = [10]\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["public", "pipeline", str(config), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "shakespeare-collab" in err[0]
