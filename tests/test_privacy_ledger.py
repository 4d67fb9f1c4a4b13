"""The run's privacy ledger: every eps dpfleet states is the conversion of one composed DpEvent.

Pins: privacy.json's figures of a DP-vocabulary run and of an adaptive-clipping run are the ones
the run stated before its privacy was kept as a ledger, bit for bit for the zCDP (values recorded from the
code before the ledger, and checked against a hand-composed sum of rho) and to 1e-9 relative for
eps: the PLD conversion's FFTs and exps round differently on another CPU (2.5e-12 relative on an
AMD EPYC with AVX2 against the Intel Xeon with AVX-512 the values were recorded on), while any
change to what is accounted moves eps by far more."""

import copy
import json

import dp_accounting
import pytest
from cli_helpers import run_here

from dpfleet.coordinator.accounting.ledger import check_ledger
from dpfleet.coordinator.accounting.privacy_report import render_privacy_report
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_sensitivity
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.errors import DpfleetError


def _run(tmp_path_factory, name, tokenizer=None, aggregation="plain", **dp):
    tmp = tmp_path_factory.mktemp(name)
    data = tmp / "users.jsonl"
    words = ["thee", "thou", "lord", "love", "sweet", "night", "king", "good"]
    lines = [{"user": f"u{i}", "text": " ".join(words[(i + j) % 8] for j in range(5)) + f" own{i}"}
             for i in range(120)]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    values = {"rounds": 3, "eval_every": 3, "checkpoint_every": 0,
              "data": {"dataset": "jsonl", "path": str(data), "seq_len": 8, "max_examples": 4,
                       "test_fraction": 0.2},
              "tokenizer": tokenizer or {"kind": "word", "vocab_size": 64,
                                         "allow_nonprivate_vocabulary": True},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                        "max_length": 8},
              "aggregation": {"kind": aggregation},
              "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4, **dp}}
    result = run_simulation(parse_config(values), tmp / "run", progress=False, log=lambda s: None)
    return json.loads((result.run_dir / "privacy.json").read_text())


@pytest.fixture(scope="module")
def vocabulary_run(tmp_path_factory):
    return _run(tmp_path_factory, "vocab", {"kind": "word", "vocab_size": 64, "dp_words_per_user": 8})


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    return _run(tmp_path_factory, "adaptive", adaptive_clipping=True, clip_count_stddev=2.0)


def test_a_vocabulary_runs_figures_are_unchanged(vocabulary_run):
    p = vocabulary_run
    training = zcdp_from_sensitivity(1.0, p["sensitivity_squared"])
    assert p["zcdp"] == training
    assert p["epsilon"] == epsilon_from_zcdp(training, 1e-6)
    total = p["total_with_vocabulary"]
    assert total["zcdp"] == training + 0.5  # the vocabulary: sigma 1, sensitivity 1
    assert total["epsilon"] == epsilon_from_zcdp(training + 0.5, 1e-6)
    assert total["delta"] == 1e-6 + 1e-7
    assert total["vocabulary_epsilon"] == epsilon_from_zcdp(0.5, 1e-6)
    # recorded from the code before the ledger
    assert _pinned((p["zcdp"], p["epsilon"], total["zcdp"], total["epsilon"]), PINNED["vocab"])


def test_an_adaptive_clipping_runs_figures_are_unchanged(adaptive_run):
    """The model noise and the clipped-count noise are one Gaussian of multiplier z (Thm. 1)."""
    p = adaptive_run
    assert p["zcdp"] == zcdp_from_sensitivity(1.0, p["sensitivity_squared"])
    assert p["epsilon"] == epsilon_from_zcdp(p["zcdp"], 1e-6)
    assert _pinned((p["zcdp"], p["epsilon"]), PINNED["adaptive"])


PINNED = {"vocab": ("0x1.0000000000000p+0", "0x1.d24f271abe80fp+2", "0x1.8000000000000p+0",
                   "0x1.2822f33200d0bp+3"),
          "adaptive": ("0x1.0000000000000p+0", "0x1.d24f271abe80fp+2")}


def _pinned(figures: tuple[float, ...], hexes: tuple[str, ...]) -> bool:
    """(zcdp, eps, ...) pairs against their pins: each zCDP bit for bit, each eps to 1e-9."""
    pins = [float.fromhex(h) for h in hexes]
    return (list(figures[::2]) == pins[::2]
            and list(figures[1::2]) == pytest.approx(pins[1::2], rel=1e-9, abs=0))


