"""Issue 22 hole 4: a round's commit is ONE transaction, release AND metrics row, so `kill -9`
never leaves a round half-recorded. `dpfleet service serve` (a real process, real sockets,
devices training in this process) is SIGKILLed at each write point of round 2's commit and
between rounds (the service's fault hook, DPFLEET_SERVICE_FAULT=point:n, `service/faults.py`).

Right after the kill the state holds round 2 whole or not at all (releases, participation,
device counters, rounds and metrics rows agree). Then `serve` is restarted on the same --state:
its status answers (admin status, history, public status, the page: 200, with the eps of the
rounds committed so far, the value a fresh accountant gives), and the finished run holds every
round exactly once in every table and in metrics.jsonl, each with its own record (none rebuilt),
with no noise position or node set released twice. On the old commit order the "committed"
case left round 2 without a metrics row and every status request failed (KeyError 'epsilon')."""

import asyncio
import json
import time

import aiohttp
import pytest
from service_fleet import device_keys, fleet_data, run_devices, tiny_cfg
from test_service_kill import check_run, free_port, serve_once

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.coordinator.state.state_store import StateStore

ROUNDS = 3
KILLED_ROUND = 2
# the state store's commit steps in order (`state_store` docstring): the first six are before
# COMMIT (round 2 must be absent after the kill), the rest after it (present, whole)
IN_COMMIT = ("files_written", "files_fsynced", "files_renamed", "release_row", "participation_rows",
             "device_counters", "metrics_row", "round_status", "committed")
BEFORE_COMMIT = IN_COMMIT[:-1]
BETWEEN_ROUNDS = ("after_commit", "opened")  # round 2 committed / round 2 opened, nothing drawn
DEFAULT = ("after_commit",)  # the rest: slow, in CI (before COMMIT: test_service_kill)


def state_rows(state) -> dict:
    """Every table's view of which rounds exist, read as a restarted coordinator reads them."""
    store = StateStore(state, CFG.resolved())
    try:
        releases = store.releases()
        counters = {d: (n, last) for d, n, last in store.db.execute(
            "SELECT id, participations, last_round FROM devices")}
        part = store.participation()
        return {
            "releases": [r["round"] for r in releases], "records": releases,
            "participation": sorted(part),
            "metrics": store.log("metrics"),
            "committed": [r for (r,) in store.db.execute(
                "SELECT round FROM rounds WHERE status = 'committed' ORDER BY round")],
            # each device's counters equal its participation rows
            "counters_agree": all(
                n == sum(d in ds for ds in part.values())
                and last == max((r for r, ds in part.items() if d in ds), default=None)
                for d, (n, last) in counters.items()),
            "finished": store.finished,
        }
    finally:
        store.close()


CFG = tiny_cfg(rounds=ROUNDS, eval_every=1, dp={"noise_seed": -1},  # serve: secret noise only
               service={"checkin_retry_s": 0.2, "report_deadline_s": 20.0})


