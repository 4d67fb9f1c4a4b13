"""dpfleet against the peers a user would pick instead, on the main job's workload, in one run (issue 26).

Workload: the main job as issue 26 states it (`MAIN_JOB`: CIFG 32/64/32, SentencePiece vocabulary
1024, seq_len 20, batch 16, lr 5.0, one local epoch over each client's <= 256 rows, 20 clients a
round, clip 2.0, Gaussian noise at noise_multiplier 0.7 on the mean; examples/shakespeare_cifg.toml
has since moved to a planned eps-8 run, 319 clients a round: --clients-per-round / --lr). Per
seed: the same start weights, the same disjoint cohorts, each client's minibatches in dpfleet's
order. The tokenized clients go to one .npz that every system loads (benchmarks/peers_worker.py
says how each one trains).

Systems, one after another in their own processes at the same torch thread count: `plain` (a
per-client torch loop), `pfl` (pfl 0.6 simulation, central Gaussian mechanism), `flower` (Flower's
simulation runtime, DifferentialPrivacyServerSideFixedClipping), `dpfleet_sequential` and
`dpfleet_cohort` (dpfleet's round trainers, as its simulator calls them). pfl and Flower run in
their own venv (default ~/.cache/dpfleet-peers/venv), created and filled from PyPI if absent, with
torch pinned to dpfleet's 2.13.0 and dpfleet installed --no-deps so they train dpfleet's model.

Recorded per system: steps/s and clients/s over all rounds (server step included, process and
framework start-up excluded), peak RSS (ru_maxrss of the process, and the sampled RSS of its whole
process tree: Ray's daemons and actors for Flower), held-out loss of the final weights per seed
(mean, sd: equal quality is within that spread), os.getloadavg() before and after. Also a
roofline: this machine's sgemm GFLOP/s at the workload's shapes (torch.matmul) against each
system's achieved GFLOP/s (the model's matmul flops per step, counted analytically).

    python benchmarks/peers.py [--quick] [--rounds 10] [--seeds 3] [--threads 2] [--systems ...]

About 6-10 min on a 2-core machine (--quick: under 3 min); writes results/peers.json and peers.png.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers_worker import Workload  # noqa: E402
from trainer_throughput import build_workload  # noqa: E402

from dpfleet.coordinator.engine.evaluation import evaluate, split_held_out  # noqa: E402
from dpfleet.coordinator.engine.simulation import derive_seed  # noqa: E402
from dpfleet.errors import DpfleetError  # noqa: E402
from dpfleet.export.models import ModelConfig, build_model  # noqa: E402
from dpfleet.export.params import get_flat, set_flat  # noqa: E402

ROOT = HERE.parent
SYSTEMS = ("plain", "pfl", "flower", "dpfleet_sequential", "dpfleet_cohort")
PEERS = ("pfl", "flower")
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dpfleet-peers" / "venv"
# torch pinned to dpfleet's own: any other spec makes pip fetch a multi-GB build
PEER_REQUIREMENTS = ("pfl==0.6.*", "flwr[simulation]", "torch==2.13.0", "setuptools>=68")
PEER_CHECK = "import pfl, flwr, ray, torch, dpfleet.export.models; print(torch.__version__)"
# The main job as issue 26 states it (examples/shakespeare_cifg.toml before it planned for eps 8):
# pinned here so the comparison does not move when the example's training settings do.
MAIN_JOB = {
    "seed": 0,
    "data": {"dataset": "shakespeare", "seq_len": 20, "max_examples": 256, "test_fraction": 0.1,
             "eval_examples": 3000},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024, "corpus": "wikitext2"},
    "model": {"arch": "cifg", "embedding_dim": 32, "hidden_dim": 64, "projection_dim": 32},
    "client": {"lr": 5.0, "batch_size": 16},
    "dp": {"noise_multiplier": 0.7, "clip_norm": 2.0, "report_goal": 20, "momentum": 0.9},
}


def peer_python(venv: Path, log=print) -> Path:
    """The peers' venv python, created and filled if it cannot import pfl, Flower and dpfleet's
    model zoo. pip is told torch==2.13.0 so it never swaps the torch it was given."""
    python = venv / "bin" / "python"
    if python.exists() and _check(python):
        return python
    log(f"installing pfl 0.6 and Flower into {venv} (once)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *PEER_REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], check=True)
    version = _check(python)
    if not version or not version.startswith("2.13.0"):
        raise DpfleetError(f"the peers' venv {venv} has torch {version!r}, not 2.13.0")
    return python


def _check(python: Path) -> str | None:
    done = subprocess.run([str(python), "-c", PEER_CHECK], capture_output=True, text=True, cwd="/")
    return done.stdout.strip() if done.returncode == 0 else None


def write_workload(path: Path, rounds: int, seeds: int,
                   config: dict = MAIN_JOB) -> tuple[ModelConfig, np.ndarray, dict]:
    """The job's clients and per-seed plan -> `path` (.npz); returns the model config, the
    held-out rows every system's final weights are scored on, and the plan's description."""
    cfg, model_cfg, data = build_workload(config)
    cohort = cfg.dp.report_goal
    if rounds * cohort > len(data.train):
        raise DpfleetError(f"{rounds} disjoint rounds of {cohort} need {rounds * cohort} clients; "
                           f"the main job has {len(data.train)}")
    cohorts = np.stack([np.random.default_rng(s).permutation(len(data.train))[:rounds * cohort]
                        .reshape(rounds, cohort) for s in range(seeds)])
    batch_seeds = np.array([[[derive_seed(s, r, int(c)) for c in row] for r, row in enumerate(plan)]
                            for s, plan in enumerate(cohorts)], dtype=np.int64)
    theta0 = []
    for s in range(seeds):
        torch.manual_seed(s)
        theta0.append(get_flat(build_model(model_cfg)))
    w = Workload([c.examples for c in data.train], cohorts, batch_seeds, np.stack(theta0), list(range(seeds)),
                 model_cfg, cfg.client.lr, cfg.client.batch_size, cfg.dp.clip_norm, cfg.dp.noise_multiplier)
    w.save(path)
    eval_rows, _ = split_held_out(data.test, cfg.data.eval_examples or None)
    return model_cfg, eval_rows, {"config": config, "model": model_cfg.to_dict(), "lr": w.lr,
                                  "batch_size": w.batch_size, "clip_norm": w.clip_norm,
                                  "noise_multiplier": w.noise_multiplier, "rounds": rounds,
                                  "clients_per_round": cohort, "train_clients": len(data.train),
                                  "eval_rows": len(eval_rows), "seq_len": cfg.data.seq_len,
                                  "participation": "disjoint cohorts (each client at most once per seed)"}


def code_state() -> dict:
    """Which dpfleet the run measured: HEAD and the training code's uncommitted files (the tree
    is shared with work in progress on the cohort path)."""
    def git(*a):
        done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    dirty = git("status", "--short", "--", "edge", "coordinator", "export")
    return {"head": git("rev-parse", "--short", "HEAD"), "uncommitted_training_code": dirty.splitlines()
            if dirty else []}


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and all its descendants (Ray's raylet, GCS and actors included)."""
    children: dict[int, list[int]] = {}
    rss = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(d.name))
            rss[int(d.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total / 2 ** 20


def run_system(system: str, python: Path, workload: Path, out: Path, threads: int, seed: int) -> dict:
    """One system on one seed's rounds, in its own process; samples its process tree's RSS every
    0.2 s (Flower: Ray's daemons and actors too)."""
    env = {**os.environ, "PEERS_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(python), str(HERE / "peers_worker.py"), system, str(workload), str(out),
                             str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tempfile.gettempdir())
    peak = [0.0]
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_rss_mib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed ({proc.returncode}):\n{log[-4000:]}")
    res = json.loads(out.with_suffix(".json").read_text())
    res.update(theta=np.load(out.with_suffix(".npz"))["theta"][0], round_seconds=res["round_seconds"][0],
               wall_seconds=time.perf_counter() - t0, peak_rss_tree_mib=peak[0],
               loadavg_1min_before_after=[round(load_before[0], 2), round(os.getloadavg()[0], 2)])
    return res


def merge(runs: list[dict]) -> dict:
    """A system's per-seed processes -> one record (peaks are maxima, seconds sums)."""
    out = {k: v for k, v in runs[-1].items() if k not in ("process_seconds", "launch_seconds_per_seed")}
    out.update(theta=np.stack([r["theta"] for r in runs]), round_seconds=[r["round_seconds"] for r in runs],
               wall_seconds=round(sum(r["wall_seconds"] for r in runs), 2),
               ru_maxrss_mib=max(r["ru_maxrss_mib"] for r in runs),
               peak_rss_tree_mib=round(max(r["peak_rss_tree_mib"] for r in runs), 1),
               loadavg_1min_before_after_per_seed=[r["loadavg_1min_before_after"] for r in runs])
    out.pop("loadavg_1min_before_after")
    if "actor_peak_rss_mib" in out:
        out["actor_peak_rss_mib"] = max(r["actor_peak_rss_mib"] for r in runs)
    return out


def step_flops(model_cfg: ModelConfig, rows: int, seq_len: int) -> dict:
    """Matmul flops of one SGD step on `rows` x `seq_len` tokens (forward 2mnk, backward twice
    that: the input and the weight gradients)."""
    e, h, p, v = model_cfg.embedding_dim, model_cfg.hidden_dim, model_cfg.projection_dim, model_cfg.vocab_size
    gates = 3 if model_cfg.arch == "cifg" else 4
    per_token = {"output_layer": 2 * p * v, "gates": 2 * (e + p) * gates * h, "projection": 2 * h * p}
    return {k: 3 * f * rows * seq_len for k, f in per_token.items()}


def sgemm_gflops(m: int, k: int, n: int, seconds: float = 0.3) -> float:
    """torch.matmul [m, k] x [k, n] at the current thread count: GFLOP/s of the fastest single
    call in `seconds` (the machine's capability; a loaded machine's stalls are in the median)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return round(2 * m * k * n / min(times) / 1e9, 2)


def roofline(model_cfg: ModelConfig, batch: int, seq_len: int, cohort: int) -> dict:
    """sgemm GFLOP/s at the step's shapes: one client's minibatch and a whole cohort stacked."""
    e, h, p, v = model_cfg.embedding_dim, model_cfg.hidden_dim, model_cfg.projection_dim, model_cfg.vocab_size
    g = 3 * h if model_cfg.arch == "cifg" else 4 * h
    out = {}
    for label, b in (("one_client", batch), ("cohort_stacked", batch * cohort)):
        tokens = b * seq_len
        out[label] = {
            f"output_fwd [{tokens},{p}]x[{p},{v}]": sgemm_gflops(tokens, p, v),
            f"output_grad_input [{tokens},{v}]x[{v},{p}]": sgemm_gflops(tokens, v, p),
            f"output_grad_weight [{v},{tokens}]x[{tokens},{p}]": sgemm_gflops(v, tokens, p),
            f"gates_step [{b},{e + p}]x[{e + p},{g}]": sgemm_gflops(b, e + p, g),
            f"projection_step [{b},{h}]x[{h},{p}]": sgemm_gflops(b, h, p),
        }
    out["square_1024"] = sgemm_gflops(1024, 1024, 1024)
    return out


def rooflines(model_cfg: ModelConfig, plan: dict, threads: int) -> dict:
    """The roofline at 1 thread and at the run's thread count, with the load while measured."""
    out = {}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        load = os.getloadavg()[0]
        out[str(t)] = {**roofline(model_cfg, plan["batch_size"], plan["seq_len"], plan["clients_per_round"]),
                       "loadavg_1min": round(load, 2)}
    torch.set_num_threads(threads)
    return out


def summarize(res: dict, w: Workload, model_cfg: ModelConfig, eval_rows: np.ndarray, seq_len: int) -> dict:
    """Throughput over the rounds after each seed's first (the first holds torch's warm-up and,
    for Flower, Ray's actor start: reported apart), achieved GFLOP/s, held-out loss per seed."""
    rounds = np.array(res["round_seconds"])
    steps_per_round = np.array([[sum(-(-len(w.clients[c]) // w.batch_size) for c in cohort)
                                 for cohort in plan] for plan in w.cohorts])
    steady = slice(1, None) if rounds.shape[1] > 1 else slice(None)
    seconds, steps = float(rounds[:, steady].sum()), int(steps_per_round[:, steady].sum())
    clients = int(w.cohorts[:, steady].size)
    flops = sum(sum(step_flops(model_cfg, min(w.batch_size, len(w.clients[c]) - i), seq_len).values())
                for c in w.cohorts[:, steady].reshape(-1) for i in range(0, len(w.clients[c]), w.batch_size))
    model = build_model(model_cfg)
    losses, accs = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # scoring is not timed; one thread does not stall on a loaded machine
    for theta in res["theta"]:
        set_flat(model, theta)
        with torch.no_grad():
            m = evaluate(model, eval_rows)
        losses.append(m["loss"])
        accs.append(m["accuracy"])
    torch.set_num_threads(threads)
    keep = {k: v for k, v in res.items() if k not in ("theta", "round_seconds", "system")}
    return {
        "steps_per_s": round(steps / seconds, 2), "clients_per_s": round(clients / seconds, 2),
        "seconds": round(seconds, 2), "gradient_steps": steps, "client_updates": clients,
        "achieved_gflops": round(flops / seconds / 1e9, 2),
        "steps_per_s_all_rounds": round(int(steps_per_round.sum()) / float(rounds.sum()), 2),
        "first_round_seconds_per_seed": [round(float(x), 2) for x in rounds[:, 0]],
        "heldout_loss_per_seed": [round(x, 4) for x in losses],
        "heldout_loss_mean": round(float(np.mean(losses)), 4),
        "heldout_loss_sd": round(float(np.std(losses, ddof=1)), 4) if len(losses) > 1 else None,
        "heldout_accuracy_mean": round(float(np.mean(accs)), 4),
        **keep,
    }


def plot(results: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    steps = [results[n]["steps_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(names, steps, color=["#2b6cb0" if n.startswith("dpfleet") else "#8c8c8c" for n in names])
    for b, n in zip(bars, names, strict=True):
        r = results[n]
        ax.annotate(f"{r['steps_per_s']:.0f} steps/s\n{r['clients_per_s']:.1f} clients/s\n"
                    f"loss {r['heldout_loss_mean']:.3f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("local SGD steps / s")
    ax.set_ylim(0, max(steps) * 1.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 2 seeds")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every system")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--lr", type=float, default=MAIN_JOB["client"]["lr"], help="local SGD learning rate")
    ap.add_argument("--clients-per-round", type=int, default=MAIN_JOB["dp"]["report_goal"])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the peers' venv (made if absent)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "peers.json")
    ap.add_argument("--note", default="", help="a line for the JSON (the machine's state, why this run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seeds = 2, 2
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        print(f"error: unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        sys.exit(2)
    load_start, code_start = os.getloadavg(), code_state()
    torch.set_num_threads(args.threads)
    peers = peer_python(args.venv) if set(systems) & set(PEERS) else None
    with tempfile.TemporaryDirectory(prefix="dpfleet-peers-") as tmp:
        workload = Path(tmp) / "workload.npz"
        job = {**MAIN_JOB, "client": {**MAIN_JOB["client"], "lr": args.lr},
               "dp": {**MAIN_JOB["dp"], "report_goal": args.clients_per_round}}
        model_cfg, eval_rows, plan = write_workload(workload, args.rounds, args.seeds, job)
        w = Workload.load(workload)
        runs: dict[str, list[dict]] = {n: [] for n in systems}
        for si in range(args.seeds):  # seed-major, the order reversed every other seed: load drift is shared
            for system in systems if si % 2 == 0 else systems[::-1]:
                python = peers if system in PEERS else Path(sys.executable)
                res = run_system(system, python, workload, Path(tmp) / f"{system}_{si}", args.threads, si)
                runs[system].append(res)
                print(f"seed {si} {system}: {sum(res['round_seconds'][1:]):.1f} s after round 1, "
                      f"round 1 {res['round_seconds'][0]:.1f} s, load {res['loadavg_1min_before_after']}",
                      flush=True)
        results = {n: summarize(merge(runs[n]), w, model_cfg, eval_rows, plan["seq_len"]) for n in systems}
        for n, r in results.items():
            print(f"{n}: {r['steps_per_s']} steps/s, {r['clients_per_s']} clients/s, loss "
                  f"{r['heldout_loss_mean']} (sd {r['heldout_loss_sd']})")
    ratios = {}
    if "dpfleet_cohort" in results:
        for other in systems:
            if other != "dpfleet_cohort":
                ratios[f"dpfleet_cohort_over_{other}"] = round(
                    results["dpfleet_cohort"]["steps_per_s"] / results[other]["steps_per_s"], 3)
    out = {
        "workload": plan, "systems": results, "ratios_steps_per_s": ratios,
        "goal": "dpfleet_cohort >= 2.5x plain and >= 3x pfl at equal held-out loss (issue 26)",
        "roofline_gflops_by_threads": rooflines(model_cfg, plan, args.threads),
        "flops_per_step_full_batch": step_flops(model_cfg, plan["batch_size"], plan["seq_len"]),
        "dpfleet_code_at_start_end": [code_start, code_state()],
        "torch_threads": args.threads, "cpu_count": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "peak_rss_harness_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "note": args.note or "shared machine: other jobs may have run; see each system's loadavg",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    loads = [x for r in results.values() for x in np.ravel(r["loadavg_1min_before_after_per_seed"])]
    plot(results, args.out.with_suffix(".png"),
         f"main job (CIFG 32/64/32, V=1024), {args.seeds} seeds x {args.rounds} rounds x "
         f"{plan['clients_per_round']} clients, {args.threads} torch thread(s), "
         f"load {min(loads):.1f}-{max(loads):.1f}")
    print(json.dumps({k: out[k] for k in ("ratios_steps_per_s", "roofline_gflops_by_threads")}, indent=2))


if __name__ == "__main__":
    try:
        main()
    except DpfleetError as exc:  # too many rounds for the population, a broken peers' venv
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
