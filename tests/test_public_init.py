"""[pretrain]: the private run starts from weights trained on public text (public/public_init.py).

Scored on the values: the model the first private round starts from IS the public-trained one
(and not the seeded init), the same clients are chosen with and without pretraining (the public
loop leaves the run's torch stream alone, so the two are paired), a cached rerun starts from
identical weights, and a corpus overlapping the private data is refused (one error line)."""

import json

import numpy as np
import pytest
from test_noise_secrecy import CFG as SECRECY_CFG
from test_noise_secrecy import QUIET

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.edge.precision import resolve_precision
from dpfleet.public import public_init

PRE = {"corpus": ["kjv"], "steps": 3, "batch_size": 4, "lr": 0.01}
CFG = {**SECRECY_CFG, "rounds": 2, "eval_every": 2}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(public_init, "cache_dir", lambda: tmp_path / "cache")


def start_of(tmp_path, name, values):
    seen = {}

    def before_round(r, theta):
        seen.setdefault(r, theta.copy())

    result = simulation.run_simulation(parse_config(values), tmp_path / name, before_round=before_round,
                                       pretrain=public_init.pretrain_on_public, **QUIET)
    lines = (result.run_dir / "participation.jsonl").read_text().splitlines()
    log = [json.loads(x)["devices"] for x in lines]
    return seen[0], log, result


@pytest.mark.slow
def test_the_first_round_starts_from_the_public_weights(tmp_path):
    plain, plain_log, _ = start_of(tmp_path, "plain", CFG)
    pre, pre_log, result = start_of(tmp_path, "pre", {**CFG, "pretrain": PRE})
    cached = list((tmp_path / "cache" / "pretrain").glob("*.npy"))
    assert len(cached) == 1
    np.testing.assert_array_equal(pre, np.load(cached[0]))
    assert np.abs(pre - plain).max() > 1e-4  # three Adam steps at lr 0.01 move the init
    assert pre_log == plain_log  # paired: the same devices in every round
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["public_pretraining"]["corpus"] == ["kjv"] and not summary["public_pretraining"]["cached"]
    # client.precision's default "auto" (config.py says why) for this model's size
    default = resolve_precision("auto", params=sum(p.numel() for p in result.model.parameters()))
    assert summary["public_pretraining"]["precision"] == {"used": default.name, "reason": default.reason}
    assert "kjv" in (result.run_dir / "privacy_report.md").read_text()
    again, _, result = start_of(tmp_path, "again", {**CFG, "pretrain": PRE})
    np.testing.assert_array_equal(again, pre)
    assert json.loads((result.run_dir / "summary.json").read_text())["public_pretraining"]["cached"]


def test_a_corpus_overlapping_the_private_data_is_refused(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(to_toml({**CFG, "pretrain": {**PRE, "corpus": ["shakespeare-collab"]}}))
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "shakespeare-collab" in err[0]
    assert not list((tmp_path / "cache").glob("pretrain/*.npy"))


def test_steps_without_a_corpus_mismatch_is_one_error():
    from dpfleet.errors import DpfleetError

    with pytest.raises(DpfleetError, match="pretrain.steps = 0"):
        parse_config({**CFG, "pretrain": {"corpus": ["kjv"], "steps": 0}})


def test_the_front_door_hands_the_step_down_and_the_coordinator_alone_refuses(tmp_path):
    """The coordinator does not import dpfleet.public (the layers): `dpfleet.simulate` (and the CLI,
    test above) pass the pretraining step; `run_simulation` without it is one clear error."""
    import dpfleet
    from dpfleet.errors import DpfleetError

    result = dpfleet.simulate({**CFG, "pretrain": PRE}, run_dir=tmp_path / "api", progress=False)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["public_pretraining"]["corpus"] == ["kjv"]
    with pytest.raises(DpfleetError, match="public pretraining step"):
        simulation.run_simulation(parse_config({**CFG, "pretrain": PRE}), tmp_path / "alone", **QUIET)
