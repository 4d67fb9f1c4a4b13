"""Load on the coordinator service from an emulated fleet over loopback (issue 12's benchmark).

One run = `dpfleet service serve` (subprocess, sampled for RSS and CPU) + `dpfleet fleet
emulate` (subprocess, K worker processes) on a shared config: signed SecAgg+ (harary graph),
uniform participation, a small CIFG model, devices always eligible, no link delay, speed 1, so
the only device time is real training. Reported per run:

* per-round wall time (the service log's commit-to-commit, and open-to-commit), the device
  training time of the round (the union of the K training threads' busy intervals inside the
  round, divided by K: the wall time K parallel trainers need at least), and their difference,
  the coordinator's overhead per round (goal <= 1 s);
* that overhead next to its parts in CPU seconds per round (rounds 2..): the coordinator's CPU,
  the devices' own SecAgg CPU by step (thread CPU time, from each device's outcome), the rest
  of the fleet's CPU (HTTP client, request auth, idle check-ins) and what is left (waiting);
* the coordinator's critical path per round (rounds 2..): the seconds devices spent waiting on
  the coordinator itself, from its `critical` events (edge/wire/PROTOCOL.md): opening the round
  once it could open, closing each SecAgg phase from the arrival of the message that completed
  it to the next phase's messages being in the mailboxes, and the commit (decode, DP step,
  release log, accounting, fsync). Unlike wall-minus-training this leaves out device work the
  emulation puts on the same cores, so it is the coordinator's overhead as phones would see it;
* p50 / p99 latency of the devices' signed requests (long-polls excluded; retries included);
* the coordinator's peak RSS (VmHWM) and CPU seconds;
* updates lost: devices whose SecAgg part ended `secagg_done` in a committed attempt but are
  missing from the committed participation (goal 0); failed attempts;
* with `--baseline`, the same config through `simulate` in this process (sequential trainer,
  in-process SecAgg): its seconds per round are the training-time baseline.
Two fleet sizes (`--devices` and `--small`; `--small 0`: one run) give the RSS comparison (goal:
flat). A fleet larger than Shakespeare's 1,277 (play, speaker) users gets its users from a
`dataset = "jsonl"` file of the real speeches dealt round-robin (`speech_users`); issue 32's figure:
`--devices 10000 --small 0 --rounds 6 --retry 20 --out results/fleet_load_10k.json`.
Saves results/fleet_load.json with cores, torch threads, the event loop and the load averages
before and after each run (2 cores: a quiet machine reads below 1; with other work on it CPU
seconds inflate and wall times stretch, so compare CPU and critical-path seconds, not wall).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

CONFIG = """
rounds = {rounds}
eval_every = {rounds}
seed = 0
checkpoint_every = 0

[data]
dataset = "shakespeare"
max_clients = {devices}
eval_examples = 500
max_examples = 16

[tokenizer]
kind = "sentencepiece"
vocab_size = 1024

[model]
arch = "cifg"
embedding_dim = 16
hidden_dim = 32
projection_dim = 16

[client]
lr = 1.0
batch_size = 16
trainer = "sequential"

[dp]
noise_multiplier = 1.0
clip_norm = 0.5
report_goal = {goal}
momentum = 0.9

[participation]
mode = "uniform"

[aggregation]
kind = "secagg"
graph = "harary"
signed = true

[service]
checkin_retry_s = {retry}
checkin_window_s = 2.0
report_deadline_s = 120.0
secagg_phase_deadline_s = 60.0
rate_per_s = 50.0