def test_privacy_json_holds_the_runs_ledger(vocabulary_run, adaptive_run):
    ledger = vocabulary_run["ledger"]
    assert [e["name"] for e in ledger["entries"]] == ["dp_ftrl", "dp_vocabulary"]
    assert [p["name"] for p in ledger["entries"][0]["parts"]] == ["model_noise"]
    assert ledger["entries"][1]["event"] == {"module_name": "dp_accounting.dp_event",
                                             "class_name": "GaussianDpEvent", "noise_multiplier": 1.0}
    assert (ledger["zcdp"], ledger["epsilon"]) == (1.5, vocabulary_run["total_with_vocabulary"]["epsilon"])
    assert check_ledger(vocabulary_run).zcdp == 1.5
    report = render_privacy_report(vocabulary_run)
    assert "| dp_vocabulary | GaussianDpEvent(noise_multiplier = 1) | 0.5 | 4.887 | 1e-07 |" in report
    assert "| **composed** | | **1.5** | **9.254** | **1.1e-06** (total) |" in report
    # adaptive clipping: z_delta^-2 = 1 - 1/16; the counts' 2 sigma_b = 4, sens^2 = 2
    parts = adaptive_run["ledger"]["entries"][0]["parts"]
    assert [p["name"] for p in parts] == ["model_noise", "clipped_count_noise"]
    assert parts[0]["zcdp"] == pytest.approx(2 * (1 - 1 / 16) / 2)
    assert parts[1]["zcdp"] == pytest.approx(2 / (2 * 16)) and parts[1]["epsilon"] < adaptive_run["epsilon"]
    assert parts[1]["event"]["noise_multiplier"] == pytest.approx(4 / 2**0.5)


def test_a_ledger_with_a_release_removed_is_refused(vocabulary_run):
    """Attack: drop the vocabulary's entry from privacy.json's ledger; the reader recomputes the
    ledger's rho (1.0, training only) against the 1.5 the file states, and refuses it."""
    edited = copy.deepcopy(vocabulary_run)
    del edited["ledger"]["entries"][1]
    with pytest.raises(DpfleetError, match=r"ledger's zcdp 1\.5 disagrees with its ledger \(1\)"):
        check_ledger(edited)
    edited["ledger"].update(zcdp=1.0, epsilon=vocabulary_run["epsilon"])  # and its total edited too
    with pytest.raises(DpfleetError, match=r"total_with_vocabulary zcdp 1\.5 disagrees .* \(1\)"):
        check_ledger(edited)


def test_a_ledger_entry_must_match_its_event_and_name_only_dp_accounting_events(vocabulary_run):
    edited = copy.deepcopy(vocabulary_run)
    edited["ledger"]["entries"][1]["zcdp"] = 0.05  # rho 0.05 for sigma = 1
    with pytest.raises(DpfleetError, match=r"'dp_vocabulary' states rho 0\.05, its event 0\.5"):
        check_ledger(edited)
    edited = copy.deepcopy(vocabulary_run)
    edited["ledger"]["entries"][1]["event"].update(module_name="os", class_name="system")
    with pytest.raises(DpfleetError, match="unknown event 'system'"):
        check_ledger(edited)


def test_fred_refuses_to_compose_with_an_edited_run(vocabulary_run, tmp_path):
    from dpfleet.public.fred_privacy import dpftrl_zcdp

    (tmp_path / "privacy.json").write_text(json.dumps(vocabulary_run))
    assert dpftrl_zcdp(tmp_path) == (1.0, False)
    edited = copy.deepcopy(vocabulary_run)
    edited["zcdp"] = 0.25  # the training's rho understated
    (tmp_path / "privacy.json").write_text(json.dumps(edited))
    with pytest.raises(DpfleetError, match=r"training zcdp 0\.25 disagrees with its ledger \(1\)"):
        dpftrl_zcdp(tmp_path)


