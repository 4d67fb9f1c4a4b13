"""The release gate: `dpfleet export --bundle --policy FILE` refuses a run that misses a rule.

Attacks first: a run with a tiny noise (eps far above the ceiling), a model at or below the
unigram baseline and the starting model, a run in research mode (a caveat): each is refused with
one `error:` line naming the rule and the run's value, exit code 2, and no bundle folder, no
signing key. A run that passes gets a bundle whose signed manifest records the policy (rules,
sha256 of the file) and the values it passed; editing those values breaks the signature.

Two 2-round runs of the secrecy tests' tiny CIFG serve every test (module fixture):
`private` (z = 6: a device in the 2-leaf binary tree touches the leaf and the root, so
S = 2 C^2 and rho = S / (2 z^2 C^2) = 1/36; a clip norm of 1e-6 keeps its model, updates and
noise alike, at the starting one: accuracy 2/1029 held-out tokens, equal to the starting model's,
below the unigram baseline's 74/1029) and `loose` (z = 0.05, rho = 2 / (2 * 0.0025) = 400;
dp.noise_seed set: the research-mode caveat, and a model deterministic under that seed).
"""

from __future__ import annotations

import hashlib
import json

import pytest
from bundle_helpers import program_cache
from test_noise_secrecy import CFG

from dpfleet.cli import main
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.edge.bundle_format import MANIFEST, PUBLIC_KEY, BundleError, verify_bundle
from dpfleet.edge.device_client import BundleClient
from dpfleet.errors import DpfleetError
from dpfleet.export.policy import ReleasePolicy

pytest.importorskip("onnxruntime")

RUNS = {"private": {"noise_multiplier": 6.0, "clip_norm": 1e-6},
        "loose": {"noise_multiplier": 0.05, "noise_seed": 7}}


@pytest.fixture(scope="module")
def xdg(tmp_path_factory):
    """The CLI's program cache (under XDG_CACHE_HOME) is the session's shared one."""
    root = tmp_path_factory.mktemp("xdg")
    (root / "dpfleet").mkdir()
    shared = program_cache(tmp_path_factory)
    shared.mkdir(parents=True, exist_ok=True)  # a dangling link would stop the cache's mkdir
    (root / "dpfleet" / "programs").symlink_to(shared)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, xdg):
    root = tmp_path_factory.mktemp("policy-runs")
    out = {}
    for name, dp in RUNS.items():
        cfg = {**CFG, "rounds": 2, "eval_every": 2, "checkpoint_every": 0,
               "dp": {**CFG["dp"], "delta": 1e-5, **dp}}
        (root / f"{name}.toml").write_text(to_toml(cfg))
        main(["simulate", str(root / f"{name}.toml"), "--out", str(root / name), "--quiet"])
        out[name] = root / name
    return out


