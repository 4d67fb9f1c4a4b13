"""A run that is not fully private says so first, everywhere it is shown (`run_privacy/caveats.py`).

privacy.json and summary.json carry `fully_private` and the same `caveats` (a short first line,
then the longer statements); privacy_report.md's first line and the `dpfleet simulate` summary's
first line are that caveat; the service's status page shows it at the top. Where the stated eps is
no guarantee at all (a deliberately broken audit, a
generated population, no noise) privacy.json's epsilon is null; research mode and honest-only noise keep
the number (it holds against those who lack the seed / when all are honest), caveat first. And a
broken audit's checkpoint is refused by `dpfleet export`. Each asserted on the values.
"""

import asyncio
import copy
import json
import math
import re

import pytest
from test_api import CONFIG, USERS, TinyLM, WordIds
from test_audit import CFG as AUDIT_CFG
from test_extensions import Short

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import load_checkpoint
from dpfleet.extensions import TreeMechanism
from dpfleet.service.status_page import render

SEEDED = {**CONFIG, "dp": {**CONFIG["dp"], "noise_seed": 7}}
AUDIT = {**AUDIT_CFG, "rounds": 2, "eval_every": 2}


def _simulate(tmp_path, name, config=CONFIG, **kw):
    return dpfleet.simulate(config, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                            run_dir=tmp_path / name, **kw)


