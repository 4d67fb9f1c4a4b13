"""examples/stackoverflow_nwp.toml at StackOverflow's size on this CPU, on a GENERATED population.

TFF's StackOverflow file cannot be downloaded here, so the run reads a generated stand-in: a
jsonl file of `--source-users` synthetic users over a generated 10,000-word vocabulary (word
counts Zipf-like, as `stackoverflow.word_count` is), each user's number of sentences
heavy-tailed (log-normal, median 40, sigma 1.5: a few users have hundreds, most a few dozen;
the config keeps at most 256, as the papers did), each sentence 1-20 Zipf-drawn words. `[data]
generated_population` cycles those users up to 342,477 clients, the StackOverflow train split's
size; cycling keeps the examples-per-user distribution of the source. Everything else is the
config's: Gboard's CIFG (1.42M parameters), 100 clients a round, tree noise, server momentum.

It runs `--rounds` rounds and records, per round, the wall seconds and the process's peak RSS
(sampled every 20 ms), the setup before the first round (data, vocabulary, population store,
noise), the evaluation's cost, and the projected wall time of the config's 1,600 rounds on this
CPU. GENERATED: users repeat and the text is random, so accuracy and epsilon mean nothing here;
it measures speed and memory only.

    python benchmarks/stackoverflow_scale.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from host_info import host  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from dpfleet.coordinator.config import parse_config, paths_against, read_toml
from dpfleet.coordinator.engine.simulation import run_simulation

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "stackoverflow_nwp.toml"
RESULTS = ROOT / "benchmarks" / "results" / "stackoverflow_scale.json"
STACKOVERFLOW_USERS = 342_477
WORDS = 10_000
GPU_NOTE = (
    "The device path is device-agnostic (client.device = 'auto' picks CUDA when present), but a GPU "
    "run still has to show: the per-round seconds of this same config on the GPU (the cohort "
    "trainer's chunking and host-to-device copies of 100 clients' rows each round); that the "
    "cohort deltas on CUDA equal the CPU sequential reference within the cohort tests' tolerance "
    "(tests/test_edge_cohort.py runs on CPU only here); and the peak device memory at 100 clients "
    "x 256 sentences with the 10,004-word output layer.")


def examples_per_user(users: int, rng: np.random.Generator) -> np.ndarray:
    """Heavy-tailed sentences per user: log-normal, median 40, sigma 1.5, at least 1."""
    return np.maximum(1, np.rint(rng.lognormal(np.log(40), 1.5, users))).astype(int)


def count_stats(counts: np.ndarray) -> dict:
    pct = {f"p{q}": float(np.percentile(counts, q)) for q in (10, 50, 90, 99)}
    return {"users": len(counts), "lognormal": {"median": 40, "sigma": 1.5}, "max": int(counts.max()),
            "mean": round(float(counts.mean()), 1), **pct,
            "mean_after_cap_256": round(float(np.minimum(counts, 256).mean()), 1)}


def write_source(folder: Path, users: int, seed: int = 0) -> dict:
    """The generated stand-in: users.jsonl ({"user", "text"} a sentence a line) and
    word_count (TFF's `word count` lines); returns the examples-per-user counts' percentiles."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(WORDS)])
    zipf = 1.0 / np.arange(1, WORDS + 1)
    p = zipf / zipf.sum()
    lines = (f"{w} {int(1e7 * q) + 1}\n" for w, q in zip(words, p, strict=True))
    (folder / "word_count").write_text("".join(lines))
    counts = examples_per_user(users, rng)
    with (folder / "users.jsonl").open("w") as f:
        for u, n in enumerate(counts):
            lengths = rng.integers(1, 21, n)
            drawn = rng.choice(WORDS, size=int(lengths.sum()), p=p)
            for sentence in np.split(drawn, np.cumsum(lengths)[:-1]):
                f.write(json.dumps({"user": f"gen{u:06d}", "text": " ".join(words[sentence])}) + "\n")
    return count_stats(counts)


class RssSampler:
    """The process's resident memory, sampled every `every` seconds; `mark()` closes a window
    and returns its peak (MiB)."""

    def __init__(self, every: float = 0.02):
        self.every, self.peak, self._stop = every, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def rss_mib() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.rss_mib())

    def mark(self) -> float:
        peak, self.peak = max(self.peak, self.rss_mib()), self.rss_mib()
        return round(peak, 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(rounds: int, population: int, source_users: int, work: Path, overrides: dict | None = None) -> dict:
    """The config on a generated population in `work`; `overrides` ({section: {key: value}}) shrink
    it for the test. Returns the measurements."""
    source = write_source(work, source_users)
    values = paths_against(read_toml(CONFIG), CONFIG.parent)
    full_rounds, full_eval_every = values["rounds"], values["eval_every"]
    values["data"] = {**values["data"], "dataset": "jsonl", "path": str(work / "users.jsonl"),
                      "generated_population": population, "eval_examples": 1000}
    values["tokenizer"] = {**values["tokenizer"], "word_counts": str(work / "word_count")}
    values.update(rounds=rounds, eval_every=rounds, checkpoint_every=0)
    for section, table in (overrides or {}).items():
        values[section] = {**values.get(section, {}), **table}
    cfg = parse_config(values)
    sampler, marks = RssSampler(), []

    def before_round(r: int, theta: np.ndarray) -> None:
        marks.append((time.perf_counter(), sampler.mark()))

    started = time.perf_counter()
    run_simulation(cfg, work / "run", progress=False, log=lambda s: None, before_round=before_round)
    marks.append((time.perf_counter(), sampler.mark()))
    sampler.stop()
    summary = json.loads((work / "run" / "summary.json").read_text())
    seconds = [round(b[0] - a[0], 2) for a, b in zip(marks, marks[1:], strict=False)]
    peaks = [b[1] for b in marks[1:]]
    train = float(np.median(seconds[:-1] if len(seconds) > 1 else seconds))
    evaluation = max(0.0, seconds[-1] - train)  # the last round also evaluates and writes the run
    setup = round(marks[0][0] - started, 1)
    evals = -(-full_rounds // full_eval_every)
    return {
        "generated": True, "population": population, "source": source,
        "config": str(CONFIG.relative_to(ROOT)), "rounds": rounds, "report_goal": cfg.dp.report_goal,
        "parameters": summary["parameters"], "client_trainer": summary.get("client_trainer"),
        "setup_seconds": setup, "round_seconds": seconds, "round_peak_rss_mib": peaks,
        "setup_peak_rss_mib": marks[0][1],
        "process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "evaluation_seconds": round(evaluation, 1),
        "projected_1600_rounds_hours": round((setup + full_rounds * train + evals * evaluation) / 3600, 2),
        "projection": f"setup + {full_rounds} x the median training round ({train:.1f} s) + {evals} "
                      f"evaluations (eval_every {full_eval_every}) at the measured evaluation cost",
        "generated_population_notice": summary.get("generated_population"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--source-users", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    before = host(threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.rounds, STACKOVERFLOW_USERS, args.source_users, Path(tmp))
    out = {"what": "examples/stackoverflow_nwp.toml on a GENERATED population of StackOverflow's size "
                   "(speed and memory only: users repeat, text is random, eps means nothing)",
           "host_before": before, "host_after": host(threads=1), **result, "gpu": GPU_NOTE}
    text = json.dumps(out, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
