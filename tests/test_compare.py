"""`dpfleet compare RUN_DIR...`: two real tiny runs (the second with `--set` overrides), and an
unfinished copy; the table's and the JSON's figures are the runs' own summary.json / privacy.json
(metrics.jsonl for the unfinished one), the config keys that differ are exactly the overridden
ones, a plot is written, and a folder that is no run is one `error:` line."""

import json
import re
import shutil

import pytest
from test_noise_secrecy import CFG as TINY

from dpfleet.cli import main
from dpfleet.coordinator.cli.compare_table import comparison, differing_keys, render, wall_time
from dpfleet.coordinator.run import Result
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.coordinator.state.run_record import RunRecord

CONFIG = {**TINY, "rounds": 2, "eval_every": 1, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """base: the config; more: `--set dp.noise_multiplier=2 --set rounds=3`; cut: `more` as an
    interrupted run leaves it after round 2 (no summary / privacy, its metrics so far)."""
    root = tmp_path_factory.mktemp("compare")
    config = root / "tiny.toml"
    config.write_text(to_toml(CONFIG))
    main(["simulate", str(config), "--out", str(root / "base"), "--quiet"])
    main(["simulate", str(config), "--out", str(root / "more"), "--quiet",
          "--set", "dp.noise_multiplier=2", "--set", "rounds=3"])
    shutil.copytree(root / "more", root / "cut")
    for name in ("summary.json", "privacy.json"):
        (root / "cut" / name).unlink()
    metrics = (root / "cut" / "metrics.jsonl").read_text().splitlines()
    (root / "cut" / "metrics.jsonl").write_text("\n".join(metrics[:2]) + "\n")
    return root


def read(run, name):
    return json.loads((run / name).read_text())


def compare(capsys, *args):
    main(["compare", *map(str, args)])
    return capsys.readouterr()


@pytest.mark.slow
def test_the_figures_are_the_runs_own_and_the_differing_keys_are_the_overrides(runs, capsys, tmp_path):
    out = compare(capsys, runs / "base", runs / "more", "--json", "--plot", tmp_path / "p.png")
    result = json.loads(out.out)
    assert result["differing_keys"] == ["rounds", "dp.noise_multiplier"]
    for figures, name in zip(result["runs"], ("base", "more"), strict=True):
        summary, privacy = read(runs / name, "summary.json"), read(runs / name, "privacy.json")
        assert figures["run"] == str(runs / name) and figures["finished"] is True
        assert figures["accuracy"] == summary["final"]["accuracy"]
        assert figures["unigram_accuracy"] == summary["unigram_baseline"]["accuracy"]
        assert figures["perplexity"] == summary["final"]["perplexity"]
        assert figures["epsilon"] == privacy["epsilon"] and figures["delta"] == privacy["delta"]
        assert figures["wall_seconds"] == summary["wall_seconds"]
        assert figures["rounds_completed"] == summary["rounds_completed"] == figures["rounds_planned"]
        assert figures["noise_mechanism"] == summary["noise_mechanism"]
        config = read(runs / name, "config.json")
        assert figures["config"] == {"rounds": config["rounds"],
                                     "dp.noise_multiplier": config["dp"]["noise_multiplier"]}
    assert [f["config"]["dp.noise_multiplier"] for f in result["runs"]] == [1.0, 2.0]
    assert result["runs"][0]["epsilon"] > result["runs"][1]["epsilon"]  # more noise, less eps
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_table_shows_each_runs_figures_in_its_column(runs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plot's default place: compare.png here
    monkeypatch.setenv("COLUMNS", "200")  # both runs side by side (narrower: blocks, tested below)
    out = compare(capsys, runs / "base", runs / "more").out.splitlines()
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in out)}
    assert rows["base"] == ["more"]  # the header: one column per run, by folder name
    for i, name in enumerate(("base", "more")):
        s, p = read(runs / name, "summary.json"), read(runs / name, "privacy.json")
        assert rows["accuracy"][i] == f"{s['final']['accuracy']:.4f}"
        assert rows["unigram baseline"][i] == f"{s['unigram_baseline']['accuracy']:.4f}"
        assert rows["eps"][i] == f"{p['epsilon']:.2f} at delta 1e-06"
        assert rows["rounds done"][i] == f"{s['rounds_completed']} of {s['rounds_completed']}"
        assert rows["wall time"][i] == wall_time(s["wall_seconds"])
        assert rows["fully private"][i] == "yes" and rows["status"][i] == "finished"
        warned = s.get("warnings")  # the summary's own words, up to each warning's colon
        assert rows["warnings"][i] == ("-" if warned is None else
                                       "; ".join(w.split(":")[0] for w in warned) or "none")
    assert rows["dp.noise_multiplier"] == ["1.0", "2.0"] and rows["rounds"] == ["2", "3"]
    assert out[-1] == "plot: compare.png" and (tmp_path / "compare.png").is_file()


