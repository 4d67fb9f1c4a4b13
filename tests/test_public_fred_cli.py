"""`dpfleet public fred-stats` / `fred-rank` end to end on real text (GloVe-50), and their errors."""

import json

import numpy as np
import pytest
from cli_helpers import run_here
from click.testing import CliRunner

from dpfleet.edge.datasets import load_records
from dpfleet.errors import DpfleetError


def _jsonl(path, records, users=None):
    with path.open("w") as fh:
        for i, r in enumerate(records):
            fh.write(json.dumps({"user": users[i] if users else r.user, "text": r.text}) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fred")
    solo = load_records("shakespeare-solo")
    by_user = {}
    for r in solo:
        if len(by_user.setdefault(r.user, [])) < 4:
            by_user[r.user].append(r)
    private = [r for u in sorted(by_user)[:60] for r in by_user[u]]
    return {
        "root": root,
        "private": _jsonl(root / "private.jsonl", private),
        "collab": _jsonl(root / "collab.jsonl", load_records("shakespeare-collab")[:300]),
        "wiki": _jsonl(root / "wiki.jsonl", load_records("wikitext2")[:300]),
    }


def _config(files, **over):
    values = {"embedder": "glove", "private": "jsonl", "private_path": str(files["private"]),
              "cohort_size": 50, "pca_dim": 4, "pca_records": 100, "noise_seed": 0, "epsilon": 4.0,
              "delta": 1e-5, "clip": 3.0, **over}
    lines = ["[fred]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = files["root"] / f"fred-{abs(hash(str(values)))}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fred_stats_then_rank(files):
    from dpfleet.public.cli import public

    out = files["root"] / "stats"
    runner = CliRunner()
    res = runner.invoke(public, ["fred-stats", str(_config(files)), "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "fred_privacy.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(4.0, rel=2e-3)
    assert summary["cohort"] == 50 and summary["d"] == 4
    assert 0 <= summary["recommended_pca_dim"] <= 50
    assert "User-level DP" in (out / "fred_privacy.md").read_text()
    with np.load(out / "fred_stats.npz") as z:
        assert z["mean"].shape == (4,) and z["cov"].shape == (4, 4)
        assert np.linalg.eigvalsh(z["cov"]).min() >= -1e-9
    table = files["root"] / "rank.json"
    res = runner.invoke(public, ["fred-rank", "--stats", str(out / "fred_stats.npz"), "--candidates",
                                 f"jsonl:{files['wiki']}", f"jsonl:{files['collab']}",
                                 "--json-out", str(table)])
    assert res.exit_code == 0, res.output
    rows = json.loads(table.read_text())["rows"]
    # Shakespeare's co-written plays are closer to the other plays than Wikipedia is
    assert rows[0]["candidate"].endswith("collab.jsonl") and rows[0]["fred"] < rows[1]["fred"]
    assert (out / "fred_rank.png").stat().st_size > 1000

    from dpfleet.public.fred_job import fred_select

    wiki, collab = load_records("wikitext2")[:40], load_records("shakespeare-collab")[:40]
    texts = [r.text for r in wiki + collab]
    sources = ["wikitext2"] * 40 + ["shakespeare-collab"] * 40
    chosen, report = fred_select(out / "fred_stats.npz", texts, sources, 0.25)
    assert len(chosen) == 20 and all(sources[i] == "shakespeare-collab" for i in chosen)
    assert report["fred_by_source"]["shakespeare-collab"] < report["fred_by_source"]["wikitext2"]


def _run_privacy(rho: float, conversion: str = "pld") -> dict:
    """privacy.json of a run whose DP-FTRL is rho-zCDP, with its ledger."""
    from dpfleet.coordinator.accounting.ledger import Ledger, training_entry

    ledger = Ledger((training_entry((0.5 / rho) ** 0.5, 1.0),))
    return {"zcdp": ledger.zcdp, "epsilon": ledger.epsilon(1e-6, conversion),
            "ledger": ledger.to_json(1e-6, conversion)}


def test_composition_with_a_dpftrl_run(files):
    from dpfleet.public.fred_job import load_fred_config, run_fred_stats

    run = files["root"] / "sim"
    run.mkdir()
    # stands in for a finished `dpfleet simulate` run: only its privacy.json (and ledger) is read
    (run / "privacy.json").write_text(json.dumps(_run_privacy(0.2)))
    cfg = load_fred_config(_config(files, dpftrl_run=str(run)))
    summary = run_fred_stats(cfg, files["root"] / "composed", progress=False, log=lambda s: None)
    fig = summary["privacy"]
    assert fig["composed_zcdp"] == pytest.approx(fig["zcdp"] + 0.2)
    assert fig["composed_epsilon"] > fig["epsilon"]
    report = (files["root"] / "composed" / "fred_privacy.md").read_text()
    assert "Composed with the same users' DP-FTRL" in report
    assert "PLD of the three Gaussian" in report
    # a run whose noise was the discrete Gaussian in the SecAgg ring composes by RDP
    (run / "privacy.json").write_text(json.dumps({**_run_privacy(0.2, "rdp"), "noise_kind": "discrete"}))
    ring = run_fred_stats(cfg, files["root"] / "ring", progress=False, log=lambda s: None)["privacy"]
    assert ring["composed_zcdp"] == pytest.approx(fig["composed_zcdp"])
    assert ring["composed_epsilon"] > fig["composed_epsilon"]
    assert "RDP" in (files["root"] / "ring" / "fred_privacy.md").read_text()


def assert_clean_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(line.startswith("error:") and needle in line for line in proc.stderr.splitlines()), proc.stderr


def test_user_mistakes_are_one_line_errors(files, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[fred]\ncohort = 10\n")
    assert_clean_error(run_here("public", "fred-stats", str(bad), "--out", str(tmp_path / "o")),
                       "invalid config key 'fred.cohort'; did you mean 'fred.cohort_size'?")
    assert_clean_error(run_here("public", "fred-stats", str(_config(files, cohort_size=500)), "--out",
                               str(tmp_path / "o")), "needs at least that many")
    assert_clean_error(run_here("public", "fred-stats", str(_config(files, level="sample",
                                                                   dpftrl_run="x")),
                               "--out", str(tmp_path / "o")), "fred.level = 'user'")
    assert_clean_error(run_here("public", "fred-rank", "--stats", str(tmp_path / "none.npz"),
                               "--candidates", "kjv"), "FreD statistics not found")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert_clean_error(run_here("public", "fred-rank", "--stats", str(tmp_path / "junk.npz"),
                               "--candidates", "kjv"), "not a FreD statistics file")


def test_pipeline_fred_selection_needs_a_stats_file():
    from dpfleet.public.pipeline import parse_pipeline

    with pytest.raises(DpfleetError, match='selection = "fred" needs public.fred_stats'):
        parse_pipeline({"public": {"selection": "fred", "first_stage_rounds": 0,
                                   "fred_stats": "/nonexistent/fred_stats.npz"}})


def test_pipeline_pretrains_on_the_fred_closest_source(files, tiny_teacher_vocab, tmp_path):
    from dpfleet.public.fred_job import load_fred_config, run_fred_stats
    from dpfleet.public.pipeline import parse_pipeline, run_pipeline

    stats = tmp_path / "stats"
    run_fred_stats(load_fred_config(_config(files)), stats, progress=False, log=lambda s: None)
    values = {
        "public": {"first_stage_rounds": 0, "selection": "fred", "kd_beta": 0.0, "fraction": 0.5,
                   "fred_stats": str(stats / "fred_stats.npz"), "steps": 5, "batch_size": 8},
        "pool": {"sources": ["wikitext2", "shakespeare-collab"], "records": [20, 20], "seq_len": 12},
        "simulation": {
            "rounds": 2, "eval_every": 2,
            "data": {"dataset": "shakespeare-solo", "seq_len": 12, "max_clients": 8,
                     "max_examples": 8, "eval_examples": 50},
            "tokenizer": {"path": str(tiny_teacher_vocab.tokenizer.model_file.parent)},
            "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 16, "projection_dim": 8},
            "dp": {"report_goal": 4, "noise_multiplier": 0.5},
        },
    }
    summary = run_pipeline(parse_pipeline(values), tmp_path / "run", progress=False, log=lambda s: None)
    assert summary["sources"]["shakespeare-collab"]["selected"] == 20
    assert summary["sources"]["wikitext2"]["selected"] == 0
    assert summary["fred_by_source"]["shakespeare-collab"] < summary["fred_by_source"]["wikitext2"]
    assert summary["epsilon_with_fred"] > summary["epsilon"]
    # composed by the run's one accountant, rendered by the one renderer (issue 31)
    privacy = summary["privacy"]
    fred = summary["fred_privacy"]
    rho = 0.5 / fred["z_mean"] ** 2 + 0.5 / fred["z_cov"] ** 2
    assert privacy["total_with_releases"]["zcdp"] == pytest.approx(privacy["zcdp"] + rho, rel=1e-12)
    assert summary["epsilon_with_fred"] == privacy["total_with_releases"]["epsilon"]
    report = (tmp_path / "run" / "simulation" / "privacy_report.md").read_text()
    assert "## Other DP releases about the same devices" in report and "FreD statistics" in report


def test_example_fred_config_is_valid():
    from pathlib import Path

    from dpfleet.public.fred_job import load_fred_config

    cfg = load_fred_config(Path(__file__).parent.parent / "examples" / "fred.toml")
    assert cfg.fred.level == "user" and cfg.fred.epsilon == 0.6 and cfg.fred.pca_dim == 16