async def status_of_restarted(state, started, timeout: float = 120.0) -> list[dict]:
    """Once the restarted serve wrote admin.json: admin status / history, public status and the
    page, all 200. Returns the admin statuses seen (polled until the run is finished)."""
    seen, give_up = [], time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while time.monotonic() < give_up:
            try:
                admin = json.loads((state / "admin.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                admin = None
            if admin is None or admin["pid"] != started.get("pid"):
                if seen:  # it wrote admin.json, answered, and is gone: the run is over
                    return seen
                await asyncio.sleep(0.05)
                continue
            auth = {"Authorization": f"Bearer {admin['token']}"}
            try:
                answers = {}
                for path in ("/v1/admin/status", "/v1/admin/history", "/v1/public/status", "/"):
                    async with http.get(admin["url"] + path, headers=auth) as resp:
                        answers[path] = (resp.status, await resp.text())
            except aiohttp.ClientConnectionError:  # it just shut down after finishing
                continue
            bad = {p: a for p, a in answers.items() if a[0] != 200}
            assert not bad, bad  # never a 500 with a traceback after a restart
            seen.append(json.loads(answers["/v1/admin/status"][1]))
            if seen[-1]["run_state"] == "finished":
                return seen
            await asyncio.sleep(0.05)
    raise AssertionError(f"no status from the restarted coordinator in {timeout} s")


def kill_then_restart(tmp_path, fault: str):
    config = tmp_path / "config.toml"
    config.write_text(to_toml(CFG.resolved()))
    users, examples = fleet_data(CFG, tmp_path / "fleet")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state"
    out = {}

    async def main():
        stop = asyncio.Event()
        devices = asyncio.create_task(run_devices(url, device_keys(users), examples, stop=stop))
        try:
            code, err = await serve_once(config, state, port, fault)
            assert code == -9, err[-2000:]  # SIGKILL: no cleanup, no rollback
            out["at_kill"] = state_rows(state)
            pid: dict = {}
            restarted = asyncio.create_task(serve_once(config, state, port, None, pid))
            out["statuses"] = await status_of_restarted(state, pid)
            code, err = await restarted
            assert code == 0, err[-2000:]
        finally:
            stop.set()
            await asyncio.wait_for(devices, 60)

    asyncio.run(main())
    return out


@pytest.mark.parametrize("point", [p if p in DEFAULT else pytest.param(p, marks=pytest.mark.slow)
                                   for p in IN_COMMIT + BETWEEN_ROUNDS])
@pytest.mark.slow
def test_kill_9_at_each_write_point_leaves_every_round_recorded_exactly_once(tmp_path, point):
    out = kill_then_restart(tmp_path, f"{point}:{KILLED_ROUND}")

    # at the kill: round 2 is in every table or in none (never half-recorded)
    at_kill = out["at_kill"]
    whole = point not in BEFORE_COMMIT and point != "opened"
    expected = list(range(1, KILLED_ROUND + whole))
    assert at_kill["releases"] == at_kill["participation"] == at_kill["committed"] == expected
    assert [m["round"] for m in at_kill["metrics"]] == expected
    assert at_kill["counters_agree"] and not at_kill["finished"]

    # the finished run: every table and metrics.jsonl hold each round once, with its own record
    state = tmp_path / "state"
    check_run(CFG, state)  # releases / rounds / metrics / participation rows, accounting, logs
    final = state_rows(state)
    rounds = list(range(1, ROUNDS + 1))
    assert final["releases"] == final["participation"] == final["committed"] == rounds
    assert final["counters_agree"]
    lines = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
    assert lines == final["metrics"] and [m["round"] for m in lines] == rounds
    fresh = RunAccountant(CFG.dp.noise_multiplier, CFG.dp.delta)
    eps = [0.0]
    for m, r in zip(lines, final["records"], strict=True):
        assert "rebuilt_after_crash" not in m and m["accuracy"] is not None  # the round's own
        eps.append(fresh.record(r["participants"], r["restart"])["epsilon"])
        assert m["epsilon"] == pytest.approx(eps[-1], rel=1e-12)
        assert m["clients"] == len(r["participants"])
    log = [{"round": r["round"] - 1, "devices": r["participants"], "restart": r["restart"]}
           for r in final["records"]]
    privacy = json.loads((state / "privacy.json").read_text())  # the report: a fresh account
    assert privacy["epsilon"] == pytest.approx(
        account_participation_log(log, CFG.dp.noise_multiplier, CFG.dp.delta)["epsilon"], rel=1e-12)
    # the released rounds before the kill are kept as they were, never recomputed
    assert final["records"][: len(expected)] == at_kill["records"]
    assert final["metrics"][: len(expected)] == at_kill["metrics"]

    # no noise reused: one sum per (key, tree, position), and no node set released twice
    check_no_reuse(final["records"])
    nodes = [(r["key_id"], r["tree_id"], tuple(map(tuple, r["nodes"]))) for r in final["records"]]
    assert len(set(nodes)) == len(nodes)

    # status answered after the restart, with the eps of the rounds committed at that moment
    assert out["statuses"], "the restarted coordinator never answered its status"
    for st in out["statuses"]:
        assert st["rounds_committed"] >= len(expected)
        assert st["epsilon"] == pytest.approx(eps[st["rounds_committed"]], rel=1e-12)
    assert out["statuses"][-1]["run_state"] == "finished"
