"""Round 0: the starting model (the config's init or the caller's module, after public pretraining
if any, before any private round) is evaluated on the same held-out rows as every round and shown
next to the final model and the unigram baseline: summary.json, the `dpfleet simulate` result
block, accuracy.png, `dpfleet compare`, TensorBoard (step 0) and the service's status page. Its
accuracy is checked against an evaluation of the initial weights computed here."""

import copy
import json
import shutil
from pathlib import Path

import matplotlib.figure
import pytest
import torch
from crashes import Crash, failing_on_round
from service_fleet import tiny_cfg
from test_api import CONFIG, USERS, TinyLM, WordIds
from test_tensorboard import read_events

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.evaluation import evaluate, split_held_out
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.coordinator.run import run, user_records
from dpfleet.coordinator.state.run_dir import INITIAL_EVAL, to_toml
from dpfleet.coordinator.state.tensorboard_log import TENSORBOARD
from dpfleet.export.models import build_model
from dpfleet.export.params import set_flat

RUN = {**CONFIG, "rounds": 2, "eval_every": 1, "tensorboard": True}


def held_out_rows(config: dict):
    """The held-out rows a run of `config` on USERS scores, prepared here as the run does."""
    cfg = parse_config(copy.deepcopy(config))
    _, data = prepare_data(cfg, None, user_records(USERS), WordIds())
    return split_held_out(data.test, cfg.data.eval_examples or None, cfg.data.test_fraction)[0]