def policy(tmp_path, text: str):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def export(run, bundle, policy_file, capsys, *extra) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `dpfleet export RUN/checkpoint --bundle B --policy P`."""
    capsys.readouterr()
    try:
        main(["export", str(run / "checkpoint"), "--bundle", str(bundle), "--policy", str(policy_file),
              *extra])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.slow
def test_the_runs_are_what_the_attacks_need(runs):
    private = json.loads((runs["private"] / "privacy.json").read_text())
    loose = json.loads((runs["loose"] / "privacy.json").read_text())
    assert private["zcdp"] == pytest.approx(1 / 36) and private["caveats"] == []
    assert loose["zcdp"] == pytest.approx(400) and loose["epsilon"] > 100
    assert loose["caveats"][0].startswith("NOT FULLY PRIVATE")


@pytest.mark.parametrize("run, rules, words, extra", [
    ("loose", "max_epsilon = 10\ndelta = 1e-5\n", "max_epsilon 10 < eps 519.7 at delta 1e-05",
     ("--accept-caveats",)),
    ("loose", "max_rho = 2.0\n", "max_rho 2 < rho 400", ("--accept-caveats",)),
    ("private", "max_epsilon = 10\ndelta = 1e-6\n", "delta 1e-06 < the run's delta 1e-05", ()),
    ("private", "beat_unigram = true\n",
     "beat_unigram: accuracy 0.0019 <= the unigram baseline's 0.0719", ()),
    ("private", "beat_public_model = true\n",
     "beat_public_model: accuracy 0.0019 <= the starting model's 0.0019", ()),
    ("loose", "allow_caveats = false\n", "allow_caveats = false: NOT FULLY PRIVATE", ("--accept-caveats",)),
])
@pytest.mark.slow
def test_attack_a_run_that_misses_a_rule_is_refused_and_nothing_is_written(
        runs, tmp_path, capsys, run, rules, words, extra):
    bundle = tmp_path / "out" / "bundle"
    code, err = export(runs[run], bundle, policy(tmp_path, rules), capsys, *extra)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: refused by policy.toml: ") and words in err[0], err
    assert not (tmp_path / "out").exists()  # no bundle, no partial folder, no signing key


@pytest.mark.slow
def test_every_failed_rule_is_named_on_the_one_line(runs, tmp_path, capsys):
    rules = "max_rho = 2.0\nbeat_unigram = true\nallow_caveats = false\n"
    code, err = export(runs["loose"], tmp_path / "b", policy(tmp_path, rules), capsys, "--accept-caveats")
    assert code == 2 and len(err) == 1
    assert "max_rho 2 < rho 400; beat_unigram: accuracy 0.0719 <= the unigram baseline's 0.0719; " \
           "allow_caveats = false: NOT FULLY PRIVATE" in err[0], err


@pytest.mark.parametrize("text, words", [
    ("max_epsilon = 10\ndelta = 1e-6\nmax_eps = 3\n", "unknown policy key 'max_eps'"),
    ("max_rho = -1\n", "max_rho must be a positive number, not -1"),
    ("max_rho = \"two\"\n", "max_rho must be a positive number"),
    ("beat_unigram = 1\n", "beat_unigram must be true or false, not 1"),
    ("max_epsilon = 10\n", "max_epsilon and delta go together"),
    ("max_epsilon = 10\ndelta = 2\n", "delta must lie in (0, 1)"),
    ("max_rho = [\n", "invalid TOML"),
    ("", "no rule"),
])
@pytest.mark.slow
def test_a_bad_policy_file_is_one_error_line(runs, tmp_path, capsys, text, words):
    code, err = export(runs["private"], tmp_path / "b", policy(tmp_path, text), capsys)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def passed(runs, tmp_path_factory):
    """The private run's bundle under a policy it meets: eps <= 1 at 1e-5, rho <= 2, no caveat."""
    root = tmp_path_factory.mktemp("passed")
    text = "max_epsilon = 1.0\ndelta = 1e-5\nmax_rho = 2.0\nallow_caveats = false\n"
    (root / "policy.toml").write_text(text)
    main(["export", str(runs["private"] / "checkpoint"), "--bundle", str(root / "bundle"),
          "--policy", str(root / "policy.toml")])
    return root, text


