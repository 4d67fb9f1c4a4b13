"""No noise reuse, ever: the release log and the crash/resume rules of `release_log`.

The property test crashes a run at random points (before a round, right after a round's release
record, in place of a resume point), resumes, maybe crashes again, and checks over *every release
ever made* (a spy on the log, not the log itself) that no tree position (key, tree, t), i.e. no
set of tree nodes, carried two sums, that the final log forgot none of them, and that the
participation log and the accounting count them all."""

import json
import tempfile
from pathlib import Path

import pytest
from crashes import Crash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dpfleet.coordinator.engine.round_engine as round_engine
import dpfleet.coordinator.engine.simulation as simulation
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes
from dpfleet.coordinator.state.release_log import ReleaseLog, check_no_reuse, release_hash
from dpfleet.errors import DpfleetError

ROUNDS = 6
CFG = {
    "rounds": ROUNDS, "eval_every": ROUNDS, "seed": 2, "checkpoint_every": 2,
    "data": {"dataset": "shakespeare", "max_clients": 10, "eval_examples": 40, "max_examples": 8,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 8},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3, "momentum": 0.5,
           "adaptive_clipping": True, "clip_count_stddev": 1.0, "restart_rounds": [4]},
    "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0},
    "devices": {"availability": 0.7},
}
QUIET = {"progress": False, "log": lambda s: None}


def record(log: ReleaseLog, rnd: int, tree: int, t: int, key: str = "k", released: str = "h") -> dict:
    return log.record_release(round=rnd, tree_id=tree, t=t, key_id=key, participants=["a"],
                              restart=t == 1, clip_norm=1.0, released=released, data_sha256="d")


def test_log_round_trips_and_names_the_nodes(tmp_path):
    log = ReleaseLog(tmp_path / "releases.jsonl")
    for t in range(1, 6):
        record(log, t, 0, t)
    again = ReleaseLog(tmp_path / "releases.jsonl").released_rounds()
    assert again == log.released_rounds() and [r["t"] for r in again] == [1, 2, 3, 4, 5]
    assert again[4]["nodes"] == [[2, 0], [0, 4]] == [list(n) for n in prefix_nodes(5)]
    assert log.nodes_used() == {("k", 0, lv, ix) for t in range(1, 6) for lv, ix in prefix_nodes(t)}
    assert log.next_tree_id() == 1
    check_no_reuse(again)


def test_a_torn_last_line_was_not_released_and_is_dropped(tmp_path):
    path = tmp_path / "releases.jsonl"
    log = ReleaseLog(path)
    record(log, 1, 0, 1)
    with path.open("a") as fh:
        fh.write('{"round": 2, "tree_')  # the process died inside the append
    assert len(ReleaseLog(path).released_rounds()) == 1
    assert path.read_text().endswith("}\n")
    path.write_text(path.read_text() + "garbage\n" + path.read_text())
    with pytest.raises(DpfleetError, match="line 2 is not valid JSON"):
        ReleaseLog(path)


POINTS = ("pending_written", "release_line", "metrics_line", "debug_nonprivate_line")


def logs_of(r: int) -> dict:
    return {"metrics": {"round": r, "epsilon": 0.5 * r}, "debug_nonprivate": {"round": r, "loss": 1.0}}


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_inside_a_release_leaves_it_with_all_its_lines_or_none(tmp_path, point):
    """Rule 4: after a crash at any step of round 2's record, reopening leaves round 2 either
    unreleased with no line anywhere, or released with its metrics and debug lines, once."""
    path = tmp_path / "releases.jsonl"
    log = ReleaseLog(path)
    log.record_release(round=1, tree_id=0, t=1, key_id="k", participants=["a"], restart=True,
                       clip_norm=1.0, released="h1", data_sha256="d", logs=logs_of(1))

    def crash(at):
        if at == point:
            raise Crash

    log.fault = crash
    with pytest.raises(Crash):
        log.record_release(round=2, tree_id=0, t=2, key_id="k", participants=["a"], restart=False,
                           clip_norm=1.0, released="h2", data_sha256="d", logs=logs_of(2))
    assert (tmp_path / "round.pending").exists()  # the crash came before the round was finished
    again = ReleaseLog(path)  # a restart
    released = point != "pending_written"
    rounds = [1, 2][: 1 + released]
    assert [r["round"] for r in again.released_rounds()] == rounds
    assert lines(tmp_path / "metrics.jsonl") == [logs_of(r)["metrics"] for r in rounds]
    assert lines(tmp_path / "debug_nonprivate.jsonl") == [logs_of(r)["debug_nonprivate"] for r in rounds]
    assert not (tmp_path / "round.pending").exists()
    ReleaseLog(path)  # opening again changes nothing
    assert [m["round"] for m in lines(tmp_path / "metrics.jsonl")] == rounds


def test_a_torn_pending_file_or_metrics_line_is_repaired_on_open(tmp_path):
    path = tmp_path / "releases.jsonl"
    log = ReleaseLog(path)
    for r in (1, 2):
        log.record_release(round=r, tree_id=0, t=r, key_id="k", participants=["a"], restart=r == 1,
                           clip_norm=1.0, released=f"h{r}", data_sha256="d",
                           logs={"metrics": logs_of(r)["metrics"]})
    # killed inside round 2's metrics append (after its release line): a torn last line
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-7])
    pending = {"round": 2, "logs": {"metrics": logs_of(2)["metrics"]}}
    (tmp_path / "round.pending").write_text(json.dumps(pending))
    ReleaseLog(path)
    assert lines(metrics) == [logs_of(1)["metrics"], logs_of(2)["metrics"]]
    # killed while writing round 3's pending file: round 3 never released, nothing of it kept
    (tmp_path / "round.pending").write_text('{"round": 3, "logs": {"metr')
    assert [r["round"] for r in ReleaseLog(path).released_rounds()] == [1, 2]
    assert [m["round"] for m in lines(metrics)] == [1, 2] and not (tmp_path / "round.pending").exists()


