"""Every non-private choice a user can make is a caveat wherever the guarantee is shown, and plugin
mechanisms are declared, opt-in for `auto`, resumable and told apart from the built-ins by class.

Attacks, each through the public surface and asserted on the value:

* a non-private word vocabulary (`tokenizer.allow_nonprivate_vocabulary`): a word only one user
  wrote is in the checkpoint's and the phone bundle's vocabulary, and the run said "fully private"
  (privacy.json, summary.json, the report, the CLI summary) and exported without a word;
* a plugin mechanism (an installed `dpfleet.mechanisms` entry point): the service's public status
  said "fully private", `dp.mechanism = "auto"` adopted it and claimed eps above the target, and
  its run could not be resumed at all;
* a class whose `__module__` names a dpfleet module passed as built-in (accounted as verified).
"""

import asyncio
import importlib.metadata
import json
import sys

import numpy as np
import pytest
from crashes import Crash, failing_on_round
from safetensors.numpy import load_file
from test_dp_vocabulary import CANARY, population, with_canary
from test_noise_secrecy import CFG as SECRECY_CFG
from test_noise_secrecy import QUIET

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.mechanisms import registry
from dpfleet.coordinator.mechanisms.registry import is_built_in
from dpfleet.coordinator.run_privacy.caveats import config_facts, run_caveats
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.edge.client_data import split_users
from dpfleet.extensions import TreeMechanism

PLUGIN = '''
from dpfleet.coordinator.mechanisms.registry import register
from dpfleet.coordinator.mechanisms.tree import TreeMechanism


class Mine(TreeMechanism):
    """The tree's noise under another name, claiming a tenth of its prefix error (`auto` prefers it)."""

    name = "mine"

    def prefix_error(self, rounds):
        return 0.1 * super().prefix_error(rounds)


register("mine", Mine, lambda r, s, p: Mine(), lambda identity: Mine(), "a plugin: the tree, renamed")
'''


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    """An installed package whose `dpfleet.mechanisms` entry point registers "mine"."""
    (tmp_path / "dpfleet_plugin_mine.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    point = importlib.metadata.EntryPoint("mine", "dpfleet_plugin_mine", registry.ENTRY_POINTS)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [point] if group == registry.ENTRY_POINTS
                        else real(group=group, **kw) if group else real(**kw))
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    yield "mine"
    sys.modules.pop("dpfleet_plugin_mine", None)


# -- a non-private vocabulary -------------------------------------------------------------------