@pytest.mark.slow
def test_a_passing_bundle_records_the_policy_and_the_values_it_passed(runs, passed):
    root, text = passed
    bundle = root / "bundle"
    assert (root / "bundle.signing_key.pem").is_file()
    manifest = json.loads((bundle / MANIFEST).read_text())
    record = manifest["release_policy"]
    privacy = json.loads((runs["private"] / "privacy.json").read_text())
    summary = json.loads((runs["private"] / "summary.json").read_text())
    assert record["file"] == "policy.toml"
    assert record["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert record["rules"] == {"max_epsilon": 1.0, "delta": 1e-5, "max_rho": 2.0, "allow_caveats": False}
    passed_values = record["passed"]
    assert passed_values["rho"] == pytest.approx(1 / 36)
    assert passed_values["epsilon"] == privacy["epsilon"] and 0 < passed_values["epsilon"] <= 1.0
    assert passed_values["delta"] == 1e-5 and passed_values["caveats"] == []
    assert passed_values["accuracy"] == summary["final"]["accuracy"] == pytest.approx(2 / 1029)
    assert passed_values["starting_accuracy"] == pytest.approx(2 / 1029)  # of the 1029 scored tokens
    assert passed_values["unigram_accuracy"] == summary["unigram_baseline"]["accuracy"]
    assert passed_values["unigram_accuracy"] == pytest.approx(74 / 1029)


@pytest.mark.slow
def test_the_device_client_verifies_a_policy_bundle(passed):
    root, _ = passed
    pub = root / "bundle" / PUBLIC_KEY
    client = BundleClient(root / "bundle", pub.read_bytes())
    assert client.bundle.manifest["release_policy"]["rules"]["max_rho"] == 2.0


@pytest.mark.slow
def test_attack_editing_the_recorded_policy_values_breaks_the_signature(passed, tmp_path):
    import shutil

    root, _ = passed
    copy = tmp_path / "copy"
    shutil.copytree(root / "bundle", copy)
    pub = (copy / PUBLIC_KEY).read_bytes()
    verify_bundle(copy, pub)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["release_policy"]["passed"]["epsilon"] = 0.5
    manifest["release_policy"]["rules"]["max_epsilon"] = 100.0
    (copy / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
    with pytest.raises(BundleError, match="signature"):
        verify_bundle(copy, pub)


@pytest.mark.slow
def test_python_api_export_bundle_checks_the_policy(runs, tmp_path):
    import dpfleet

    result = dpfleet.Result.load(runs["private"])
    refusal = r"^refused by policy.toml: beat_unigram: accuracy 0.0019 <= the unigram baseline's 0.0719$"
    with pytest.raises(DpfleetError, match=refusal):
        result.export_bundle(tmp_path / "b", policy=policy(tmp_path, "beat_unigram = true\n"))
    assert not (tmp_path / "b").exists()
    loaded = ReleasePolicy.load(policy(tmp_path, "max_rho = 2.0\n"))
    assert loaded.check(runs["private"])["passed"]["rho"] == pytest.approx(1 / 36)


@pytest.mark.slow
def test_python_api_a_model_above_its_starting_model_passes_that_rule(runs, tmp_path):
    """The loose run's model (74/1029, the most frequent token) beats its starting one (2/1029)."""
    import dpfleet

    result = dpfleet.Result.load(runs["loose"])
    rules = policy(tmp_path, "beat_public_model = true\nmax_rho = 500.0\n")
    result.export_bundle(tmp_path / "b", policy=rules, accept_caveats=True)
    record = json.loads((tmp_path / "b" / MANIFEST).read_text())["release_policy"]
    assert record["passed"]["accuracy"] == pytest.approx(74 / 1029)
    assert record["passed"]["starting_accuracy"] == pytest.approx(2 / 1029)
    assert record["passed"]["rho"] == pytest.approx(400) and record["passed"]["caveats"] != []


@pytest.fixture(scope="module")
def projection_run(tmp_path_factory, xdg):
    """A 2-round projection run: 4 devices a round trained with the noise of 20 (z = 6 scaled by
    4/20 on the sum: its own rho = 2 / (2 * 1.2^2) = 0.694) planned for a population of 100,000
    (rho = 2 / (2 * 6^2) = 1/36, far below its own)."""
    root = tmp_path_factory.mktemp("projection-run")
    cfg = {**CFG, "rounds": 2, "eval_every": 2, "checkpoint_every": 0,
           "dp": {**CFG["dp"], "delta": 1e-6, "noise_multiplier": 6.0},
           "projection": {"noise_cohort": 20, "population": 100_000}}
    (root / "p.toml").write_text(to_toml(cfg))
    main(["simulate", str(root / "p.toml"), "--out", str(root / "run"), "--quiet"])
    return root / "run"


def _paths_of(value, target, path=()):
    """Every key path in a JSON value where the number `target` occurs."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _paths_of(v, target, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _paths_of(v, target, (*path, i))]
    return [path] if isinstance(value, float) and value == target else []


@pytest.mark.slow
def test_attack_a_projection_runs_bundle_never_presents_the_projected_eps_as_the_models(
        projection_run, tmp_path, capsys):
    privacy = json.loads((projection_run / "privacy.json").read_text())
    own, projected = privacy["epsilon"], privacy["projection"]["epsilon"]
    assert privacy["zcdp"] == pytest.approx(2 / (2 * 1.2 ** 2))
    assert privacy["projection"]["zcdp"] == pytest.approx(1 / 36) and projected < own
    # a policy the projected eps meets but the model's own does not: refused, naming the own eps
    rules = f"max_epsilon = {projected * 1.01}\ndelta = 1e-6\n"
    code, err = export(projection_run, tmp_path / "r", policy(tmp_path, rules), capsys, "--accept-caveats")
    assert code == 2 and f"< eps {own:.4g} at delta 1e-06" in err[0], err
    # without --accept-caveats the projection is a caveat that refuses the bundle
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", str(projection_run / "checkpoint"), "--bundle", str(tmp_path / "c")])
    assert "projection to a population of 100,000" in capsys.readouterr().err
    # accepted: the manifest states the own eps as the model's; the projected one only in its block
    main(["export", str(projection_run / "checkpoint"), "--bundle", str(tmp_path / "b"), "--accept-caveats"])
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert manifest["fully_private"] is False
    assert manifest["caveats"][0].startswith("NOT FULLY PRIVATE: projection to a population of 100,000")
    assert manifest["privacy"]["epsilon"] == own and manifest["privacy"]["zcdp"] == privacy["zcdp"]
    block = manifest["privacy"]["projection"]
    assert block["epsilon_is_a_guarantee"] is False and "not a guarantee" in block["label"]
    assert _paths_of(manifest, projected) == [("privacy", "projection", "epsilon")]
