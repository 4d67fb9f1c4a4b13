"""The quality notes' paired differences: t-interval from the sample sd, exact seed counts."""

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "paired", Path(__file__).parents[1] / "benchmarks" / "quality" / "paired.py")
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


def test_t_interval_uses_the_sample_sd():
    s = paired.paired_difference([3.0, 5.0, 7.0], [2.0, 3.0, 4.0])  # differences 1, 2, 3
    assert s["mean"] == 2.0 and s["sd"] == 1.0  # ddof = 1 (ddof = 0 would give 0.816)
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2)
    assert s["ci95"] == pytest.approx([2.0 - half, 2.0 + half])


def test_seed_counts_are_exact():
    s = paired.paired_difference([1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.5])
    assert (s["up"], s["down"], s["tied"], s["n"]) == (4, 1, 0, 5)
    assert paired.format_difference(s).endswith("4 up / 1 down of 5")
    one = paired.paired_difference([1.0], [0.5])
    assert paired.format_difference(one) == "+0.50, 1 up / 0 down of 1"
