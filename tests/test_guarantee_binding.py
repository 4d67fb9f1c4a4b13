"""The guarantee is bound to the releases: a config edited between an interruption and
`dpfleet simulate --resume` (or between two starts of a coordinator on its state directory) is
refused in one line naming what changed, and nothing in the run directory moves.

The attack (as filed): `dp.noise_multiplier` edited from 0.5 to 5 in config.json of a run stopped
after 3 of 6 rounds. The resume compared config.json with itself, the release records carried no
z, and the run then claimed eps 1.78 where its rounds 1-3 alone cost >= 18.7. Every input of the
guarantee (z, C and adaptive clipping's settings, rounds, MinS / MaxP, delta, mechanism, noise
kind, population, vocabulary source) gets the same edit here.
"""

import io
import json
import re
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from crashes import failing_on_round
from hypothesis import given, settings
from hypothesis import strategies as st
from test_noise_secrecy import CFG

from dpfleet.cli import main
from dpfleet.coordinator.state.guarantee import _MISSING, check_guarantee, guarantee
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError

ROUNDS, STOPPED_AFTER = 6, 3
RUN = {**CFG, "rounds": ROUNDS, "eval_every": ROUNDS, "checkpoint_every": 2,
       "data": {**CFG["data"], "max_clients": 24},
       # z 0.5 as in the report; adaptive clipping so that its settings are guarantee inputs too
       "dp": {**CFG["dp"], "noise_multiplier": 0.5, "adaptive_clipping": True, "clip_count_stddev": 5.0},
       "participation": {"mode": "uniform", "min_separation": 1, "max_participation": 2}}


def cli(*args: str) -> tuple[int, str, str]:
    """`dpfleet ARGS` in-process, as a terminal runs it: (exit code, stdout, stderr)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def snapshot(run: Path) -> dict:
    """Every file of a run directory: its bytes and its mtime."""
    return {p.relative_to(run).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A tiny run Ctrl-C'd while round 4's clients trained: rounds 1-3 released, resume point at 3."""
    root = tmp_path_factory.mktemp("guarantee")
    config = root / "tiny.toml"
    config.write_text(to_toml(RUN))
    with pytest.MonkeyPatch.context() as mp:
        failing_on_round(mp, STOPPED_AFTER + 1, KeyboardInterrupt)
        code, _, err = cli("simulate", str(config), "--out", str(root / "run"), "--quiet")
    assert code == 130 and "--resume" in err, err
    released = (root / "run" / "releases.jsonl").read_text().splitlines()
    assert len(released) == STOPPED_AFTER
    return root / "run"


@pytest.fixture
def run(stopped, tmp_path):
    """Each test edits and resumes its own copy of the stopped run (modes kept)."""
    return Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))


def released_cost(run: Path, z: float) -> float:
    """eps of the released rounds alone at noise multiplier `z` (`dpfleet account` over the
    participation log the interrupted run left), at the run's delta."""
    code, out, err = cli("account", "-z", str(z), "--participation-log", str(run / "participation.jsonl"),
                         "--delta", str(RUN["dp"].get("delta", 1e-6)), "--json")
    assert code == 0, err
    return json.loads(out)["epsilon"]


def edit_config(run: Path, edits: dict) -> None:
    """The edit a user makes to config.json: dotted keys set to new values."""
    path = run / "config.json"
    config = json.loads(path.read_text())
    for dotted, value in edits.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[key] = value
    path.write_text(json.dumps(config, indent=2))


def refused_untouched(run: Path, before: dict, names: str) -> str:
    """`simulate --resume` of an edited run: one `error:` line naming `names`, no file changed."""
    code, out, err = cli("simulate", "--resume", str(run), "--quiet")
    if code == 0:  # what the resume claimed, for the failure message
        claimed = json.loads((run / "privacy.json").read_text())["epsilon"]
        pytest.fail(f"the edited run resumed and claims eps {claimed:.2f}")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    assert f"{names} (" in err, err  # named with its two values: "dp.delta (1e-06 -> 0.001)"
    assert snapshot(run) == before  # nothing in the run directory was modified
    return err


