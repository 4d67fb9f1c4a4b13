"""Availability traces (edge/traces.py, trace_gen.py, trace_fedscale.py, cli_trace.py): the
plain-text schema and its streaming reader, the seeded generator, the FedScale converter that
refuses pickled code, and `dpfleet trace`."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import tracemalloc

import numpy as np
import pytest
from cli_helpers import run_here

from dpfleet.edge.trace_fedscale import convert_fedscale, plain_unpickle
from dpfleet.edge.trace_gen import GeneratorSettings, generate
from dpfleet.edge.traces import (
    availability_by_hour,
    available_seconds,
    iter_devices,
    load,
    read_header,
    write_trace,
)
from dpfleet.errors import DpfleetError

HEADER = {"format": "dpfleet-trace", "version": 1, "duration": 86400, "start_hour": 0}


def write_lines(path, header, *devices):
    path.write_text("\n".join(json.dumps(x) for x in (header, *devices)) + "\n")
    return path


@pytest.fixture(scope="module")
def big():
    """10^5 devices over a week: the statistical properties (generated once, ~1 s)."""
    return generate(100_000, days=7, seed=3)


# -- the schema and its reader -------------------------------------------------------------------
def test_reader_streams_devices_with_their_intervals(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", HEADER,
                       {"id": "a", "intervals": [[0, 3600], [7200, 9000]], "speed": "fast"},
                       {"id": "b", "intervals": [], "speed": "slow", "failure": 0.25},
                       {"id": "c", "intervals": [[100.5, 200]], "speed": "mid", "period": 3600})
    assert read_header(path).duration == 86400
    devices = list(iter_devices(path))
    assert [d.id for d in devices] == ["a", "b", "c"]
    assert devices[0].intervals == [(0.0, 3600.0), (7200.0, 9000.0)]
    assert devices[1].failure == 0.25 and devices[0].failure is None
    assert devices[2].period == 3600.0 and devices[2].line == 4
    trace = load(path)
    assert len(trace) == 3 and list(trace.offsets) == [0, 2, 2, 3]
    # a: 3600 + 1800; b: 0; c: 99.5 s in each of 24 hours of its 3600 s period
    assert available_seconds(trace).tolist() == [5400.0, 0.0, 99.5 * 24]


def test_gzip_traces_read_like_plain_ones(tmp_path):
    plain = write_lines(tmp_path / "t.jsonl", HEADER, {"id": 1, "intervals": [[5, 6]], "speed": "mid"})
    zipped = tmp_path / "t.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert [d.intervals for d in iter_devices(zipped)] == [[(5.0, 6.0)]]
    assert [d.id for d in iter_devices(zipped)] == ["1"]


@pytest.mark.parametrize(("line", "expected"), [
    ("{not json", "line 2: expected a JSON object"),
    ('{"id": "a", "speed": "mid"}', 'line 2: expected "intervals"'),
    ('{"id": "a", "intervals": [[5, 1]], "speed": "mid"}', "line 2: expected start < end"),
    ('{"id": "a", "intervals": [[0, 10], [5, 20]], "speed": "mid"}', "line 2: expected intervals sorted"),
    ('{"id": "a", "intervals": [[0, 90000]], "speed": "mid"}',
     "line 2: expected intervals within [0, 86400]"),
    ('{"id": "a", "intervals": [], "speed": "turbo"}', "line 2: expected \"speed\" one of fast, mid, slow"),
    ('{"id": "a", "intervals": [], "speed": "mid", "failure": 1.5}', 'line 2: expected "failure" in [0, 1]'),
    ('{"id": "a", "intervals": [], "speed": "mid", "colour": 1}', 'line 2: unexpected key "colour"'),
])
def test_malformed_lines_name_the_file_the_line_and_what_was_expected(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HEADER) + "\n" + line + "\n")
    with pytest.raises(DpfleetError) as err:
        list(iter_devices(path))
    assert str(path) in str(err.value) and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_the_reader_yields_each_device_before_reading_the_next_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + '\n{"id": "a", "intervals": [[1, 2]], "speed": "mid"}\n{broken\n')
    devices = iter_devices(path)
    assert next(devices).id == "a"  # a stream: the broken line 3 is not read yet
    with pytest.raises(DpfleetError, match="line 3"):
        next(devices)


def test_a_file_without_the_header_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", {"id": "a", "intervals": [], "speed": "mid"})
    with pytest.raises(DpfleetError, match=r"line 1: expected the header"):
        read_header(path)


def test_duplicate_ids_are_refused_when_loaded(tmp_path):
    device = {"id": "a", "intervals": [], "speed": "mid"}
    other = {"id": "b", "intervals": [], "speed": "mid"}
    path = write_lines(tmp_path / "t.jsonl", HEADER, other, device, other, device)
    with pytest.raises(DpfleetError, match=r"line 4: device id 'b' repeats line 2"):
        load(path)
    assert load(write_lines(tmp_path / "u.jsonl", HEADER, other, device)).ids.tolist() == ["b", "a"]


def test_eligible_at_finds_the_interval_holding_t(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", HEADER,
                       {"id": "a", "intervals": [[0, 10], [20, 30], [40, 50]], "speed": "mid"},
                       {"id": "b", "intervals": [], "speed": "mid"},
                       {"id": "c", "intervals": [[25, 26]], "speed": "mid", "period": 100})
    trace = load(path)
    at = {t: trace.eligible_at(t).tolist() for t in (0, 9.9, 10, 25, 45, 125, 199)}
    assert at == {0: [True, False, False], 9.9: [True, False, False], 10: [False, False, False],
                  25: [True, False, True], 45: [True, False, False], 125: [False, False, True],
                  199: [False, False, False]}


# -- the generator --------------------------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    paths = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        paths.append(tmp_path / f"{name}.jsonl")
        write_trace(paths[-1], generate(2000, days=2, seed=seed))
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c
    assert oct(paths[0].stat().st_mode & 0o777) == "0o600"


def test_written_trace_loads_back_to_the_same_arrays(tmp_path):
    trace = generate(500, days=3, seed=1)
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, trace)
    back = load(path)
    for name in ("offsets", "starts", "ends", "speed", "period"):
        assert np.array_equal(getattr(back, name), getattr(trace, name)), name
    assert np.allclose(back.failure, trace.failure)
    assert back.header.duration == 3 * 86400


def test_fraction_available_by_hour_has_a_day_cycle(big):
    by_hour = availability_by_hour(big)
    assert by_hour.shape == (24,)
    night, day = by_hour[[0, 1, 2, 3, 4]].mean(), by_hour[[10, 11, 12, 13, 14]].mean()
    assert night > 3 * day > 0  # phones charge and idle on Wi-Fi at night
    # the cycle repeats every day: each day's peak hour is at night
    per_day = availability_by_hour(big, per_day=True)
    assert per_day.shape == (7, 24)
    assert all(int(np.argmax(row)) in {22, 23, 0, 1, 2, 3, 4, 5} for row in per_day)


def test_a_minority_of_devices_holds_most_of_the_available_time(big):
    seconds = np.sort(available_seconds(big))[::-1]
    top = seconds[: int(0.3 * len(seconds))].sum() / seconds.sum()
    assert 0.7 < top < 0.95  # FLASH: the top 30% of clients do 86% of the work
    assert (seconds == 0).mean() < 0.25


def test_generated_devices_are_heterogeneous_and_fail_sometimes(big):
    counts = np.bincount(big.speed, minlength=3) / len(big)
    assert all(0.15 < c < 0.6 for c in counts)
    assert 0.07 < float(np.mean(big.failure)) < 0.13  # more than 1 in 10 fail (FLASH)


def test_memory_is_proportional_to_the_devices(big):
    per_device = big.nbytes / len(big)
    assert per_device < 400, per_device  # a week: ~8 intervals of 16 bytes, plus the columns
    tracemalloc.start()
    generate(50_000, days=7, seed=4)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak / 50_000 < 1500, peak  # generated in fixed-size chunks: no 10^6-sized temporaries


@pytest.mark.slow
def test_a_million_devices_stay_proportional_to_the_devices():
    tracemalloc.start()
    trace = generate(1_000_000, days=7, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(trace) == 1_000_000 and trace.nbytes / len(trace) < 400
    assert peak / len(trace) < 600, peak  # measured: ~180 bytes per device at the peak
    assert 0.1 < trace.eligible_at(2 * 86400 + 3600).mean() < 0.5  # 01:00 UTC on day 3


def test_settings_are_checked():
    with pytest.raises(DpfleetError, match="devices"):
        generate(0, days=1, seed=0)
    with pytest.raises(DpfleetError, match="night_share"):
        generate(10, days=1, seed=0, settings=GeneratorSettings(night_share=1.5))


# -- FedScale --------------------------------------------------------------------------------------
def fedscale_files(tmp_path):
    behave = {7: {"active": [0, 500, 900], "inactive": [100, 600, 1000], "finish_time": 1000},
              3: {"active": [50], "inactive": [60], "finish_time": 200}}
    capacity = {1: {"computation": 300.0, "communication": 5000.0},
                2: {"computation": 20.0, "communication": 800.0}}
    (tmp_path / "client_behave_trace").write_bytes(pickle.dumps(behave))
    (tmp_path / "client_device_capacity").write_bytes(pickle.dumps(capacity))
    return tmp_path / "client_behave_trace", tmp_path / "client_device_capacity"


def test_fedscale_trace_converts_to_the_plain_schema(tmp_path):
    behave, capacity = fedscale_files(tmp_path)
    out = tmp_path / "fs.jsonl"
    convert_fedscale(behave, out, capacity=capacity)
    devices = list(iter_devices(out))
    # FedScale pairs client i with the i-th key of each file (in the file's order)
    assert [(d.id, d.intervals, d.period, d.speed) for d in devices] == [
        ("7", [(0.0, 100.0), (500.0, 600.0), (900.0, 1000.0)], 1000.0, "slow"),
        ("3", [(50.0, 60.0)], 200.0, "fast")]
    assert read_header(out).duration == 1000


class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "client_behave_trace"
    evil.write_bytes(pickle.dumps({1: {"active": [0], "inactive": [Boom(marker)], "finish_time": 9}}))
    with pytest.raises(DpfleetError) as err:
        plain_unpickle(evil)
    assert "not plain data" in str(err.value) and "system" in str(err.value)
    assert not marker.exists()
    proc = run_here("trace", "convert-fedscale", str(evil), str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_fedscale_file_of_the_wrong_shape_is_named(tmp_path):
    path = tmp_path / "client_behave_trace"
    path.write_bytes(pickle.dumps({1: {"active": [0, 5], "inactive": [3], "finish_time": 9}}))
    with pytest.raises(DpfleetError, match=r"client 1: expected \"active\" and \"inactive\" lists"):
        convert_fedscale(path, tmp_path / "o.jsonl")
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(DpfleetError, match="not a pickle"):
        convert_fedscale(path, tmp_path / "o.jsonl")


# -- the CLI ---------------------------------------------------------------------------------------
def test_cli_generates_and_inspects(tmp_path):
    out = tmp_path / "t.jsonl"
    proc = run_here("trace", "generate", str(out), "--devices", "300", "--days", "2", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    proc = run_here("trace", "inspect", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["devices"] == 300 and len(summary["available_by_hour"]) == 24
    assert set(summary["available_hours_per_day_percentiles"]) == {"p10", "p50", "p90", "p99"}
    text = run_here("trace", "inspect", str(out)).stdout
    assert "devices: 300" in text and "top 30%" in text


def test_cli_help_explains_the_group():
    proc = run_here("trace", "--help")
    assert proc.returncode == 0
    assert all(cmd in proc.stdout for cmd in ("generate", "inspect", "convert-fedscale"))


def test_cli_malformed_trace_is_one_error_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HEADER) + '\n{"id": "a"}\n')
    proc = run_here("trace", "inspect", str(path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"{path} line 2: expected" in proc.stderr



def test_eligible_at_agrees_with_a_scan_of_every_interval():
    trace = generate(300, days=2, seed=9)
    rng = np.random.default_rng(0)
    for t in rng.uniform(0, 2 * 86400, 40):
        scan = [any(s <= t < e for s, e in trace.record(d).intervals) for d in range(len(trace))]
        assert trace.eligible_at(t).tolist() == scan


def test_a_truncated_gzip_trace_is_one_error(tmp_path):
    trace = tmp_path / "t.jsonl.gz"
    write_trace(trace, generate(200, days=1, seed=2))
    trace.write_bytes(trace.read_bytes()[:-40])
    with pytest.raises(DpfleetError, match=r"t.jsonl.gz: not a text trace"):
        load(trace)


def test_cli_converts_fedscale_then_inspects(tmp_path):
    behave, capacity = fedscale_files(tmp_path)
    out = tmp_path / "fs.jsonl"
    proc = run_here("trace", "convert-fedscale", str(behave), str(out), "--capacity", str(capacity),
                    "--days", "1")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(run_here("trace", "inspect", str(out), "--json").stdout)
    # a day: client 7 has 86 whole 1000 s periods of 300 s, then [86000, 86100) of the 87th;
    # client 3 has 432 periods of 200 s holding 10 s each
    assert summary["devices"] == 2 and summary["speed"] == {"fast": 1, "mid": 0, "slow": 1}
    median = (86 * 300 + 100 + 432 * 10) / 2 / 3600
    assert summary["available_hours_per_day_percentiles"]["p50"] == round(median, 3) == 4.197


def test_inspect_of_a_trace_without_devices(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", HEADER)
    proc = run_here("trace", "inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "devices: 0" in proc.stdout and "nan" not in proc.stdout
    summary = json.loads(run_here("trace", "inspect", str(path), "--json").stdout)
    assert summary["available_hours_per_day_percentiles"]["p50"] is None


def test_cli_never_writes_a_trace_over_an_existing_file(tmp_path):
    """OUT may be anyone's file (a config, another trace): generate and convert-fedscale refuse it
    in one line and leave its bytes as they were."""
    theirs = tmp_path / "config.toml"
    theirs.write_text("rounds = 20\n")
    for args in (("generate", str(theirs), "--devices", "10", "--days", "1"),
                 ("convert-fedscale", str(tmp_path / "missing.pkl"), str(theirs))):
        proc = run_here("trace", *args)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"error: {theirs} exists: a trace is never written over "
                                                     "a file; remove it or choose another name"]
        assert theirs.read_text() == "rounds = 20\n"