def _vocabulary_run(tmp_path, capsys, **extra):
    """`dpfleet simulate` of a word-vocabulary run built without DP, one user writing CANARY."""
    data = tmp_path / "users.jsonl"
    users = population(60)
    names = [f"u{i}" for i in range(len(users))]
    one = names.index(split_users(names, 0.2, parse_config({}).seed)[0][0])  # a training user
    users[one] = with_canary([users[one]])[0]  # the one user who writes CANARY
    data.write_text("".join(json.dumps({"user": n, "text": " ".join(u)}) + "\n"
                            for n, u in zip(names, users, strict=True)))
    values = {"rounds": 1, "eval_every": 1, "checkpoint_every": 0,
              "data": {"dataset": "jsonl", "path": str(data), "seq_len": 8, "max_examples": 4,
                       "test_fraction": 0.2},
              "tokenizer": {"kind": "word", "vocab_size": 64, "allow_nonprivate_vocabulary": True},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                        "max_length": 8},
              "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4}, **extra}
    config = tmp_path / "vocab.toml"
    config.write_text(to_toml(values))
    run = tmp_path / "run"
    main(["simulate", str(config), "--out", str(run), "--quiet"])
    return run, capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_attack_a_nonprivate_vocabulary_is_a_caveat_everywhere_and_ships_only_when_accepted(
        tmp_path, capsys):
    """Before: the canary was in the checkpoint's and the bundle's vocabulary while privacy.json
    and summary.json said fully_private true, the report opened "# Privacy report" and
    `export --bundle` shipped it without a word. Now every place shows the one caveat list, and
    the bundle needs --accept-caveats and records the caveats it was exported with."""
    run, out = _vocabulary_run(tmp_path, capsys, debug_nonprivate=True)
    assert CANARY in (run / "checkpoint" / "tokenizer" / "tokenizer.json").read_text()
    privacy = json.loads((run / "privacy.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    caveats = privacy["caveats"]
    assert privacy["fully_private"] is False and summary["fully_private"] is False
    assert caveats[0].startswith("NOT FULLY PRIVATE") and "non-private vocabulary" in caveats[0]
    assert "un-noised debug telemetry" in caveats[0]  # debug_nonprivate: the other choice here
    assert summary["caveats"] == caveats and 0 < privacy["epsilon"] < float("inf")
    assert (run / "privacy_report.md").read_text().splitlines()[0] == f"**{caveats[0]}**"
    assert [f"WARNING               {c}" for c in caveats] == [
        x for x in out if x.startswith("WARNING")][:len(caveats)]

    bundle = tmp_path / "bundle"
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(run / "checkpoint"), "--bundle", str(bundle)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "--accept-caveats" in err[0] and "non-private vocabulary" in err[0]
    assert not bundle.exists()

    main(["export", str(run / "checkpoint"), "--bundle", str(bundle), "--accept-caveats"])
    capsys.readouterr()
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["caveats"] == caveats and manifest["fully_private"] is False
    assert CANARY in (bundle / "tokenizer" / "tokenizer.json").read_text()  # what was accepted


def test_each_nonprivate_choice_is_a_caveat_from_the_config_alone():
    """What the service shows before a privacy.json exists: the same reasons as the run's."""
    base = {"data": {"dataset": "jsonl", "path": "x.jsonl"}}
    cases = [
        ({"tokenizer": {"kind": "word", "allow_nonprivate_vocabulary": True}}, "non-private vocabulary"),
        ({"debug_nonprivate": True}, "un-noised debug telemetry"),
        ({"dp": {"noise_seed": 3}}, "research mode (dp.noise_seed = 3)"),
    ]
    assert run_caveats(config_facts(parse_config(base))) == ([], True)
    for values, says in cases:
        caveats, holds = run_caveats(config_facts(parse_config({**base, **values})))
        assert says in caveats[0] and holds, (values, caveats)


# -- plugin mechanisms --------------------------------------------------------------------------

class Spoofed(TreeMechanism):
    """A caller's class that claims to live in dpfleet's own mechanism package."""

    name = "spoofed"


Spoofed.__module__ = "dpfleet.coordinator.mechanisms.tree"


def test_attack_a_spoofed_module_name_is_not_built_in(tmp_path):
    """Before: `built_in` tested the module name, so this caller's mechanism was accounted as
    dpfleet's own (accounted_by_dpfleet true, no caveat). Now the registry's classes decide."""
    from test_api import CONFIG, USERS, TinyLM, WordIds

    import dpfleet

    assert not is_built_in(Spoofed()) and is_built_in(TreeMechanism())
    result = dpfleet.simulate(CONFIG, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                              run_dir=tmp_path / "run", noise=Spoofed())
    privacy = json.loads((result.run_dir / "privacy.json").read_text())
    assert privacy["accounted_by_dpfleet"] is False and privacy["fully_private"] is False
    assert "declared by the custom mechanism" in privacy["caveats"][0]


def test_attack_the_service_status_declares_a_plugin_mechanism(tmp_path, plugin):
    """Before: /v1/public/status said fully_private true, caveats [] for the plugin's run."""
    from service_fleet import tiny_cfg
    from test_service_security import raw

    from dpfleet.service.server import shutdown, start

    cfg = tiny_cfg(rounds=1, dp={"mechanism": plugin})

    async def status():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        public = json.loads((await raw(running.url, "GET", "/v1/public/status"))[1])
        running.driver.stop()
        await shutdown(running)
        return public

    public = asyncio.run(status())
    assert public["fully_private"] is False
    assert "eps as declared by the plugin 'mine'" in public["caveats"][0]
    assert public["caveats"] == run_caveats(config_facts(cfg))[0]


TARGET = 6.0
UNPLANNED = {k: v for k, v in SECRECY_CFG["dp"].items() if k not in ("noise_multiplier", "report_goal")}
PLANNED = {**SECRECY_CFG, "rounds": 4, "eval_every": 4, "checkpoint_every": 0,
           "dp": {**UNPLANNED, "target_epsilon": TARGET, "mechanism": "auto"}}


def _mechanism(result):
    return json.loads((result.run_dir / "config.json").read_text())["dp"]["mechanism"]


@pytest.mark.slow
def test_attack_auto_takes_a_plugin_only_when_asked_and_then_meets_the_target(tmp_path, plugin):
    """Before: `auto` adopted the installed plugin (it claims the least noise) and the run claimed
    eps above the target (the plan's z met it by PLD, the declared plugin is accounted by RDP).
    Now `auto` keeps to the built-ins unless dp.auto_plugins, and then claims eps <= target."""
    default = simulation.run_simulation(parse_config(PLANNED), tmp_path / "default", **QUIET)
    assert _mechanism(default) in ("tree", "banded", "blt")
    assert default.privacy["fully_private"] is True and default.privacy["epsilon"] <= TARGET
    opted = {**PLANNED, "dp": {**PLANNED["dp"], "auto_plugins": True}}
    chosen = simulation.run_simulation(parse_config(opted), tmp_path / "opted", **QUIET)
    assert _mechanism(chosen) == plugin
    assert 0 < chosen.privacy["epsilon"] <= TARGET and chosen.privacy["method"] == "rdp"
    assert "eps as declared by the plugin 'mine'" in chosen.privacy["caveats"][0]


RESUMED = {**SECRECY_CFG, "rounds": 4, "eval_every": 4, "checkpoint_every": 2,
           "dp": {**SECRECY_CFG["dp"], "mechanism": "mine", "noise_seed": 11}}


def test_attack_a_plugin_run_resumes_to_the_uninterrupted_runs_model(tmp_path, plugin, capsys):
    """Before: `dpfleet simulate --resume` refused every plugin run ("resume it with the same
    mechanism (dpfleet.simulate(..., noise=...))", which a config-named plugin cannot be given).
    Now the installed plugin is rebuilt from the registry and the resumed run ends with the
    uninterrupted run's weights."""
    whole = simulation.run_simulation(parse_config(RESUMED), tmp_path / "whole", **QUIET)
    with pytest.MonkeyPatch.context() as mp:
        failing_on_round(mp, 3)  # right after the resume point of round 2: nothing lost
        with pytest.raises(Crash):
            simulation.run_simulation(parse_config(RESUMED), tmp_path / "run", **QUIET)
    main(["simulate", "--resume", str(tmp_path / "run"), "--quiet"])
    capsys.readouterr()
    a = load_file(str(whole.run_dir / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert privacy["mechanism"] == plugin and privacy["rounds"] == 4
    assert privacy["epsilon"] == pytest.approx(whole.privacy["epsilon"], rel=1e-12)