def test_attack_a_raised_noise_multiplier_is_refused_not_accounted(run):
    """The filed attack, on the value: resumed with z 5, the run claimed far less than what its
    three released rounds at z 0.5 cost. Now the resume is refused before anything runs."""
    cost = released_cost(run, 0.5)
    original = (run / "config.json").read_bytes()
    edit_config(run, {"dp.noise_multiplier": 5.0})
    before = snapshot(run)
    code, _, err = cli("simulate", "--resume", str(run), "--quiet")
    if code == 0:
        claimed = json.loads((run / "privacy.json").read_text())["epsilon"]
        assert claimed >= cost, (f"the resumed run claims eps {claimed:.2f}; its rounds 1-"
                                 f"{STOPPED_AFTER} alone cost {cost:.2f}")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "dp.noise_multiplier (0.5 -> 5.0)" in err, err
    assert snapshot(run) == before
    # the config put back, the run resumes and its report pays for every released round
    (run / "config.json").write_bytes(original)
    code, out, err = cli("simulate", "--resume", str(run), "--quiet")
    assert code == 0, err
    claimed = json.loads((run / "privacy.json").read_text())["epsilon"]
    assert claimed >= cost and released_cost(run, 0.5) >= cost


@pytest.mark.parametrize("edits, names", [
    ({"dp.clip_norm": 0.05}, "dp.clip_norm"),
    ({"dp.clip_count_stddev": 20.0}, "dp.clip_count_stddev"),
    ({"dp.target_quantile": 0.9}, "dp.target_quantile"),
    ({"rounds": 60}, "rounds"),
    ({"participation.max_participation": 1}, "participation.max_participation"),
    ({"participation.min_separation": 4}, "participation.min_separation"),
    ({"dp.delta": 1e-3}, "dp.delta"),
    ({"dp.mechanism": "banded"}, "dp.mechanism"),
    ({"aggregation.kind": "secagg"}, "aggregation.kind"),  # noise after SecAgg: honest peers only
    ({"data.max_clients": 20}, "population"),
    ({"tokenizer.allow_nonprivate_vocabulary": True}, "tokenizer.allow_nonprivate_vocabulary"),
])
def test_attack_an_edited_guarantee_input_is_refused_on_resume(run, edits, names):
    edit_config(run, edits)
    refused_untouched(run, snapshot(run), names)


def strip_guarantee(run: Path) -> None:
    """What a run of a dpfleet before the binding left: no digest in its records or resume point."""
    path = run / "releases.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "guarantee"}) + "\n"
                            for r in records))
    for state in run.glob("resume*/server_state.json"):
        meta = json.loads(state.read_text())
        meta.pop("guarantee", None)
        state.write_text(json.dumps(meta))


def test_a_run_without_guarantee_digests_is_refused_in_one_line(run):
    """An older run's records (or stripped ones, with config.json edited too): nothing says what
    its rounds were released under, so it is refused rather than taken at config.json's word."""
    strip_guarantee(run)
    edit_config(run, {"dp.noise_multiplier": 5.0})
    code, _, err = cli("simulate", "--resume", str(run), "--quiet")
    assert code == 2 and err.count("\n") == 1 and "has no guarantee digest" in err, err


def test_an_edited_record_that_hides_the_change_is_refused(run):
    """config.json and every record's plain values edited alike (z 5 everywhere), the digests
    kept: the values no longer hash to the digest, so the records cannot be trusted."""
    edit_config(run, {"dp.noise_multiplier": 5.0})
    path = run / "releases.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["guarantee"]["inputs"]["dp.noise_multiplier"] = 5.0
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = snapshot(run)
    code, _, err = cli("simulate", "--resume", str(run), "--quiet")
    assert code == 2 and err.count("\n") == 1 and "does not match its own values" in err, err
    assert snapshot(run) == before


def test_the_records_and_the_resume_point_carry_one_digest_and_no_secret(stopped):
    records = [json.loads(line) for line in (stopped / "releases.jsonl").read_text().splitlines()]
    point = json.loads((stopped / "resume" / "server_state.json").read_text())["guarantee"]
    assert all(r["guarantee"] == point for r in records)
    inputs = point["inputs"]
    assert inputs["dp.noise_multiplier"] == 0.5 and inputs["population"] == 24
    assert inputs["mechanism.sha256"] == records[0]["mechanism_sha256"]
    assert "dp.noise_seed" not in inputs  # a research seed is the noise: bound as a yes / no
    assert inputs["dp.noise_seeded"] is False


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=8),
                   st.floats(allow_nan=False, allow_infinity=False, width=64))