@pytest.mark.slow
def test_an_unfinished_run_is_shown_as_such_from_its_metrics(runs, capsys):
    result = json.loads(compare(capsys, runs / "cut", runs / "more", "--json", "--no-plot").out)
    cut = result["runs"][0]
    metrics = [json.loads(line) for line in (runs / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert cut["finished"] is False and cut["rounds_completed"] == 2 and cut["rounds_planned"] == 3
    assert cut["accuracy"] == metrics[-1]["accuracy"] and cut["accuracy_round"] == 2
    assert cut["epsilon"] == metrics[-1]["epsilon"] and cut["epsilon_so_far"] is True
    assert cut["wall_seconds"] is None and result["differing_keys"] == []
    table = compare(capsys, runs / "cut", runs / "base", "--no-plot").out
    assert "unfinished" in table and f"{metrics[-1]['accuracy']:.4f} (round 2)" in table
    assert f"{metrics[-1]['epsilon']:.2f} at delta 1e-06, so far" in table
    assert "(an unfinished run: " in table


@pytest.mark.slow
def test_tensorboard_export_of_each_run(runs, capsys, tmp_path):
    from test_tensorboard import read_events

    out = compare(capsys, runs / "base", runs / "more", "--no-plot", "--tensorboard", tmp_path / "tb").out
    for name in ("base", "more"):
        steps = {step for step, *_ in read_events(tmp_path / "tb" / name)}
        assert steps == set(range(0, read(runs / name, "config.json")["rounds"] + 1))  # 0: starting model
        assert f"tensorboard: {tmp_path / 'tb' / name}" in out


def _error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["compare", *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.slow
def test_a_folder_that_is_no_run_is_one_line(runs, capsys, tmp_path):
    assert f"{tmp_path / 'nope'}: no such run directory" in _error(capsys, tmp_path / "nope", runs / "base")
    assert "is not a run directory (no config.json)" in _error(capsys, tmp_path, "--no-plot")
    assert "a run's checkpoint/ is inside its run directory" in _error(
        capsys, runs / "base" / "checkpoint", "--no-plot")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert "bad/config.json is not valid JSON" in _error(capsys, tmp_path / "bad", "--no-plot")
    assert "cannot write the plot" in _error(capsys, runs / "base", "--plot", tmp_path / "no" / "p.png")


def test_differing_keys_counts_a_key_one_run_lacks():
    def record(config):
        return RunRecord(path=None, config=config, metrics=[], summary=None, privacy=None)

    a = record({"rounds": 2, "dp": {"clip_norm": 1.0, "delta": 1e-6}})
    b = record({"rounds": 2, "dp": {"clip_norm": 1.0, "delta": 1e-5}, "debug_nonprivate": False})
    assert differing_keys([a, b]) == ["dp.delta", "debug_nonprivate"] and differing_keys([a, a]) == []
    watched = record({**a.config, "tensorboard": True})  # how a run is watched: no difference
    assert differing_keys([a, watched]) == []
    assert [wall_time(s) for s in (None, 3.25, 65, 3725)] == ["-", "3.2 s", "1 min 05 s", "1 h 02 min"]


def test_a_runs_warnings_and_caveats_are_named_in_the_table():
    summary = {"final": {"accuracy": 0.05, "perplexity": 400.0}, "unigram_baseline": {"accuracy": 0.07},
               "rounds_completed": 3, "wall_seconds": 2.0, "fully_private": False,
               "caveats": ["NOT FULLY PRIVATE: research mode", "the longer statement"],
               "warnings": ["below the unigram baseline: held-out accuracy 0.0500 <= 0.0700, ...",
                            "eps above dp.warn_epsilon: eps = 55.00 at delta = 1e-06 > 10, ..."]}
    record = RunRecord(path="r", config={"rounds": 3, "dp": {"delta": 1e-6}}, metrics=[],
                       summary=summary, privacy={"epsilon": 55.0, "delta": 1e-6})
    older = RunRecord(path="o", config={"rounds": 3}, metrics=[],
                      summary={k: v for k, v in summary.items() if k != "warnings"}, privacy={})
    table = render(comparison([record, older], ["r", "o"]), width=200)
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", ln.strip()) for ln in table.splitlines())}
    assert rows["warnings"] == ["below the unigram baseline; eps above dp.warn_epsilon", "-"]
    assert rows["fully private"] == ["NO (2 caveats)", "NO (2 caveats)"]
    assert rows["eps"] == ["55.00 at delta 1e-06", "none (see caveats)"]
    assert rows["accuracy"] == ["0.0500", "0.0500"] and rows["wall time"] == ["2.0 s", "2.0 s"]


@pytest.mark.slow
def test_many_runs_fit_a_terminal_in_blocks_of_columns(runs):
    """Four runs side by side were over 200 columns: the runs are headed by their folder names and
    go on in a second block below when the terminal is narrow, every figure still shown."""
    from dpfleet.coordinator.state.run_record import read_run

    paths = [runs / "base", runs / "more", runs / "cut", runs / "base"]
    result = comparison([read_run(p) for p in paths], [str(p) for p in paths])
    text = render(result, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    blocks = text.split("\n\n")
    assert len(blocks) >= 2 and all("accuracy" in b and "eps" in b for b in blocks)
    heads = " ".join(b.splitlines()[0] for b in blocks).split()
    assert heads == ["1:base", "2:more", "3:cut", "4:base"]  # a name repeated: numbered
    wide = render(comparison([read_run(p) for p in paths[:3]], [str(p) for p in paths[:3]]), width=400)
    assert "\n\n" not in wide and wide.splitlines()[0].split() == ["base", "more", "cut"]


TFF_ROW, TFF_BASELINES = "TFF acc 1/2/3", ("  unigram", "  frequent word")
TFF = ("accuracy", "accuracy_without_out_of_vocab", "accuracy_without_out_of_vocab_or_end_of_sentence")


def _rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", ln.strip()) for ln in text.splitlines())}


@pytest.mark.slow
def test_the_tff_accuracies_are_shown_next_to_their_baselines(runs, capsys, tmp_path):
    """A finished run's three TFF accuracies (summary.json's `final`) and the unigram and
    most-frequent-word baselines' (`unigram_baseline.tff`) in the JSON and the table; a run of an
    older dpfleet (none of them in its summary) shows null and a dash; an unfinished run its last
    evaluated round's (metrics.jsonl), its baselines null."""
    older = tmp_path / "older"
    shutil.copytree(runs / "base", older)
    summary = read(older, "summary.json")
    summary["final"] = {k: v for k, v in summary["final"].items() if not k.startswith("tff_")}
    del summary["unigram_baseline"]["tff"]
    (older / "summary.json").write_text(json.dumps(summary))
    paths = (runs / "base", older, runs / "cut")
    result = json.loads(compare(capsys, *paths, "--json", "--no-plot").out)
    base, old, cut = (f["tff"] for f in result["runs"])
    s = read(runs / "base", "summary.json")
    assert base["model"] == {name: s["final"][f"tff_{name}"] for name in TFF}
    for strip in ("unigram", "most_frequent_word"):
        assert base[strip] == {name: s["unigram_baseline"]["tff"][strip][name] for name in TFF}
    assert all(isinstance(base["model"][name], float) for name in TFF)  # the tiny run scored them
    assert Result.load(runs / "base").tff == base  # the Python API reads the same figures back
    nothing = {name: None for name in TFF}
    assert old == {"model": nothing, "unigram": nothing, "most_frequent_word": nothing}
    metrics = [json.loads(line) for line in (runs / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert cut["model"] == {name: metrics[-1][f"tff_{name}"] for name in TFF}
    assert cut["unigram"] == cut["most_frequent_word"] == nothing

    narrow = render(result, width=100)  # in blocks of columns, each with the rows and the legend
    assert max(len(line) for line in narrow.splitlines()) <= 100
    assert all(TFF_ROW in block for block in narrow.split("\n\n"))
    text = render(result, width=200)
    rows = _rows(text)
    assert rows[TFF_ROW] == [" / ".join(f"{base['model'][n]:.4f}" for n in TFF), "-",
                             " / ".join(f"{cut['model'][n]:.4f}" for n in TFF)]
    for label, strip in zip(TFF_BASELINES, ("unigram", "most_frequent_word"), strict=True):
        assert rows[label.strip()] == [" / ".join(f"{base[strip][n]:.4f}" for n in TFF), "-", "-"]
    assert any(line.startswith("(TFF acc 1/2/3: ") for line in text.splitlines())  # the legend


def test_the_tff_row_by_hand():
    """Hand-set figures, one missing: each cell is the three accuracies to 4 places, a missing
    one a dash; a summary with the figures as text (an edited file) shows dashes, no crash."""
    tff = {"unigram": {"token": 5, "accuracy": 0.1, "accuracy_without_out_of_vocab": 0.125,
                       "accuracy_without_out_of_vocab_or_end_of_sentence": 0.0},
           "most_frequent_word": {"token": 9, "accuracy": 0.05, "accuracy_without_out_of_vocab": None,
                                  "accuracy_without_out_of_vocab_or_end_of_sentence": 0.0625}}
    summary = {"final": {"accuracy": 0.3, "perplexity": 9.0, "tff_accuracy": 0.25,
                         "tff_accuracy_without_out_of_vocab": 0.5,
                         "tff_accuracy_without_out_of_vocab_or_end_of_sentence": 0.375},
               "unigram_baseline": {"accuracy": 0.07, "tff": tff}, "rounds_completed": 3}
    edited = {**summary, "final": {**summary["final"], "tff_accuracy": "0.25"},
              "unigram_baseline": {"accuracy": 0.07, "tff": "text"}}
    records = [RunRecord(path=p, config={"rounds": 3}, metrics=[], summary=s, privacy={})
               for p, s in (("r", summary), ("e", edited))]
    result = comparison(records, ["r", "e"])
    assert result["runs"][0]["tff"]["most_frequent_word"] == {
        "accuracy": 0.05, "accuracy_without_out_of_vocab": None,
        "accuracy_without_out_of_vocab_or_end_of_sentence": 0.0625}
    rows = _rows(render(result, width=100))
    assert rows[TFF_ROW] == ["0.2500 / 0.5000 / 0.3750", "- / 0.5000 / 0.3750"]
    assert rows["unigram"] == ["0.1000 / 0.1250 / 0.0000", "-"]
    assert rows["frequent word"] == ["0.0500 / - / 0.0625", "-"]