def simulate(path: Path, model: torch.nn.Module, config: dict = RUN):
    return dpfleet.simulate(copy.deepcopy(config), model=model, users=USERS, tokenizer=WordIds(),
                            progress=False, run_dir=path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One run of a seeded TinyLM, the initial weights kept, and the accuracy figure's data as
    drawn (the figure `plot_accuracy` saves, spied on at `savefig`)."""
    torch.manual_seed(5)
    model = TinyLM()
    initial = copy.deepcopy(model)
    drawn = []
    real = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn.append([line.get_xydata().tolist() for line in fig.axes[0].get_lines()])
        return real(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", spy)
        result = simulate(tmp_path_factory.mktemp("start") / "run", model)
    expected = evaluate(initial, held_out_rows(RUN))
    return result, expected, drawn


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_starting_model_is_evaluated_and_in_the_summary(tiny):
    result, expected, _ = tiny
    initial = summary_of(result.run_dir)["initial"]
    assert initial["round"] == 0
    assert initial["accuracy"] == expected["accuracy"] and initial["loss"] == expected["loss"]
    assert initial["perplexity"] == expected["perplexity"]
    assert initial["scored_tokens"] == expected["scored_tokens"] > 0
    assert "no privacy cost" in initial["privacy"]
    assert result.initial_accuracy == expected["accuracy"]
    assert result.initial_perplexity == expected["perplexity"]
    # written at the start, the same record (metrics.jsonl stays one line per released round)
    assert json.loads((result.run_dir / INITIAL_EVAL).read_text()) == initial
    assert [m["round"] for m in result.metrics] == [1, 2]
    loaded = dpfleet.Result.load(result.run_dir, model=TinyLM(), tokenizer=WordIds())
    assert loaded.initial_accuracy == expected["accuracy"]


def test_accuracy_png_has_a_point_at_round_0(tiny):
    result, expected, drawn = tiny
    (lines,) = drawn  # one figure saved: accuracy.png
    model_line = lines[0]
    assert model_line == [[0.0, expected["accuracy"]]] + [[m["round"], m["accuracy"]] for m in result.metrics]
    baseline = lines[1]  # axhline: the unigram baseline, drawn next to it
    assert baseline[0][1] == result.unigram_accuracy


def test_tensorboard_has_the_starting_model_at_step_0(tiny):
    result, expected, _ = tiny
    events = {(step, tag): value for step, tag, value in read_events(result.run_dir / TENSORBOARD)}
    assert events[0, "eval/accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)  # float32
    assert events[0, "eval/perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6)
    assert {tag for step, tag in events if step == 0} == {"eval/accuracy", "eval/loss", "eval/perplexity"}


def test_compare_shows_the_starting_model(tiny, capsys):
    result, expected, _ = tiny
    main(["compare", str(result.run_dir), "--json", "--no-plot"])
    (figures,) = json.loads(capsys.readouterr().out)["runs"]
    assert figures["initial_accuracy"] == expected["accuracy"]
    main(["compare", str(result.run_dir), "--no-plot"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("starting model"))
    assert f"{expected['accuracy']:.4f}" in row


def test_an_unfinished_run_in_compare_reads_initial_eval_json(tiny, capsys, tmp_path):
    result, expected, _ = tiny

    cut = tmp_path / "cut"
    shutil.copytree(result.run_dir, cut)
    (cut / "summary.json").unlink()
    main(["compare", str(cut), "--json", "--no-plot"])
    assert json.loads(capsys.readouterr().out)["runs"][0]["initial_accuracy"] == expected["accuracy"]
    (cut / INITIAL_EVAL).write_text(json.dumps({"round": 0, "accuracy": "high"}))  # edited: no figure
    main(["compare", str(cut), "--json", "--no-plot"])
    assert json.loads(capsys.readouterr().out)["runs"][0]["initial_accuracy"] is None


def test_a_resumed_run_shows_the_starting_model_it_started_with(tmp_path, monkeypatch):
    torch.manual_seed(5)
    model = TinyLM()
    initial = copy.deepcopy(model)
    config = {**RUN, "tensorboard": False}
    failing_on_round(monkeypatch, 2)
    with pytest.raises(Crash):
        simulate(tmp_path / "run", model, config)
    written = json.loads((tmp_path / "run" / INITIAL_EVAL).read_text())
    # resumed with other weights: the starting model is the one the run started from, read back
    out = run(parse_config(copy.deepcopy(config)), tmp_path / "run", model=TinyLM(), users=USERS,
              tokenizer=WordIds(), progress=False, resume=True, log=lambda s: None)
    assert summary_of(out.run_dir)["initial"] == written
    assert written["accuracy"] == evaluate(initial, held_out_rows(config))["accuracy"]


def test_the_cli_result_block_shows_the_starting_model(tmp_path, capsys):
    from test_noise_secrecy import CFG as TINY

    config = tmp_path / "tiny.toml"
    config.write_text(to_toml({**TINY, "rounds": 1, "eval_every": 1, "checkpoint_every": 0}))
    main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    out = capsys.readouterr().out.splitlines()
    initial = summary_of(tmp_path / "run")["initial"]
    (line,) = [row for row in out if row.startswith("next-token accuracy")]
    assert f"starting model {initial['accuracy']:.4f}" in line and "unigram baseline" in line
    assert any(row.startswith("starting model") and "no privacy cost" in row for row in out)
    # and TFF's three accuracies, the model's next to the baselines' (summary.json's figures)
    summary = summary_of(tmp_path / "run")
    final, tff = summary["final"], summary["unigram_baseline"]["tff"]
    (line,) = [row for row in out if row.startswith("TFF next-word acc.")]
    names = ("accuracy", "accuracy_without_out_of_vocab", "accuracy_without_out_of_vocab_or_end_of_sentence")
    assert f"model {' / '.join(format(final['tff_' + n], '.4f') for n in names)}   unigram " \
           f"{' / '.join(format(tff['unigram'][n], '.4f') for n in names)}" in line


def test_the_status_page_shows_the_starting_model(tmp_path):
    from dpfleet.service.admin import public_status
    from dpfleet.service.boot import boot
    from dpfleet.service.rounds import HttpCollector
    from dpfleet.service.servelog import ServiceLog
    from dpfleet.service.status_page import render

    booted = boot(tiny_cfg(rounds=1), tmp_path / "state", log=lambda s: None)
    log = ServiceLog(tmp_path / "service.log")
    try:
        engine = booted.engine
        model = build_model(engine.model_cfg)  # the starting weights, on a model of our own
        set_flat(model, engine.server.theta)
        expected = evaluate(model, engine.test_rows)["accuracy"]
        status = public_status(HttpCollector(booted, log))
    finally:
        log.close()
        booted.store.close()
    assert status["initial_accuracy"] == expected
    assert status["unigram_accuracy"] == booted.baseline["accuracy"]
    page = render(status, {"rounds": []})
    assert "starting model" in page and f"{expected:.4f}" in page and "no privacy cost" in page