def _shown(run_dir):
    """privacy.json, summary.json and the report's first line, as written."""
    privacy = json.loads((run_dir / "privacy.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return privacy, summary, (run_dir / "privacy_report.md").read_text().splitlines()[0]


def test_a_fully_private_run_says_so_and_has_no_caveat(tmp_path):
    privacy, summary, first = _shown(_simulate(tmp_path, "plain").run_dir)
    assert privacy["fully_private"] is True and privacy["caveats"] == []
    assert summary["fully_private"] is True and summary["caveats"] == []
    assert first == "# Privacy report" and math.isfinite(privacy["epsilon"])


def test_research_mode_is_flagged_everywhere_and_keeps_its_eps(tmp_path):
    """dp.noise_seed: eps holds against whoever lacks the seed, so the number stays, caveat first."""
    result = _simulate(tmp_path, "seeded", SEEDED)
    privacy, summary, first = _shown(result.run_dir)
    assert privacy["fully_private"] is False and privacy["caveats"][0].startswith("NOT FULLY PRIVATE")
    assert "research mode (dp.noise_seed = 7)" in privacy["caveats"][0]
    assert any("does NOT hold against anyone who knows the noise seed" in c for c in privacy["caveats"])
    assert summary["caveats"] == privacy["caveats"] and summary["fully_private"] is False
    assert first == f"**{privacy['caveats'][0]}**"
    assert privacy["epsilon"] == result.epsilon and 0 < privacy["epsilon"] < math.inf


def test_honest_only_noise_is_flagged_and_keeps_its_eps(tmp_path):
    honest = {**CONFIG, "aggregation": {"kind": "secagg"}, "dp": {**CONFIG["dp"], "noise": "gaussian"}}
    privacy, summary, first = _shown(_simulate(tmp_path, "honest", honest).run_dir)
    assert privacy["honest_participants_only"] is True and privacy["fully_private"] is False
    assert "only against honest participants" in privacy["caveats"][0]
    assert privacy["caveats"][1].startswith("PRIVATE ONLY AGAINST HONEST PARTICIPANTS")
    assert summary["caveats"] == privacy["caveats"] and first == f"**{privacy['caveats'][0]}**"
    assert 0 < privacy["epsilon"] < math.inf


class Declared(Short):
    """A caller's mechanism with the tree's noise and a declared sensitivity (MaxP)."""

    name = "declared"

    def stream(self, dim, std, key, segment=0, purpose="model"):
        return TreeMechanism().stream(dim, std, key, segment, purpose)


def test_a_custom_mechanisms_declared_accounting_is_flagged_and_keeps_its_eps(tmp_path):
    privacy, summary, first = _shown(_simulate(tmp_path, "declared", noise=Declared()).run_dir)
    assert privacy["fully_private"] is False and summary["caveats"] == privacy["caveats"]
    assert first == f"**{privacy['caveats'][0]}**"
    assert "declared by the custom mechanism" in privacy["caveats"][0]
    assert "DECLARED ACCOUNTING" in privacy["caveats"][1] and 0 < privacy["epsilon"] < math.inf


def test_the_cli_summary_opens_with_the_caveat(tmp_path, capsys):
    """The first line `dpfleet simulate` prints after the run is the caveat, before any figure."""
    config = tmp_path / "seeded.toml"
    config.write_text(to_toml({**AUDIT, "rounds": 1, "dp": {**AUDIT["dp"], "noise_seed": 3}}))
    main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    caveats = json.loads((tmp_path / "run" / "privacy.json").read_text())["caveats"]
    warnings = json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"]
    first = lines.index("WARNING               " + caveats[0])
    summary = lines[first:]  # the caveats, then the result's own warnings (result_warnings.py)
    assert summary[:len(caveats) + len(warnings)] == [f"WARNING               {w}"
                                                       for w in (*caveats, *warnings)]
    assert [x.startswith("next-token accuracy") for x in summary].index(True) == len(caveats) + len(warnings)
    assert not any(x.startswith(("next-token", "privacy ", "perplexity")) for x in lines[:first])


@pytest.mark.parametrize("broken", [None, "noise-off", "clipping", "noise-div-10"])
def test_attack_a_broken_audit_states_no_eps_and_its_checkpoint_does_not_export(tmp_path, capsys,
                                                                                  broken):
    """Before: `audit --debug-nonprivate` left privacy.json at the configured eps with no flag, a
    report opening with a DP statement, and a checkpoint `dpfleet export` accepted."""
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(AUDIT))
    run = tmp_path / "run"
    main(["audit", str(config), "--out", str(run), "--quiet", "--canaries", "32",
          "--text-canaries", "0", *(["--break", broken] if broken else [])])
    capsys.readouterr()
    privacy, summary, first = _shown(run)
    audit = json.loads((run / "audit.json").read_text())
    assert 0 < audit["epsilon_accounted"] < math.inf  # the audit still compares against it
    if broken is None:
        assert privacy["fully_private"] is True and privacy["epsilon"] == audit["epsilon_accounted"]
        load_checkpoint(run / "checkpoint")  # a normal run's checkpoint loads for export
        return
    assert privacy["epsilon"] is None and privacy["epsilon_rdp"] is None and privacy["zcdp"] is None
    assert privacy["accounted_not_a_guarantee"]["epsilon"] == audit["epsilon_accounted"]
    assert privacy["fully_private"] is False and summary["fully_private"] is False
    assert privacy["caveats"][0].startswith(f"NOT PRIVATE: deliberately broken audit run (--break {broken})")
    assert summary["caveats"] == privacy["caveats"] and first == f"**{privacy['caveats'][0]}**"
    with pytest.raises(DpfleetError, match=rf"not private.*--break {broken}"):
        load_checkpoint(run / "checkpoint")
    out = tmp_path / "onnx"
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(run / "checkpoint"), "--format", "onnx", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and f"--break {broken}" in err[0], err
    assert not out.exists()


@pytest.mark.slow
def test_a_normal_run_checkpoint_exports(tmp_path, capsys):
    """The export refusal is only for marked checkpoints: a normal run's exports (ONNX)."""
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml({**AUDIT, "rounds": 1, "eval_every": 1}))
    main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    capsys.readouterr()
    main(["export", str(tmp_path / "run" / "checkpoint"), "--format", "onnx", "--out",
          str(tmp_path / "onnx")])
    assert json.loads(capsys.readouterr().out)["format"] == "onnx"


