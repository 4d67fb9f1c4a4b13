"""The coordinator's SQLite state: the engine run on it releases what run_simulation releases; a
crash at any step of a commit leaves the whole round or none of it (injected exceptions,
hypothesis over the steps, and real kills of a process); reopening continues without releasing
a round twice; the noise key never enters the database; other schemas / configs are refused."""

import json
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from crashes import Crash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_round_engine import CFG, QUIET, cfg_with, engine_parts

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.round_engine import Stop
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.engine.store_engine import open_engine
from dpfleet.coordinator.state.release_log import RELEASES, ReleaseLog, check_no_reuse, release_record
from dpfleet.coordinator.state.resume import KEY_FILE, fingerprint_secret
from dpfleet.coordinator.state.state_store import DB_FILE, StateStore, finish_run
from dpfleet.errors import DpfleetError

ROUNDS = 4
STEPS = ("files_written", "files_fsynced", "files_renamed", "release_row", "participation_rows",
         "device_counters", "metrics_row", "round_status", "committed")
BEFORE_COMMIT = STEPS[:-1]


def store_cfg(**top):
    return parse_config({**CFG, "rounds": ROUNDS, **top})


def engine_on(cfg, state: Path, store: StateStore | None = None):
    """The engine on the store at `state`, as a service process starts it (fresh or continuing)."""
    store = store or StateStore(state, cfg.resolved())
    parts, train_and_sum, fingerprint = engine_parts(cfg, state)
    secret = fingerprint_secret(state, create=store.last_committed() == 0)
    return store, open_engine(store, cfg, fingerprint=fingerprint(secret), **parts), train_and_sum


def run_rounds(engine, train_and_sum, store=None, until=None):
    while not isinstance(plan := engine.open_round(), Stop):
        if store is not None:
            store.open_round(plan.round + 1, plan.theta_sha256)
        engine.close_round(plan, *train_and_sum(plan))
        if until is not None and engine.next_round >= until:
            return
    return plan


def no_secret(release: dict) -> dict:
    return {k: v for k, v in release.items() if k != "data_sha256"}  # a MAC under a per-run secret


def check_consistent(store: StateStore) -> None:
    """Devices' counters = participation rows = releases' participants; committed = released =
    metrics rows (each round's once)."""
    releases = store.releases()
    part = store.participation()
    assert {r["round"]: set(r["participants"]) for r in releases} == part
    assert [m["round"] for m in store.log("metrics")] == [r["round"] for r in releases]
    for device, count, last in store.db.execute("SELECT id, participations, last_round FROM devices"):
        rounds = [r for r, ds in part.items() if device in ds]
        assert count == len(rounds) and last == (max(rounds) if rounds else None)
    committed = [r for (r,) in store.db.execute("SELECT round FROM rounds WHERE status = 'committed'")]
    assert sorted(committed) == [r["round"] for r in releases]
    folders = sorted(p.name for p in (store.path / "rounds").iterdir())
    assert folders == ([f"{releases[-1]['round']:06d}"] if releases else [])
    check_no_reuse(releases)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on the store, and run_simulation's files for the same config."""
    root = tmp_path_factory.mktemp("ref")
    cfg = store_cfg()
    sim = run_simulation(cfg, root / "sim", **QUIET)
    store, engine, train_and_sum = engine_on(cfg, root / "state")
    assert run_rounds(engine, train_and_sum, store).reason == "done"
    key = (root / "state" / KEY_FILE).read_bytes()
    info = {"releases": store.releases(), "metrics": store.log("metrics"), "key": key,
            "mode": stat.S_IMODE((root / "state" / KEY_FILE).stat().st_mode),
            "pragmas": (store.db.execute("PRAGMA journal_mode").fetchone()[0],
                        store.db.execute("PRAGMA synchronous").fetchone()[0]),
            "db_bytes": b"".join(p.read_bytes() for p in (root / "state").glob(DB_FILE + "*"))}
    check_consistent(store)
    _, privacy = finish_run(store, engine, stopped_early=None, baseline={"accuracy": 0.0}, started=0.0)
    info["privacy"] = privacy
    store.close()
    return cfg, root, sim, info


def test_the_store_releases_what_the_simulation_releases(reference):
    cfg, root, sim, info = reference
    jsonl = ReleaseLog(root / "sim" / RELEASES).released_rounds()
    assert len(jsonl) == ROUNDS == len(info["releases"])
    assert [no_secret(r) for r in info["releases"]] == [no_secret(r) for r in jsonl]
    assert info["releases"][0]["data_sha256"] != jsonl[0]["data_sha256"]  # independent secrets
    assert [m["epsilon"] for m in info["metrics"]] == [m["epsilon"] for m in sim.metrics]
    log = [json.loads(x) for x in (root / "sim" / "participation.jsonl").read_text().splitlines()]
    assert [sorted(e["devices"]) for e in log] == [sorted(r["participants"]) for r in info["releases"]]
    assert info["pragmas"] == ("wal", 2)  # synchronous = FULL
    assert info["privacy"]["epsilon"] == sim.privacy["epsilon"]  # accounted from the store's rows