def test_fred_figures_through_the_ledger_are_unchanged():
    """FreD's own and composed eps (PLD of the composed events; RDP beside ring noise), recorded
    from the code before the ledger."""
    from dpfleet.public.fred_privacy import fred_releases, privacy_figures

    fig = privacy_figures(3.1, 4.7, 2e-6, "user", 0.37)
    ring = privacy_figures(3.1, 4.7, 2e-6, "user", 0.37, dpftrl_discrete=True)
    assert fig["zcdp"] == 0.5 / 3.1**2 + 0.5 / 4.7**2 and fig["composed_zcdp"] == fig["zcdp"] + 0.37
    assert [fig["epsilon"], fig["composed_epsilon"], ring["composed_epsilon"]] == pytest.approx(
        [float.fromhex(h) for h in ("0x1.a434e5573634bp+0", "0x1.1ba5efe25c8f7p+2",
                                    "0x1.301d32ac0a01ep+2")], rel=1e-9, abs=0)
    (release,) = fred_releases(fig)
    assert (release["key"], release["noise_multipliers"]) == ("fred", [3.1, 4.7])
    assert release["zcdp"] == fig["zcdp"]


def test_a_ring_noise_runs_ledger_checks_by_rdp_also_where_its_figures_moved(tmp_path_factory):
    """The tree's ring noise converts by RDP, and the reader checks by the ledger's conversion;
    a run whose eps is no guarantee keeps its figures in `accounted_not_a_guarantee` (with_caveats)
    and the reader checks them there."""
    p = _run(tmp_path_factory, "ring", aggregation="secagg", noise_seed=3, adaptive_clipping=True,
             clip_count_stddev=2.0)
    assert p["ledger"]["conversion"] == "rdp" and p["epsilon"] == epsilon_from_zcdp(p["zcdp"], 1e-6, "rdp")
    assert check_ledger(p).zcdp == p["zcdp"]
    moved = {**p, "accounted_not_a_guarantee": {k: p[k] for k in ("zcdp", "epsilon", "epsilon_rdp")},
             "zcdp": None, "epsilon": None, "epsilon_rdp": None}
    assert check_ledger(moved).zcdp == p["zcdp"]
    moved["accounted_not_a_guarantee"]["epsilon"] *= 0.5
    with pytest.raises(DpfleetError, match="training epsilon"):
        check_ledger(moved)


def test_dpfleet_account_checks_a_runs_privacy_json(vocabulary_run, tmp_path):
    """`dpfleet account --privacy-json`: the ledger, each release's figures; an edited file (the
    vocabulary's entry removed) is one error line naming the stated and the recomputed rho.
    In process (`run_here`): a subprocess would spend seconds importing dp_accounting again."""
    path = tmp_path / "privacy.json"
    path.write_text(json.dumps(vocabulary_run))
    account = ["account", "--privacy-json", str(path)]
    proc = run_here(*account)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "  dp_vocabulary          zCDP 0.5  epsilon 4.887  (+ delta 1e-07)" in text
    assert ("  dp_ftrl                zCDP 1  epsilon 7.286\n"
            "    model_noise          zCDP 1  epsilon 7.286\n") in text
    assert "  composed               zCDP 1.5  epsilon 9.254 at delta 1e-06, pld" in text
    edited = copy.deepcopy(vocabulary_run)
    del edited["ledger"]["entries"][1]
    path.write_text(json.dumps(edited))
    proc = run_here(*account)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: privacy.json's the ledger's zcdp 1.5 disagrees with its "
                                   "ledger (1): the file was edited or is damaged")


def test_training_vocabulary_and_fred_compose_into_one_event():
    """The accountant's ledger with a vocabulary and FreD: one ComposedDpEvent of the three, rho
    as the run always added it (training + (vocabulary + FreD)), the thresholds' delta added."""
    from dpfleet.coordinator.mechanisms.dp_vocabulary import VocabularyDP
    from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
    from dpfleet.public.fred_privacy import fred_releases

    acc = RunAccountant(1.3, 1e-6, vocabulary=VocabularyDP(noise=2.0, delta=1e-7).describe())
    for r in range(3):
        acc.record(["a", f"b{r}"], False)
    ledger = acc.ledger(fred_releases({"level": "user", "z_mean": 3.0, "z_cov": 4.0}))
    training = acc.figures()["zcdp"]
    assert [e.name for e in ledger.entries] == ["dp_ftrl", "dp_vocabulary", "fred"]
    assert ledger.zcdp == training + (0.125 + (0.5 / 9 + 0.5 / 16))
    assert ledger.total(1e-6, "pld")["delta"] == 1e-6 + 1e-7
    assert ledger.event() == dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(1.3 / acc.figures()["sensitivity_squared"] ** 0.5),
        dp_accounting.GaussianDpEvent(2.0),
        dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(3.0),
                                       dp_accounting.GaussianDpEvent(4.0)])])