[devices]
latency_ms = 0.0
bandwidth_mbps = 1000000.0
speed_sigma = 0.0
link_sigma = 0.0
"""


def dpfleet(*args) -> list[str]:
    return [sys.executable, "-m", "dpfleet", *map(str, args)]


class Sampler(threading.Thread):
    """Peak RSS (VmHWM, the kernel's high-water mark) and CPU seconds of one process."""

    def __init__(self, pid: int, tree: bool = False):
        super().__init__(daemon=True)
        self.pid, self.hwm_kb, self.cpu_s, self.stop = pid, 0, 0.0, threading.Event()
        self.tree = tree  # also its children's CPU (the fleet's worker processes)
        self.children: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []  # (unix time, CPU seconds so far)

    def run(self) -> None:
        import psutil

        proc = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.hwm_kb = max(self.hwm_kb, int(line.split()[1]))
                times = proc.cpu_times()
                self.cpu_s = times.user + times.system
                if self.tree:
                    for child in proc.children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            t = child.cpu_times()
                            self.children[child.pid] = t.user + t.system
                    self.cpu_s += sum(self.children.values())
                self.samples.append((time.time(), self.cpu_s))
            except (OSError, psutil.Error):
                return
            time.sleep(0.2)


def cpu_between(samples: list[tuple[float, float]], lo: float, hi: float) -> float:
    """CPU seconds a sampled process spent between two unix times (nearest samples inside)."""
    inside = [c for t, c in samples if lo <= t <= hi]
    return inside[-1] - inside[0] if len(inside) > 1 else float("nan")


def union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the intervals (one thread's intervals never overlap)."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


SHAKESPEARE_TRAIN_USERS = 1277  # (play, speaker) clients after the 10% held-out split


def speech_users(path: Path, devices: int, test_fraction: float = 0.1) -> Path:
    """A `dataset = "jsonl"` file with enough users for `devices` training phones: Shakespeare's
    32,961 speeches dealt round-robin to synthetic users (~3 real speeches each), for a fleet larger
    than the 1,277 (play, speaker) users. Real text and real devices; only the grouping is made up
    (a load test measures the service, not what a user's text is)."""
    from dpfleet.edge.datasets import load_shakespeare

    users = math.ceil(devices / (1 - test_fraction)) + 64  # the held-out split takes ~10%
    with path.open("w") as out:
        for i, record in enumerate(load_shakespeare()):
            out.write(json.dumps({"user": f"phone{i % users:06d}", "text": record.text}) + "\n")
    return path


def fleet_run(devices: int, goal: int, rounds: int, processes: int, retry: float,
              work: Path, template: str = CONFIG) -> dict:
    """One run (see the module docstring); `template`: the config, CONFIG or a variant of it
    (benchmarks/fleet_dropout.py adds over-selection and per-phase dropout)."""
    from dpfleet.coordinator.config import load_config
    from dpfleet.edge.wire.admin_client import AdminClient, target_from_state
    from dpfleet.errors import DpfleetError
    from dpfleet.fleet.emulate import fleet_keys, load_devices
    from dpfleet.fleet.supervisor import stop_process, wait_for_admin
    from dpfleet.secagg.registry import public_registry, write_public_registry

    work.mkdir(parents=True, exist_ok=True)
    config = work / "fleet_load.toml"
    text = template.format(devices=devices, goal=goal, rounds=rounds, retry=retry)
    if devices > SHAKESPEARE_TRAIN_USERS:  # more phones than (play, speaker) users: real speeches
        text = text.replace('dataset = "shakespeare"',
                            f'dataset = "jsonl"\npath = "{speech_users(work / "users.jsonl", devices)}"')
    config.write_text(text)
    cfg = load_config(config)
    ids, _, params = load_devices(cfg)
    keys = fleet_keys(work / "fleet_keys.json", len(ids))
    write_public_registry(work / "fleet_public.json", public_registry(keys, ids))
    state = work / "state"
    began = time.time()
    with open(work / "serve.log", "wb") as out:
        serve = subprocess.Popen(dpfleet("service", "serve", config, "--state", state,
                                         "--fleet-public", work / "fleet_public.json"),
                                 stdout=out, stderr=subprocess.STDOUT)
    sampler = Sampler(serve.pid)
    sampler.start()
    admin = wait_for_admin(state, serve, work / "serve.log")
    client = AdminClient(target_from_state(state), timeout=5.0)
    with open(work / "emulate.log", "wb") as out:
        fleet = subprocess.Popen(dpfleet("fleet", "emulate", config, "--coordinator", admin["url"],
                                         "--processes", processes, "--fleet-keys",
                                         work / "fleet_keys.json", "--registry",
                                         work / "fleet_public.json", "--no-progress",
                                         "--summary", work / "summary.json"),
                                 stdout=out, stderr=subprocess.STDOUT)
    fleet_sampler = Sampler(fleet.pid, tree=True)
    fleet_sampler.start()
    status: dict = {}
    history: dict = {}
    try:
        while serve.poll() is None:  # the service's own phase timings, until it exits
            with contextlib.suppress(DpfleetError):
                status = client.status()
                history = client.history()
            time.sleep(2.0)
        fleet.wait(300)
    finally:
        stop_process(fleet, 5.0)
        stop_process(serve, 5.0)
        for s in (sampler, fleet_sampler):
            s.stop.set()
            s.join()
    summary = json.loads((work / "summary.json").read_text())
    events = [json.loads(x) for x in (state / "service.log").read_text().splitlines()]
    log = [json.loads(x) for x in (state / "participation.jsonl").read_text().splitlines()]
    result = analyse(events, log, summary, processes)
    first, last = result["per_round"][0], result["per_round"][-1]
    window = (first["t_commit"] - first["wall_s"], last["t_commit"])
    inside = [c for t, c in sampler.samples if window[0] <= t <= window[1]]
    cpu_rounds = inside[-1] - inside[0] if len(inside) > 1 else float("nan")
    fleet_inside = [c for t, c in fleet_sampler.samples if window[0] <= t <= window[1]]
    fleet_cpu = fleet_inside[-1] - fleet_inside[0] if len(fleet_inside) > 1 else float("nan")
    committed = [h for h in history.get("rounds", []) if h["status"] == "committed"]
    # steady state: first commit to last commit (round 1 also waits for 1,000 registrations)
    steady = (first["t_commit"], last["t_commit"])
    cpu_steady = [cpu_between(s.samples, *steady) / max(1, rounds - 1)
                  for s in (sampler, fleet_sampler)]
    split = overhead_split(result, *cpu_steady, os.cpu_count() or 1)

    def per_round(key: str) -> float | None:  # the coordinator's own clock, mean per round
        xs = [h[key] for h in committed if h.get(key) is not None]
        return float(np.mean(xs)) if xs else None
    return result | {
        "devices": len(ids), "report_goal": goal, "rounds": rounds, "processes": processes,
        # every 500 the service answered (its catch-all logs one `internal_error` event each)
        "internal_errors_500": sum(e["event"] == "internal_error" for e in events),
        "parameters": params, "checkin_retry_s": retry,
        "coordinator_phase_seconds": status.get("phase_seconds"),
        "coordinator_peak_rss_mb": sampler.hwm_kb / 1024, "coordinator_cpu_s": sampler.cpu_s,
        "coordinator_cpu_s_per_round": cpu_rounds / rounds,  # first round's start to last commit
        # the emulated fleet (emulate + its workers): training, SecAgg client crypto, HTTP client
        "fleet_cpu_s_per_round": fleet_cpu / rounds,
        # the commit (DP step, release log, accounting, SQLite), the coordinator's own clock
        "coordinator_commit_s_per_round": per_round("commit_s"),
        "coordinator_cpu_s_per_round_steady": cpu_steady[0],
        "fleet_cpu_s_per_round_steady": cpu_steady[1],
        "overhead_split": split,  # rounds 2.. (steady state)
        "wall_s": time.time() - began, "worker_restarts": summary["restarts"],
        "fleet_counts": summary["counts"], "requests": summary["requests"],
        "latency_p50_ms": 1e3 * summary["latency_p50_s"],
        "latency_p99_ms": 1e3 * summary["latency_p99_s"],
        "latency_by_endpoint_ms": {name: {"requests": v["requests"], "p50": 1e3 * v["p50_s"],
                                          "p99": 1e3 * v["p99_s"]}
                                   for name, v in summary["latency_by_endpoint"].items()},
    }


def device_cpu(outcomes: list, rounds: set[int]) -> dict:
    """Mean CPU seconds per given round (rounds 2.., like the steady CPU) of the devices' own
    work, by step (every attempt of a round counts: a failed attempt's work is part of that
    round's wall time)."""
    per: dict[str, float] = {}
    for _, number, _, _, _, *rest in outcomes:
        if number in rounds and rest:
            for step, seconds in rest[0].items():
                per[step] = per.get(step, 0.0) + seconds
    return {step: v / max(1, len(rounds)) for step, v in sorted(per.items())}


def overhead_split(result: dict, coordinator_cpu: float, fleet_cpu: float, cores: int) -> dict:
    """Wall-minus-training per round (median) next to what it is made of, in CPU seconds per
    round: the coordinator's CPU, the devices' SecAgg CPU (setup, encoding, the client state
    machine: key agreement, signatures, share encryption, mask expansion) and the rest of the
    fleet's CPU (HTTP client, JSON, request auth, idle devices' check-ins). On `cores` cores the
    three need at least their sum / cores of wall time; `waiting_s` is what that leaves of the
    overhead (timers, phases waiting for the slowest device, other load on the machine)."""
    steps = result["device_cpu_s_per_round"]
    train = steps.get("train", 0.0)
    secagg = sum(v for k, v in steps.items() if k != "train")
    other = fleet_cpu - train - secagg
    busy = (coordinator_cpu + secagg + other) / cores
    overhead = result["round_overhead_s"]["median"]
    return {"overhead_s": overhead, "coordinator_cpu_s": coordinator_cpu,
            "device_secagg_cpu_s": secagg, "fleet_other_cpu_s": other,
            "device_train_cpu_s": train, "cores": cores, "cpu_bound_wall_s": busy,
            "waiting_s": overhead - busy}


def critical_path(events: list[dict], rounds: set[int]) -> dict:
    """The coordinator's critical path per round (the service's `critical` events, committed
    attempts of `rounds`): seconds devices wait on the coordinator itself, by phase: "open"
    (from the moment the round could open to its assignments handed out), each SecAgg phase
    (from the arrival of the message that completed it to its successor's messages being in
    the devices' mailboxes: the server's work on the phase's close, e.g. unmasking), and
    "commit" (from the last input to the commit's return: decode, DP step, release log,
    accounting, fsync). Median and max per phase and of the per-round total."""
    commits = {e["round"]: e["attempt"] for e in events if e["event"] == "commit"}
    per = [e for e in events if e["event"] == "critical" and e["round"] in rounds
           and commits.get(e["round"]) == e["attempt"]]
    if not per:
        return {}
    phases = sorted({p for e in per for p in e["seconds"]})

    def stat(xs: list[float]) -> dict:
        return {"median": float(np.median(xs)), "mean": float(np.mean(xs)),
                "max": float(np.max(xs))}
    return {"rounds": len(per), "total_s": stat([sum(e["seconds"].values()) for e in per]),
            "by_phase_s": {p: stat([e["seconds"].get(p, 0.0) for e in per]) for p in phases}}


def analyse(events: list[dict], log: list[dict], summary: dict, processes: int) -> dict:
    opens = {(e["round"], e["attempt"]): e["t"] for e in events if e["event"] == "open"}
    commits = {e["round"]: (e["attempt"], e["t"]) for e in events if e["event"] == "commit"}
    failed = [e for e in events if e["event"] == "fail"]
    busy = [tuple(x) for intervals in summary["busy"].values() for x in intervals]
    rounds, previous = [], None
    first_open = min(opens.values()) if opens else None
    for number in sorted(commits):
        attempt, t_commit = commits[number]
        t_open = opens[(number, attempt)]
        start = previous if previous is not None else first_open
        train = union_within(busy, start, t_commit) / processes
        rounds.append({"round": number, "attempt": attempt, "t_commit": t_commit,
                       "wall_s": t_commit - start,
                       "open_to_commit_s": t_commit - t_open, "train_s": train,
                       "overhead_s": t_commit - start - train})
        previous = t_commit
    committed = {e["round"] + 1: set(e["devices"]) for e in log}
    sent = {}
    for device, number, attempt, kind, *_ in summary["outcomes"]:
        if kind in ("secagg_done", "reported") and commits.get(number, (None,))[0] == attempt:
            sent.setdefault(number, set()).add(device)
    lost = sum(len(s - committed.get(n, set())) for n, s in sent.items())

    def stat(key: str) -> dict:
        xs = np.array([r[key] for r in rounds])
        return {"median": float(np.median(xs)), "mean": float(xs.mean()), "max": float(xs.max())}

    return {"per_round": rounds, "round_wall_s": stat("wall_s"),
            "round_open_to_commit_s": stat("open_to_commit_s"), "round_train_s": stat("train_s"),
            "round_overhead_s": stat("overhead_s"), "failed_attempts": len(failed),
            "updates_lost": lost, "updates_committed": sum(len(d) for d in committed.values()),
            # rounds 2.. like the CPU split (round 1 waits for the fleet's registrations)
            "coordinator_critical_path": critical_path(events, set(sorted(commits)[1:])),
            "device_cpu_s_per_round": device_cpu(summary["outcomes"], set(sorted(commits)[1:]))}


def simulate_baseline(devices: int, goal: int, rounds: int, work: Path) -> dict:
    from dpfleet.coordinator.config import load_config
    from dpfleet.coordinator.engine.simulation import run_simulation

    config = work / "baseline.toml"
    config.write_text(CONFIG.format(devices=devices, goal=goal, rounds=rounds, retry=1.0))
    cfg = load_config(config)
    began = time.perf_counter()
    run_simulation(cfg, work / "simulate", progress=False, log=lambda s: None)
    wall = time.perf_counter() - began
    return {"devices": devices, "report_goal": goal, "rounds": rounds, "wall_s": wall,
            "s_per_round": wall / rounds, "note": "includes data preparation and one evaluation"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--small", type=int, default=100, help="second fleet size (RSS)")
    parser.add_argument("--goal", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--retry", type=float, default=5.0,
                        help="[service] checkin_retry_s: how often idle devices ask again")
    parser.add_argument("--baseline", action="store_true", help="also run `simulate`")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "fleet_load.json")
    args = parser.parse_args()
    import torch

    from dpfleet.eventloop import loop_name

    result = {"benchmark": "fleet_load", "machine": platform.machine(), "event_loop": loop_name(),
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "worker_torch_threads": 1, "loadavg_before": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        for n in dict.fromkeys([args.devices, args.small]):
            if n and n >= args.goal:
                print(f"fleet of {n} devices ...", flush=True)
                before = os.getloadavg()  # a quiet machine reads < 1 (2 cores)
                run = fleet_run(n, args.goal, args.rounds, args.processes, args.retry,
                                Path(tmp) / f"fleet{n}")
                run["loadavg_before"], run["loadavg_after"] = before, os.getloadavg()
                result["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "per_round"}, indent=1),
                      flush=True)
        if args.baseline:
            print("simulate baseline ...", flush=True)
            result["simulate"] = simulate_baseline(args.devices, args.goal, args.rounds, Path(tmp))
            print(json.dumps(result["simulate"], indent=1), flush=True)
    result["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
