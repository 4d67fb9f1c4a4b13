"""The mechanism is bound to the run (issue 31): attacks 1 and 4, and noise reuse on resume.

Each attack is what a user or an operator can do with the files a run leaves: resume a custom
mechanism's run without it (it was re-accounted as the tree: eps 16.86 for rounds that had no
noise), or edit mechanism.json between a crash and the resume (the run then accounted a strategy
whose sensitivity is below what its noise needs). Each must now be refused with one line and
nothing further released. The custom mechanism here also speaks the protocol of dpfleet before
issue 31 (`zcdp`), so this file shows the attacks succeeding on that code too.
"""

import json

import numpy as np
import pytest
from crashes import Crash, failing_on_round
from test_noise_secrecy import CFG, QUIET

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.mechanisms.spec import MechanismSpec
from dpfleet.errors import DpfleetError

try:
    from dpfleet.extensions import Mechanism as Base
except ImportError:  # dpfleet before issue 31: the attack's "before"
    Base = object

RUN = {**CFG, "rounds": 6, "checkpoint_every": 2,
       "participation": {"mode": "uniform", "min_separation": 1, "max_participation": 2}}


class ZeroNoise(Base):
    """Adds no noise at all and declares independent noise's accounting: a caller's mechanism."""

    name = "zero-noise"

    def identity(self):
        return {}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return float(max_participation)

    def zcdp(self, noise_multiplier, rounds, min_separation, max_participation):  # before issue 31
        return max_participation / (2 * noise_multiplier**2)

    def stream(self, dim, std, key, segment=0, purpose="model"):
        class Zeros:
            tree_id, t = segment, 0

            def next_residual(self):
                self.t += 1
                return np.zeros(dim, np.float32)

            def state_dict(self):
                return {"tree_id": self.tree_id, "t": self.t, "nodes": [], "noise": []}

        return Zeros()


def releases(run_dir):
    return [json.loads(x) for x in (run_dir / "releases.jsonl").read_text().splitlines() if x.strip()]


def crashed(tmp_path, monkeypatch, values, name="run", **kwargs):
    """A run that crashed while round 4's clients trained (resume point after round 2 or 4)."""
    failing_on_round(monkeypatch, 4)
    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET, **kwargs)
    monkeypatch.undo()
    return tmp_path / name


