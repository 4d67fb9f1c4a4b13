"""benchmarks/stackoverflow_scale.py on a tiny generated population: the measurements it records
are there and labelled generated, and its source has the heavy tail it claims."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling host_info
    try:
        spec = importlib.util.spec_from_file_location("stackoverflow_scale", BENCH / "stackoverflow_scale.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


TINY = {"tokenizer": {"vocab_size": 104},
        "model": {"preset": "", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
        "dp": {"report_goal": 5},
        "participation": {"min_separation": 10},
        "data": {"max_examples": 8}}


def test_tiny_generated_run_records_rounds_memory_and_projection(tmp_path):
    bench = load()
    result = bench.run(rounds=2, population=400, source_users=30, work=tmp_path, overrides=TINY)
    assert result["generated"] and result["population"] == 400
    assert result["generated_population_notice"]["clients"] == 400
    assert "GENERATED" in result["generated_population_notice"]["warning"]
    assert len(result["round_seconds"]) == 2 == len(result["round_peak_rss_mib"])
    assert all(s > 0 for s in result["round_seconds"]) and all(m > 0 for m in result["round_peak_rss_mib"])
    assert result["projected_1600_rounds_hours"] > 0 and "1600 x" in result["projection"]
    # the source's examples per user are heavy-tailed: the top percentile far above the median
    assert result["source"]["p99"] > 5 * result["source"]["p50"]
    lines = (tmp_path / "users.jsonl").read_text().splitlines()
    assert len(lines) > 30 and all('"user": "gen' in line for line in lines)


def test_source_examples_per_user_follow_the_stated_lognormal():
    bench = load()
    stats = bench.count_stats(bench.examples_per_user(20_000, np.random.default_rng(0)))
    # log-normal, median 40, sigma 1.5: quantiles exp(log 40 + 1.5 z)
    assert abs(np.log(stats["p50"]) - np.log(40)) < 0.05
    assert abs(np.log(stats["p90"]) - (np.log(40) + 1.5 * 1.2816)) < 0.08
    assert stats["mean_after_cap_256"] < stats["mean"]
