"""What `dpfleet service serve` tells its console: one line per committed round and, when the
run finishes, the result block `simulate` ends with (its values those of summary.json and
privacy.json); a busy port is one line that leaves the state directory as it was. Real sockets
on 127.0.0.1, the devices of tests/service_fleet.py in the coordinator's own event loop."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from cli_helpers import run_here
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.cli.result_block import saved_result_lines
from dpfleet.coordinator.state.run_dir import to_toml

SECRET = {"noise_seed": -1, "warn_epsilon": 0.5}  # serve's secret noise; eps above 0.5 warns


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`service serve` of a 3-round run (evaluated every 2 rounds) to its end, in this
    process, with every device taking part: (completed process, state directory)."""
    import dpfleet.service.server as server

    root = tmp_path_factory.mktemp("console")
    cfg = tiny_cfg(rounds=3, eval_every=2, dp=SECRET)
    config = root / "c.toml"
    config.write_text(to_toml(cfg.resolved()))
    users, examples = fleet_data(cfg, root / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    real_start, devices = server.start, []

    async def start_with_devices(*args, **kwargs):
        running = await real_start(*args, **kwargs)
        devices.append(asyncio.create_task(run_devices(running.url, keys, examples)))
        return running

    mp = pytest.MonkeyPatch()
    mp.setattr(server, "start", start_with_devices)
    try:
        done = run_here("service", "serve", str(config), "--state", str(root / "state"))
    finally:
        mp.undo()
    return done, root / "state"


def test_serve_prints_each_committed_round(served):
    done, state = served
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(x) for x in (state / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2, 3]
    rounds = [x for x in done.stderr.splitlines() if x.startswith("round ")]
    assert len(rounds) == 3
    for k, (line, m) in enumerate(zip(rounds, metrics, strict=True), start=1):
        expected = f"round {k}/3 committed: {m['clients']} devices, eps {m['epsilon']:.3f} so far"
        if k > 1:  # eval_every = 2: round 2 is evaluated, and the last; round 1 is not
            assert m["accuracy"] is not None
            expected += f", accuracy {m['accuracy']:.4f}"
        else:
            assert m["accuracy"] is None
        assert line == expected
    eps = [m["epsilon"] for m in metrics]
    assert 0 < eps[0] < eps[1] < eps[2]  # eps so far grows round by round


def test_serve_ends_with_the_result_block_of_simulate(served):
    done, state = served
    summary = json.loads((state / "summary.json").read_text())
    privacy = json.loads((state / "privacy.json").read_text())
    out = done.stdout.splitlines()
    assert out[0] == f"finished: 3 of 3 rounds committed, 0 failed; state in {state}"
    warnings = [x for x in out if x.startswith("WARNING")]
    assert summary["warnings"] and any("dp.warn_epsilon" in w for w in summary["warnings"])
    assert warnings == [f"WARNING               {w}" for w in privacy["caveats"] + summary["warnings"]]
    final, base, start = summary["final"], summary["unigram_baseline"], summary["initial"]
    assert (f"next-token accuracy   model {final['accuracy']:.4f}   starting model "
            f"{start['accuracy']:.4f}   unigram baseline {base['accuracy']:.4f}") in out
    assert (f"perplexity            model {final['perplexity']:.1f}   starting model "
            f"{start['perplexity']:.1f}   unigram baseline {base['perplexity']:.1f}") in out
    assert any(x.startswith(f"privacy               eps = {privacy['epsilon']:.2f} at delta = "
                            f"{privacy['delta']:g}") for x in out)
    assert f"noise                 {privacy['noise_mechanism']}" in out
    assert out[-1] == f"run directory         {state}"
    # read back from the run's files (`fleet run`, whose coordinator is another process): the same
    assert saved_result_lines(state) == out[1:]


def test_a_busy_port_leaves_the_state_as_it_was(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(to_toml(tiny_cfg(rounds=1, dp=SECRET).resolved()))
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for state in (tmp_path / "new", existing):
            done = run_here("service", "serve", str(config), "--state", str(state),
                            "--listen", f"127.0.0.1:{port}")
            assert done.returncode == 2
            assert done.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
            assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