def test_audit_debug_nonprivate_is_now_break_noise_off(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(AUDIT))
    with pytest.raises(SystemExit) as exit_:
        main(["audit", str(config), "--out", str(tmp_path / "run"), "--debug-nonprivate"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--break noise-off" in err[0], err
    assert not (tmp_path / "run").exists()


def test_run_caveats_of_each_fact():
    """The one function: each fact alone, what it says first and whether eps stays a guarantee."""
    from dpfleet.coordinator.run_privacy.caveats import config_facts, run_caveats

    base = config_facts(parse_config(copy.deepcopy(CONFIG)))
    assert run_caveats(base) == ([], True)
    cases = [
        ({"noise_seed": 7}, "research mode (dp.noise_seed = 7)", True),
        ({"honest_participants_only": True, "honest_participants_only_statement": "PRIVATE ONLY X"},
         "only against honest participants", True),
        ({"audit_break": {"mode": "noise-off", "what": "noise switched off"}},
         "deliberately broken audit run (--break noise-off)", False),
        ({"accounted_by_dpfleet": False, "mechanism": "mine"}, "declared by the custom mechanism", True),
        ({"generated_population": {"clients": 9, "statement": "GENERATED POPULATION: y"}},
         "generated population", False),
        ({"noise_multiplier": 0.0}, "no noise", False),
    ]
    for fact, says, guarantee in cases:
        caveats, holds = run_caveats({**base, **fact})
        assert says in caveats[0] and holds is guarantee, (fact, caveats)
        assert caveats[0].startswith("NOT FULLY PRIVATE" if guarantee else "NOT PRIVATE")
    both, holds = run_caveats({**base, **cases[0][0], **cases[2][0]})
    assert both[0].startswith("NOT PRIVATE") and "research mode" in both[0] and not holds


def test_status_page_shows_the_caveat_at_the_top(tmp_path):
    from service_fleet import tiny_cfg
    from test_service_security import raw

    from dpfleet.service.server import shutdown, start

    cfg = tiny_cfg(rounds=1, dp={"noise_seed": 5})

    async def main_():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        public = json.loads((await raw(running.url, "GET", "/v1/public/status"))[1])
        page = (await raw(running.url, "GET", "/"))[1].decode()
        running.driver.stop()
        await shutdown(running)
        return public, page

    public, page = asyncio.run(main_())
    assert public["fully_private"] is False and "research mode (dp.noise_seed = 5)" in public["caveats"][0]
    body = page[page.index("<body>"):]
    shown = re.sub(r"<[^>]+>", " ", body)
    assert shown.index(public["caveats"][0].split(":")[0]) < shown.index("dpfleet coordinator")
    plain = render({"run_state": "running"}, {})
    assert "NOT " not in re.sub(r"<[^>]+>", " ", plain)


def test_a_marked_checkpoint_is_refused_and_a_clean_save_in_its_folder_clears_the_mark(tmp_path):
    """The mark travels with the folder (written before the weights); a later normal run saving
    into the same folder (--overwrite) must not inherit it."""
    from dpfleet.edge.tokenizer import WordTokenizer
    from dpfleet.export.checkpoint import save_checkpoint
    from dpfleet.export.models import ModelConfig, build_model

    tok = WordTokenizer.build(["a b c d", "b c d e"], 16)
    cfg = ModelConfig(arch="cifg", vocab_size=tok.vocab_size, embedding_dim=4, hidden_dim=8, projection_dim=4)
    model = build_model(cfg)
    folder = tmp_path / "checkpoint"
    why = "deliberately broken audit run (--break clipping)"
    save_checkpoint(folder, model, cfg, tok, not_private=why)
    with pytest.raises(DpfleetError, match=rf"is not private .*: {re.escape(why)}$"):
        load_checkpoint(folder)
    save_checkpoint(folder, model, cfg, tok)
    assert load_checkpoint(folder)[0] == cfg


def test_with_caveats_moves_every_stated_eps_of_a_run_without_guarantee():
    """No eps of a voided run stays where a reader takes it for the guarantee (the vocabulary's
    composed total and the timer's worst case too), and marking twice keeps what was moved."""
    from dpfleet.coordinator.run_privacy.caveats import with_caveats

    figures = {"epsilon": 2.0, "epsilon_rdp": 2.5, "zcdp": 0.1,
               "total_with_vocabulary": {"epsilon": 3.0, "delta": 2e-6},
               "timer_worst_case": {"epsilon": 4.0}}
    broken = {"mode": "clipping", "what": "clipping disabled"}
    once = with_caveats({"noise_seed": None, **figures}, broken)
    assert [once[k] for k in ("epsilon", "epsilon_rdp", "zcdp")] == [math.inf] * 3
    assert "total_with_vocabulary" not in once and once["timer_worst_case"] is None
    assert once["accounted_not_a_guarantee"] == figures and once["fully_private"] is False
    twice = with_caveats({**once, "epsilon": 2.0, "epsilon_rdp": 2.5, "zcdp": 0.1})
    assert twice["accounted_not_a_guarantee"] == figures and twice["epsilon"] == math.inf
    fine = with_caveats({"noise_seed": None, **figures})
    assert fine["epsilon"] == 2.0 and fine["fully_private"] is True and fine["caveats"] == []
