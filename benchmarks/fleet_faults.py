"""Kill -9 the coordinator at 20+ random points over every phase and restart it on its state
(issue 12, item 8, the full version; the fast subset lives in the tests).

Real processes on loopback: `dpfleet service serve` and one `dpfleet fleet emulate` that
lives through every restart (its devices retry with jittered backoff; the coordinator listens
on one fixed port so they find it again). Each coordinator life is killed with SIGKILL either
by its own fault hook (`DPFLEET_SERVICE_FAULT=point:n`, service/faults.py: the n-th time it
passes `point`; the points cover opening a round, every SecAgg phase, and every step of the
store's commit) or by this script after a random delay (boot, registration, waiting for
check-ins, training). Then it is restarted on the same --state, until the run finishes.

Checked and saved (results/fleet_faults.json): the run completes; no round is committed twice
(the store's rows, and the commit events of every life in service.log); no two releases share
a tree position, so no noise node is on two different sums (`release_log.check_no_reuse`); and
the accounting the service wrote (privacy.json) equals a fresh account of the committed log.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.coordinator.state.state_store import StateStore
from dpfleet.errors import DpfleetError
from dpfleet.fleet.supervisor import stop_process, wait_for_admin
from dpfleet.io import atomic_write
from dpfleet.jsonio import dumps

SECAGG_POINTS = tuple(f"secagg_{p}" for p in ("commit", "keys", "shares", "masked",
                                               "consistency", "unmask"))
STORE_POINTS = ("files_written", "files_fsynced", "files_renamed", "release_row",
                "participation_rows", "device_counters", "round_status", "committed")
HOOK_POINTS = ("opened", *SECAGG_POINTS, "before_commit", *STORE_POINTS, "after_commit")
RESULTS = Path(__file__).parent / "results" / "fleet_faults.json"


def config_values(rounds: int, devices: int, overselect: float) -> dict:
    """A small signed-SecAgg+ run whose phases are all short but real."""
    return {
        "rounds": rounds, "eval_every": rounds, "seed": 5, "checkpoint_every": 0,
        "data": {"dataset": "shakespeare", "max_clients": devices, "eval_examples": 40,
                 "max_examples": 8},
        "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
        "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
        "client": {"lr": 1.0, "batch_size": 8, "trainer": "sequential"},
        "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3, "momentum": 0.5},
        "participation": {"mode": "uniform"},
        "aggregation": {"kind": "secagg", "signed": True, "graph": "harary"},
        "service": {"overselect": overselect, "checkin_retry_s": 0.2, "checkin_window_s": 0.5,
                    "report_deadline_s": 8.0, "secagg_phase_deadline_s": 4.0},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_kills(n: int, rng: random.Random, timed_share: float) -> list[dict]:
    """n kills: every hook point at least once (when n allows), the rest random; a share timed."""
    timed = max(1, round(n * timed_share))
    points = list(HOOK_POINTS)
    rng.shuffle(points)
    points = points[:n - timed] + [rng.choice(HOOK_POINTS) for _ in range(n - timed - len(points))]
    kills = [{"kind": "hook", "point": p, "n": rng.choice((1, 1, 2))} for p in points]
    kills += [{"kind": "timed", "after_s": round(rng.uniform(0.5, 8.0), 2)} for _ in range(timed)]
    rng.shuffle(kills)
    return kills


def run_finished(state: Path) -> bool:
    """Whether the store says the run is over (read-only: the next life does any recovery)."""
    import sqlite3

    db = sqlite3.connect(f"file:{state / 'state.sqlite'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT value FROM meta WHERE key = 'finished'").fetchone()
    except sqlite3.Error:
        return False
    finally:
        db.close()
    return row is not None and row[0] == "1"


def events(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line a kill cut short
            continue
    return out


def check(state: Path, cfg, ids: list[str], life_events: list[list[dict]]) -> dict:
    """The four properties, on the state directory the lives left behind."""
    store = StateStore(state, cfg.resolved())  # every coordinator life has ended
    try:
        releases = store.releases()
        rounds = [store.round(r) for r in range(1, cfg.rounds + 1)]
        finished = store.finished
        taken = collections.Counter(d for devs in store.participation().values() for d in devs)
        counters = {d: (store.device(d) or {}).get("participations", 0) for d in ids}
    finally:
        store.close()
    commits = collections.Counter(e["round"] for life in life_events for e in life
                                  if e.get("event") == "commit")
    try:
        check_no_reuse(releases)
        reuse = None
    except DpfleetError as exc:
        reuse = str(exc)
    log = [{"round": r["round"] - 1, "devices": r["participants"], "restart": r["restart"]}
           for r in releases]
    fresh = account_participation_log(log, cfg.dp.noise_multiplier, cfg.dp.delta,  # ring noise: RDP
                                      "rdp" if cfg.dp.noise == "discrete" else "pld")
    privacy_file = state / "privacy.json"
    served = json.loads(privacy_file.read_text())["epsilon"] if privacy_file.is_file() else None
    committed = [r["round"] for r in rounds if r is not None and r["status"] == "committed"]
    return {
        "run_completed": finished and committed == list(range(1, cfg.rounds + 1)),
        "rounds_committed": len(committed),
        "round_attempts": {str(r["round"]): r["attempts"] for r in rounds if r is not None},
        "no_round_committed_twice": ([r["round"] for r in releases] == committed
                                     and all(v <= 1 for v in commits.values())),
        "commit_events_per_round": {str(r): commits.get(r, 0) for r in committed},
        "device_counters_match_participation_rows": counters == {d: taken.get(d, 0) for d in ids},
        "no_tree_position_released_twice": reuse is None,
        "reuse_error": reuse,
        "epsilon_service": served,
        "epsilon_fresh_account": fresh["epsilon"],
        "accounting_equals_fresh_account": served is not None
                                          and abs(served - fresh["epsilon"]) <= 1e-9 * abs(fresh["epsilon"]),
    }


def _dpfleet(*args: object) -> list[str]:
    return [sys.executable, "-m", "dpfleet", *map(str, args)]


def run(kills: int, rounds: int, devices: int, processes: int, seed: int, timed_share: float,
        overselect: float, workdir: Path, progress: bool = True) -> dict:
    from dpfleet.fleet.emulate import fleet_keys, load_devices
    from dpfleet.secagg.registry import public_registry, write_public_registry

    rng = random.Random(seed)
    cfg = parse_config(config_values(rounds, devices, overselect))
    config = workdir / "faults.toml"
    config.write_text(to_toml(cfg.resolved()))
    state, fleet_dir = workdir / "state", workdir / "fleet"
    fleet_dir.mkdir(parents=True, exist_ok=True)
    ids, _, _ = load_devices(cfg, devices)
    keys_path, registry = fleet_dir / "fleet_keys.json", fleet_dir / "fleet_public.json"
    write_public_registry(registry, public_registry(fleet_keys(keys_path, len(ids)), ids))
    url = f"http://127.0.0.1:{free_port()}"
    serve_cmd = _dpfleet("service", "serve", config, "--state", state, "--listen",
                         url.removeprefix("http://"), "--fleet-public", registry)
    plan = plan_kills(kills, rng, timed_share)
    lives: list[dict] = []
    life_events: list[list[dict]] = []
    fleet = None
    restart_error = None
    began = time.monotonic()
    from tqdm import tqdm

    bar = tqdm(total=len(plan), desc="kills", unit="kill", disable=not progress)
    try:
        while True:
            kill = plan[len(lives)] if len(lives) < len(plan) else None
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env.pop("DPFLEET_SERVICE_FAULT", None)
            if kill is not None and kill["kind"] == "hook":
                env["DPFLEET_SERVICE_FAULT"] = f"{kill['point']}:{kill['n']}"
            log_path = workdir / f"serve.{len(lives)}.log"
            mark = len(events(state / "service.log"))
            started = time.monotonic()
            with open(log_path, "wb") as out:
                serve = subprocess.Popen(serve_cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
            try:
                admin = wait_for_admin(state, serve, log_path, timeout=300)
            except DpfleetError as exc:
                if serve.poll() not in (-signal.SIGKILL, 0):  # a restart that fails: the finding
                    restart_error = str(exc)
                    break
                admin = None
            if fleet is None and admin is not None:
                with open(workdir / "emulate.log", "wb") as out:
                    fleet = subprocess.Popen(
                        _dpfleet("fleet", "emulate", config, "--coordinator", url, "--devices",
                                 len(ids), "--processes", processes, "--fleet-keys", keys_path,
                                 "--registry", registry, "--no-progress", "--summary",
                                 fleet_dir / "summary.json",
                                 # the coordinator is killed and restarted under the running fleet
                                 "--coordinator-timeout", 0),
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            life = {"life": len(lives), **(kill or {"kind": "none"})}
            limit = kill["after_s"] if kill is not None and kill["kind"] == "timed" else 90.0
            try:
                serve.wait(limit if kill is not None else 900)
                life["killed_by"] = "hook" if serve.returncode == -signal.SIGKILL else None
            except subprocess.TimeoutExpired:  # a timed kill, or a hook point not reached in time
                os.kill(serve.pid, signal.SIGKILL)
                serve.wait()
                life["killed_by"] = "script"
            life["exit_code"] = serve.returncode
            life["wall_s"] = round(time.monotonic() - started, 2)
            new = events(state / "service.log")[mark:]
            life_events.append(new)
            last = next((e for e in reversed(new) if e.get("event") in (
                "open", "commit", "fail", "phase_closed", "start", "listen")), None)
            life["last_event"] = None if last is None else {k: last[k] for k in last if k != "t"}
            lives.append(life)
            bar.update(1 if kill is not None else 0)
            if serve.returncode == 0 or run_finished(state):  # (a kill while it lingered at the end)
                break
            if len(lives) > len(plan) + 5:
                raise DpfleetError("the run did not finish after every planned kill")
        if fleet is not None:
            stop_process(fleet, 60)
    finally:
        bar.close()
        if fleet is not None and fleet.poll() is None:
            fleet.kill()
    wall = time.monotonic() - began
    result = check(state, cfg, ids, life_events)
    result["restart_error"] = restart_error
    killed = [x for x in lives if x["exit_code"] == -signal.SIGKILL]
    where = collections.Counter(
        x["point"] if x["killed_by"] == "hook" else f"timed:{(x['last_event'] or {}).get('event', 'boot')}"
        for x in killed)
    return {
        "kills_planned": len(plan), "kills": len(killed), "kills_at_hook_point": sum(
            x["killed_by"] == "hook" for x in killed), "kills_by_point": dict(sorted(where.items())),
        "restarts": len(lives) - 1, "lives": lives, **result,
        "rounds_planned": cfg.rounds, "devices": len(ids), "fleet_processes": processes,
        "overselect": overselect, "aggregation": "signed SecAgg+ (harary)",
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=24, help="coordinator lives to kill (>= 20)")
    parser.add_argument("--rounds", type=int, default=40,
                        help="enough that every planned kill fires before the run ends")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="fleet worker processes")
    parser.add_argument("--timed-share", type=float, default=0.25,
                        help="share of kills at a random time instead of a hook point")
    parser.add_argument("--overselect", type=float, default=0.0,
                        help="[service] overselect of the run (see the README note on resume)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run here (else a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
        result = run(args.kills, args.rounds, args.devices, args.processes, args.seed,
                     args.timed_share, args.overselect, args.keep)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args.kills, args.rounds, args.devices, args.processes, args.seed,
                         args.timed_share, args.overselect, Path(tmp))
    result.update(seed=args.seed, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                  loadavg_start=load, loadavg_end=os.getloadavg(), python=platform.python_version())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, dumps(result) + "\n")
    ok = all(result[k] for k in ("run_completed", "no_round_committed_twice",
                                 "no_tree_position_released_twice", "accounting_equals_fresh_account",
                                 "device_counters_match_participation_rows"))
    print(f"{result['kills']} kills ({result['restarts']} restarts) over "
          f"{len(result['kills_by_point'])} points; run completed: {result['run_completed']}; "
          f"no round committed twice: {result['no_round_committed_twice']}; no tree position "
          f"released twice: {result['no_tree_position_released_twice']}; eps {result['epsilon_service']}"
          f" = fresh account {result['epsilon_fresh_account']}: "
          f"{result['accounting_equals_fresh_account']}; {result['wall_s']} s -> {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