def test_the_noise_key_is_a_0600_file_and_never_in_the_database(reference):
    cfg, root, sim, info = reference
    assert info["mode"] == 0o600 and len(info["key"]) == 32
    assert info["key"] not in info["db_bytes"] and info["key"].hex().encode() not in info["db_bytes"]
    # finished: the key and the node vectors are gone, and the run cannot be continued
    assert not (root / "state" / KEY_FILE).exists() and not (root / "state" / "rounds").exists()
    with pytest.raises(DpfleetError, match="finished run"):
        open_engine(StateStore(root / "state", cfg.resolved()), cfg, users=[])


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(crash_round=st.integers(1, ROUNDS), step=st.sampled_from(STEPS))
def test_a_crash_at_any_step_leaves_all_or_nothing_and_continues_bit_for_bit(
        reference, tmp_path_factory, crash_round, step):
    cfg, _, _, info = reference
    state = tmp_path_factory.mktemp("crash") / "state"
    store, engine, train_and_sum = engine_on(cfg, state)

    def fault(point):
        if point == step and engine.next_round == crash_round:
            raise Crash

    store.fault = fault
    with pytest.raises(Crash):
        run_rounds(engine, train_and_sum, store)
    store.close()  # the process is gone: the open transaction with it

    store = StateStore(state, cfg.resolved())
    survived = crash_round - (step in BEFORE_COMMIT)
    assert store.last_committed() == survived  # the whole round, or none of it
    check_consistent(store)
    if step in BEFORE_COMMIT:
        assert store.round(crash_round)["status"] == "failed"
    store, engine, train_and_sum = engine_on(cfg, state, store)
    assert engine.next_round == survived
    assert run_rounds(engine, train_and_sum, store).reason == "done"
    # nothing lost, nothing redone: the same releases as the uninterrupted run, bit for bit,
    # and the same metrics rows (DP quantities and evaluation), each round's once
    assert [no_secret(r) for r in store.releases()] == [no_secret(r) for r in info["releases"]]
    assert store.log("metrics") == info["metrics"]
    check_consistent(store)
    store.close()


KILLER = textwrap.dedent("""
    import os, sys
    from dpfleet.coordinator.state.release_log import release_record
    from dpfleet.coordinator.state.state_store import StateStore
    state, step, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = StateStore(state, {"k": 1})
    store.register_devices(["a", "b", "c"])
    def fault(point):
        if point == step and rec["round"] == at:
            os._exit(9)  # no rollback, no cleanup: a killed process
    store.fault = fault
    for r in range(store.last_committed() + 1, 6):
        rec = release_record(round=r, tree_id=0, t=r, key_id="k", participants=["a", "c"][: 1 + r % 2],
                             restart=r == 1, clip_norm=1.0, released=f"m{r}", data_sha256="d")
        store.commit_round(rec, f"m{r}", lambda folder: (folder / "model").write_bytes(b"x" * 4096),
                           {"metrics": {"round": r, "epsilon": 0.1 * r}})
""")


@pytest.mark.parametrize("step", [s if s == "committed"
                                  else pytest.param(s, marks=pytest.mark.slow) for s in STEPS])
@pytest.mark.slow
def test_a_killed_process_leaves_all_or_nothing(tmp_path, step):
    state = tmp_path / "state"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    killed = subprocess.run([sys.executable, str(script), str(state), step, "3"], timeout=120)
    assert killed.returncode == 9
    store = StateStore(state, {"k": 1})
    assert store.last_committed() == (2 if step in BEFORE_COMMIT else 3)
    check_consistent(store)
    store.close()
    done = subprocess.run([sys.executable, str(script), str(state), step, "99"], timeout=120)
    assert done.returncode == 0
    store = StateStore(state, {"k": 1})
    assert [r["round"] for r in store.releases()] == [1, 2, 3, 4, 5]
    assert store.device("a")["participations"] == 5 and store.device("c")["participations"] == 3
    check_consistent(store)


def release(r, t=None, participants=("a",)):
    return release_record(round=r, tree_id=0, t=t or r, key_id="k", participants=participants,
                          restart=False, clip_norm=1.0, released=f"m{r}", data_sha256="d")


def write_nothing(folder):
    (folder / "x").write_bytes(b"")


def metrics(r):
    return {"metrics": {"round": r, "epsilon": 0.1 * r}}


def test_a_noise_position_is_released_once_and_releases_are_never_rewritten(tmp_path):
    store = StateStore(tmp_path / "s", {"k": 1})
    store.register_devices(["a", "b"])
    store.commit_round(release(1), "m1", write_nothing, metrics(1))
    with pytest.raises(DpfleetError, match="released before"):  # round 2 on round 1's nodes
        store.commit_round(release(2, t=1, participants=("b",)), "m2", write_nothing, metrics(2))
    with pytest.raises(DpfleetError, match="once, in order"):
        store.commit_round(release(1), "m1", write_nothing, metrics(1))
    with pytest.raises(sqlite3.IntegrityError, match="never rewritten"):
        store.db.execute("UPDATE releases SET participants = '[\"b\"]' WHERE round = 1")
    with pytest.raises(sqlite3.IntegrityError, match="never removed"):
        store.db.execute("DELETE FROM releases")
    assert [r["participants"] for r in store.releases()] == [["a"]]
    assert store.device("b")["participations"] == 0  # the refused round left nothing
    with pytest.raises(DpfleetError, match="unregistered"):
        store.commit_round(release(2, participants=("z",)), "m2", write_nothing, metrics(2))
    check_consistent(store)