def test_attack_resuming_a_custom_mechanisms_run_without_it_is_refused(tmp_path, monkeypatch, capsys):
    run = crashed(tmp_path, monkeypatch, RUN, extensions={"noise": ZeroNoise()})
    released = releases(run)
    assert [r["round"] for r in released] == [1, 2, 3]
    with pytest.raises(SystemExit) as exc:  # the CLI cannot pass the custom object: the tree's
        main(["simulate", "--resume", str(run), "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code != 0 and "custom noise mechanism 'zero-noise'" in err, err
    assert releases(run) == released and not (run / "privacy.json").exists()


def test_a_custom_mechanism_resumes_with_itself(tmp_path, monkeypatch):
    run = crashed(tmp_path, monkeypatch, RUN, extensions={"noise": ZeroNoise()})
    result = simulation.run_simulation(parse_config(RUN), run, resume=True, **QUIET,
                                       extensions={"noise": ZeroNoise()})
    assert [r["round"] for r in releases(run)] == list(range(1, 7))
    assert result.privacy["mechanism"] == "zero-noise" and result.privacy["accounted_by_dpfleet"] is False
    maxp = result.privacy["max_participation"]
    assert result.privacy["zcdp"] == pytest.approx(maxp / (2 * RUN["dp"]["noise_multiplier"] ** 2))


def edit_spec(run, scale):
    """The operator's edit: every strategy coefficient scaled (banded: a smaller sensitivity)."""
    path = run / "mechanism.json"
    saved = json.loads(path.read_text())
    spec = saved["spec"]
    spec["coefficients"] = [c * scale for c in spec["coefficients"]]
    saved["spec"] = spec
    if "identity" in saved:
        saved["identity"] = spec
    path.write_text(json.dumps(saved))
    return saved


def test_attack_an_edited_mechanism_json_is_refused_on_resume(tmp_path, monkeypatch):
    banded = {**RUN, "dp": {**RUN["dp"], "mechanism": "banded"}}
    run = crashed(tmp_path, monkeypatch, banded)
    before = releases(run)
    edit_spec(run, 0.9)  # sens^2 0.81x: eps understated for the noise the first rounds used
    with pytest.raises(DpfleetError, match="noise mechanism 'banded'.*fingerprint"):
        simulation.run_simulation(parse_config(banded), run, resume=True, **QUIET)
    assert releases(run) == before and not (run / "privacy.json").exists()


def test_attack_an_edit_that_rewrites_every_fingerprint_file_is_caught_by_the_releases(tmp_path, monkeypatch):
    """mechanism.json and config.json rewritten consistently: the release records (and the resume
    point) still carry the fingerprint the noise was drawn with."""
    from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism

    banded = {**RUN, "dp": {**RUN["dp"], "mechanism": "banded"}}
    run = crashed(tmp_path, monkeypatch, banded)
    saved = edit_spec(run, 0.9)
    forged = MatrixMechanism(MechanismSpec.from_json(saved["spec"])).fingerprint()
    saved["sha256"] = forged
    (run / "mechanism.json").write_text(json.dumps(saved))
    config = json.loads((run / "config.json").read_text())
    config["mechanism"]["sha256"] = forged
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(DpfleetError, match=r"(round 1 of .*releases.jsonl|resume point).*fingerprint"):
        simulation.run_simulation(parse_config(banded), run, resume=True, **QUIET)


def test_check_no_reuse_runs_on_every_resume(tmp_path, monkeypatch):
    """A release log whose noise positions repeat (a tampered or corrupted log) is refused at the
    replay, not trusted: two sums on one position would make their difference noise-free."""
    run = crashed(tmp_path, monkeypatch, RUN)
    lines = (run / "releases.jsonl").read_text().splitlines()
    dup = json.loads(lines[-1])
    dup.update(round=dup["round"] + 1)  # the same (key, tree, t) released twice
    (run / "releases.jsonl").write_text("\n".join([*lines, json.dumps(dup)]) + "\n")
    with pytest.raises(DpfleetError, match="noise reused"):
        simulation.run_simulation(parse_config(RUN), run, resume=True, **QUIET)


def test_attack_stripping_every_fingerprint_is_refused_not_taken_for_an_old_run(tmp_path, monkeypatch):
    """The edit of test_attack_an_edited_mechanism_json plus every fingerprint removed (the release
    records', mechanism.json's, config.json's, the resume point's): what an old run looked like.
    Taking it for one would account the edited strategy; a run without a binding is refused."""
    banded = {**RUN, "dp": {**RUN["dp"], "mechanism": "banded"}}
    run = crashed(tmp_path, monkeypatch, banded)
    before = releases(run)
    saved = edit_spec(run, 0.9)
    for key in ("sha256", "identity", "custom", "name"):
        saved.pop(key, None)
    (run / "mechanism.json").write_text(json.dumps(saved))
    config = json.loads((run / "config.json").read_text())
    config.pop("mechanism")
    (run / "config.json").write_text(json.dumps(config))
    stripped = [{k: v for k, v in r.items() if k != "mechanism_sha256"} for r in before]
    (run / "releases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stripped))
    for state in run.glob("resume*/server_state.json"):
        meta = json.loads(state.read_text())
        meta.pop("mechanism")
        state.write_text(json.dumps(meta))
    with pytest.raises(DpfleetError, match="no mechanism fingerprint"):
        simulation.run_simulation(parse_config(banded), run, resume=True, **QUIET)
    assert [r["round"] for r in releases(run)] == [r["round"] for r in before]