def test_a_release_without_its_metrics_record_or_with_another_rounds_is_refused(tmp_path):
    log = ReleaseLog(tmp_path / "releases.jsonl")
    for logs in ({"debug_nonprivate": {"round": 1}}, {"metrics": {"round": 2}},
                 {"metrics": {"round": 1}, "other": {"round": 1}}):
        with pytest.raises(DpfleetError, match="round 1"):
            log.record_release(round=1, tree_id=0, t=1, key_id="k", participants=["a"], restart=True,
                               clip_norm=1.0, released="h", data_sha256="d", logs=logs)
    assert log.released_rounds() == [] and not (tmp_path / "releases.jsonl").exists()


def test_check_no_reuse_catches_the_old_resume():
    # what resume did before: rounds 4-5 redone from round 3's state with the same tree nodes
    log = [{"round": r, "key_id": "k", "tree_id": 0, "t": r} for r in (1, 2, 3, 4, 5)]
    redo = [{"round": r, "key_id": "k", "tree_id": 0, "t": r} for r in (4, 5)]
    with pytest.raises(DpfleetError, match="noise reused"):
        check_no_reuse(log + redo)
    check_no_reuse(log + [{"round": 4, "key_id": "k", "tree_id": 1, "t": 1}])  # fresh tree: fine
    check_no_reuse(log + [{"round": 4, "key_id": "k2", "tree_id": 0, "t": 1}])  # fresh key: fine
    with pytest.raises(DpfleetError, match="after position"):
        check_no_reuse(log[:2] + log[3:])  # a gap: position 3 skipped


def test_release_hash_covers_model_and_clip_estimate():
    import numpy as np

    theta = np.arange(5, dtype=np.float32)
    assert release_hash(theta) != release_hash(theta + 1e-7)
    assert release_hash(theta, 0.5) != release_hash(theta, 0.6) != release_hash(theta)


CRASHES = st.lists(st.tuples(st.sampled_from(["before_round", "after_release", "resume_point"]),
                             st.integers(1, ROUNDS)), min_size=1, max_size=2)


def _attempt(out: Path, resume: bool, crash: tuple[str, int] | None, released: list[dict]) -> bool:
    """One run or resume of CFG that may crash at `crash`; returns whether it finished."""
    kind, at = crash or ("", 0)
    real_record, real_save = ReleaseLog.record_release, round_engine.save_resume

    def spy_record(self, **kwargs):
        released.append(json.loads(json.dumps(real_record(self, **kwargs))))
        if kind == "after_release" and kwargs["round"] == at:
            raise Crash
        return released[-1]

    def failing_save(run_path, rounds_done, *args):
        if kind == "resume_point" and rounds_done == at:
            raise Crash
        return real_save(run_path, rounds_done, *args)

    def hook(r, theta):
        if kind == "before_round" and r + 1 == at:
            raise Crash

    ReleaseLog.record_release, round_engine.save_resume = spy_record, failing_save
    try:
        simulation.run_simulation(parse_config(CFG), out, resume=resume, before_round=hook, **QUIET)
        return True
    except Crash:
        return False
    finally:
        ReleaseLog.record_release, round_engine.save_resume = real_record, real_save


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CRASHES)
@example([("resume_point", 2)])  # rounds 1-2 released, no resume point: both lost
@example([("after_release", 3), ("resume_point", 6)])  # round 3 lost, then rounds 5-6 lost
@pytest.mark.slow
def test_no_two_releases_of_the_same_nodes_after_any_crashes(crashes):
    released: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        done = _attempt(out, False, crashes[0], released)
        for crash in crashes[1:] + [None]:
            if done:
                break
            done = _attempt(out, True, crash, released)
        assert done
        check_no_reuse(released)  # every release ever made: one sum per (key, tree, position)
        node_sets = [(r["key_id"], r["tree_id"], tuple(map(tuple, r["nodes"]))) for r in released]
        assert len(set(node_sets)) == len(node_sets)
        final = ReleaseLog(out / "releases.jsonl").released_rounds()
        assert final == released  # nothing released was forgotten or rewritten
        assert [r["round"] for r in final] == list(range(1, ROUNDS + 1))
        log = [json.loads(x) for x in (out / "participation.jsonl").read_text().splitlines()]
        assert [e["devices"] for e in log] == [r["participants"] for r in final]
        privacy = json.loads((out / "privacy.json").read_text())
        assert privacy["rounds"] == len(final) == ROUNDS
        fresh = [r["round"] - 1 for r in final if r["restart"]]
        assert privacy["restarts"] == fresh and 4 in fresh


def test_the_property_sees_lost_rounds():
    # the examples above do lose released rounds (else the property would be vacuous)
    released: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        assert not _attempt(out, False, ("resume_point", 2), released)
        assert _attempt(out, True, None, released)
        summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_lost_in_crash"] == [1, 2]
    assert [(r["tree_id"], r["t"]) for r in released] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