def test_device_keys_cannot_be_taken_over(tmp_path):
    store = StateStore(tmp_path / "s", {"k": 1})
    store.register_device("a", b"key-a")
    store.register_device("a", b"key-a")  # idempotent
    with pytest.raises(DpfleetError, match="another identity key"):
        store.register_device("a", b"key-mallory")
    assert store.device("a")["public_key"] == b"key-a"


def test_another_schema_or_config_or_not_a_store_is_refused(tmp_path):
    first = StateStore(tmp_path / "s", store_cfg().resolved())
    with pytest.raises(DpfleetError, match="in use by another coordinator"):
        StateStore(tmp_path / "s", store_cfg().resolved())
    first.close()
    with pytest.raises(DpfleetError, match="differs in dp"):
        StateStore(tmp_path / "s", cfg_with(noise_seed=12).resolved())
    db = sqlite3.connect(tmp_path / "s" / DB_FILE)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(DpfleetError, match="schema version 99"):
        StateStore(tmp_path / "s", store_cfg().resolved())
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(DpfleetError, match="not a coordinator state"):
        StateStore(tmp_path / "junk", {})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / DB_FILE).write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(DpfleetError, match="not a readable SQLite"):
        StateStore(tmp_path / "bad", {})
    assert (tmp_path / "junk" / "notes.txt").read_text() == "mine"  # nothing of the user's touched


def test_open_and_failed_rounds(tmp_path):
    store = StateStore(tmp_path / "s", {"k": 1})
    store.register_devices(["a"])
    with pytest.raises(DpfleetError, match="cannot open"):
        store.open_round(2, "p")
    store.open_round(1, "p")
    store.fail_round(1, "report goal missed")
    assert store.round(1)["status"] == "failed"
    store.open_round(1, "p2")  # the same number again: round numbers count releases
    assert store.round(1)["attempts"] == 2
    store.commit_round(release(1), "m1", write_nothing, metrics(1))
    with pytest.raises(DpfleetError, match="not open"):
        store.fail_round(1, "too late")
    assert store.round(1)["status"] == "committed"


def test_a_commit_without_its_metrics_record_is_refused_and_leaves_nothing(tmp_path):
    store = StateStore(tmp_path / "s", {"k": 1})
    store.register_devices(["a"])
    for logs in ({}, {"debug_nonprivate": {"round": 1}}, {"metrics": {"round": 2}}):
        with pytest.raises(DpfleetError, match="round 1"):
            store.commit_round(release(1), "m1", write_nothing, logs)
    assert store.last_committed() == 0 and store.log("metrics") == []
    assert not (tmp_path / "s" / "rounds" / "000001").exists()
    store.commit_round(release(1), "m1", write_nothing,
                       {**metrics(1), "debug_nonprivate": {"round": 1, "train_loss": 2.5}})
    assert store.log("metrics") == [{"round": 1, "epsilon": 0.1}]
    assert store.log("debug_nonprivate") == [{"round": 1, "train_loss": 2.5}]
    check_consistent(store)


def test_a_state_missing_a_metrics_row_is_rebuilt_on_open_and_status_reads_it(reference, tmp_path):
    """A state written by the old commit order (metrics row a later transaction, cut off by a
    kill): reopening rebuilds the row from the release and the replayed accountant, so every
    reader (status, history, metrics.jsonl) finds the DP fields."""
    from types import SimpleNamespace

    from dpfleet.service.rounds import HttpCollector

    cfg, _, _, info = reference
    store, engine, train_and_sum = engine_on(cfg, tmp_path / "state")
    run_rounds(engine, train_and_sum, store, until=3)
    store.db.execute("DELETE FROM metrics WHERE round IN (2, 3)")  # the old hole
    store.close()
    store, engine, train_and_sum = engine_on(cfg, tmp_path / "state")
    rows = store.log("metrics")
    assert [m["round"] for m in rows] == [1, 2, 3]
    for m, ref in zip(rows[1:], info["metrics"][1:3], strict=True):
        assert m["rebuilt_after_crash"] and m["accuracy"] is None
        for k in ("epsilon", "zcdp", "min_separation", "max_participation", "clients", "restart"):
            assert m[k] == ref[k], k
    assert HttpCollector.epsilon(SimpleNamespace(engine=engine)) == info["metrics"][2]["epsilon"]
    # a record without the key (whatever wrote it) is skipped, never a KeyError / 500
    bare = SimpleNamespace(engine=SimpleNamespace(metrics=[rows[0], {"round": 2, "clients": 3}]))
    assert HttpCollector.epsilon(bare) == info["metrics"][0]["epsilon"]
    assert run_rounds(engine, train_and_sum, store).reason == "done"
    check_consistent(store)
    store.close()