INPUTS = st.dictionaries(st.text(min_size=1, max_size=12), VALUES, min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(inputs=INPUTS, data=st.data())
def test_any_changed_input_is_refused_and_named(inputs, data):
    """The same inputs pass in any key order; any one value changed, added or removed is refused
    with the field named (and a digest that does not match its values is never taken)."""
    bound = guarantee(inputs)
    check_guarantee(guarantee(dict(reversed(list(inputs.items())))), bound, "here")
    key = data.draw(st.sampled_from(sorted(inputs)) | st.text(min_size=1, max_size=12))
    value = data.draw(VALUES | st.just(_MISSING))
    edited = {k: v for k, v in inputs.items() if k != key}
    if value is not _MISSING:
        edited[key] = value
    if json.dumps(edited, sort_keys=True) == json.dumps(inputs, sort_keys=True):  # False is not 0 here
        check_guarantee(guarantee(edited), bound, "here")
        return
    with pytest.raises(DpfleetError, match=re.escape(f"{key} (")):
        check_guarantee(guarantee(edited), bound, "here")
    forged = {"sha256": bound["sha256"], "inputs": edited}  # values edited, digest kept
    with pytest.raises(DpfleetError, match="does not match its own values"):
        check_guarantee(guarantee(edited), forged, "here")


def test_attack_a_coordinator_state_whose_config_was_edited_is_refused_on_restart(tmp_path):
    """The service's restart from its state directory: the operator edits the config kept in
    state.sqlite and restarts with that config (z 1.0 -> 1.5), so the store's own config check
    compares the edit with itself. The committed rows carry the guarantee: refused, on the value."""
    import sqlite3

    from test_state_store import CFG as STORE_CFG
    from test_state_store import ROUNDS as STORE_ROUNDS
    from test_state_store import engine_on, run_rounds, store_cfg

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.state.state_store import DB_FILE, KEY_FILE
    from dpfleet.jsonio import dumps

    state = tmp_path / "state"
    store, engine, train_and_sum = engine_on(store_cfg(), state)
    run_rounds(engine, train_and_sum, store, until=2)
    cost = store.log("metrics")[-1]["epsilon"]  # what rounds 1-2 cost at the z they were released with
    store.close()
    edited = parse_config({**STORE_CFG, "rounds": STORE_ROUNDS,
                           "dp": {**STORE_CFG["dp"], "noise_multiplier": 1.5}})
    with sqlite3.connect(state / DB_FILE) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'config'", (dumps(edited.resolved()),))
    db.close()
    key = (state / KEY_FILE).read_bytes()
    try:
        store, engine, _ = engine_on(edited, state)
    except DpfleetError as exc:
        err = str(exc)
    else:
        claimed = engine.privacy()["epsilon"]
        pytest.fail(f"restarted with the edited config: claims eps {claimed:.2f} for rounds 1-2, "
                    f"which cost {cost:.2f}")
    assert "dp.noise_multiplier (1.0 -> 1.5)" in err and "\n" not in err, err
    from dpfleet.coordinator.state.state_store import StateStore

    store = StateStore(state, edited.resolved())  # nothing was committed or rewritten
    assert store.last_committed() == 2 and (state / KEY_FILE).read_bytes() == key
    assert all(r["guarantee"]["inputs"]["dp.noise_multiplier"] == 1.0 for r in store.releases())
    store.close()


def test_a_planned_run_binds_the_noise_the_planner_chose(tmp_path):
    """With dp.target_epsilon the planner picks z: the records bind the z the rounds ran with
    (plan.json's), and a resume whose target was edited (a re-plan would pick another z) is
    refused in one line before anything is written."""
    planned = {**RUN, "rounds": 4, "dp": {**{k: v for k, v in RUN["dp"].items()
                                             if k not in ("noise_multiplier", "report_goal")},
                                          "adaptive_clipping": False, "target_epsilon": 8.0},
               "participation": {}}
    config = tmp_path / "planned.toml"
    config.write_text(to_toml(planned))
    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        failing_on_round(mp, 3, KeyboardInterrupt)
        code, _, err = cli("simulate", str(config), "--out", str(run), "--quiet")
    assert code == 130, err
    chosen = json.loads((run / "plan.json").read_text())["chosen"]["noise_multiplier"]
    records = [json.loads(line) for line in (run / "releases.jsonl").read_text().splitlines()]
    assert [r["guarantee"]["inputs"]["dp.noise_multiplier"] for r in records] == [chosen, chosen]
    edit_config(run, {"dp.target_epsilon": 30.0})
    before = snapshot(run)
    code, _, err = cli("simulate", "--resume", str(run), "--quiet")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert snapshot(run) == before
