"""The service's release step: `service serve --policy FILE` publishes the finished model
(STATE/release, signed with STATE's bundle key) only when the run meets the release policy.

Attack: a run in research mode (the tiny service config's dp.noise_seed: a caveat) served under
`allow_caveats = false` publishes nothing; service.log, the console and the status page say why
in the one refusal line. The same run under a policy it meets (rho <= 1000) publishes a bundle
that verifies with STATE's pinned key and whose manifest records the policy and the run's rho.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from bundle_helpers import program_cache
from service_fleet import TINY, device_keys, fleet_data, run_devices, tiny_cfg

from dpfleet.cli import main
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.edge.bundle_format import verify_bundle
from dpfleet.export.policy import ReleasePolicy
from dpfleet.service.admin import public_status
from dpfleet.service.run_bundle import PUBLIC_FILE, RELEASE_DIR
from dpfleet.service.server import shutdown, start
from dpfleet.service.status_page import render

pytest.importorskip("onnxruntime")


async def serve_with(cfg, state, keys, examples, policy, said):
    """Serve one run to its end under `policy`; (last status, public status)."""
    running = await start(cfg, state, log=said.append, policy=policy)
    devices = asyncio.create_task(run_devices(running.url, keys, examples))
    await asyncio.wait_for(asyncio.shield(running.task), 120)
    await asyncio.wait_for(devices, 60)
    status, public = running.driver.status(), public_status(running.driver)
    await shutdown(running)
    return status, public


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("service-policy")
    cfg = tiny_cfg(rounds=1, eval_every=1)
    users, examples = fleet_data(cfg, root / "fleet")
    return cfg, root, device_keys(users), examples


def test_attack_a_refused_model_is_not_published_and_the_page_says_why(world):
    cfg, root, keys, examples = world
    (root / "refuse.toml").write_text("allow_caveats = false\n")
    said: list[str] = []
    status, public = asyncio.run(serve_with(cfg, root / "state-refused", keys, examples,
                                            ReleasePolicy.load(root / "refuse.toml"), said))
    line = status["release"]
    assert status["run_state"] == "finished"
    assert line.startswith("refused by refuse.toml: allow_caveats = false: NOT FULLY PRIVATE"), line
    assert "research mode (dp.noise_seed = 11)" in line and "\n" not in line
    assert not (root / "state-refused" / RELEASE_DIR).exists()
    events = [json.loads(x) for x in (root / "state-refused" / "service.log").read_text().splitlines()]
    assert [e["reason"] for e in events if e["event"] == "release_refused"] == [line]
    assert f"release: {line}" in said
    assert public["release"] == line and line.split(": NOT")[0] in render(public, {})


@pytest.mark.slow
def test_a_model_that_meets_the_policy_is_published_with_the_policy_recorded(world, tmp_path_factory,
                                                                            monkeypatch):
    cfg, root, keys, examples = world
    xdg = tmp_path_factory.mktemp("xdg")
    (xdg / "dpfleet").mkdir()
    shared = program_cache(tmp_path_factory)
    shared.mkdir(parents=True, exist_ok=True)
    (xdg / "dpfleet" / "programs").symlink_to(shared)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    (root / "pass.toml").write_text("max_rho = 1000.0\n")
    state = root / "state-passed"
    status, _ = asyncio.run(serve_with(cfg, state, keys, examples,
                                       ReleasePolicy.load(root / "pass.toml"), []))
    assert status["release"].startswith("released: the model passed pass.toml; signed bundle in ")
    verified = verify_bundle(state / RELEASE_DIR, (state / PUBLIC_FILE).read_bytes())
    record = verified.manifest["release_policy"]
    privacy = json.loads((state / "privacy.json").read_text())
    assert record["rules"] == {"max_rho": 1000.0} and record["file"] == "pass.toml"
    assert record["passed"]["rho"] == privacy["zcdp"] > 0
    assert verified.manifest["caveats"] == privacy["caveats"] != []
    events = [json.loads(x)["event"] for x in (state / "service.log").read_text().splitlines()]
    assert "release" in events and "release_refused" not in events


def test_a_bad_policy_file_is_one_line_before_the_state_is_made(tmp_path, capsys):
    (tmp_path / "tiny.toml").write_text(to_toml({**TINY, "dp": {**TINY["dp"], "noise_seed": -1}}))
    (tmp_path / "p.toml").write_text("max_rho = 2.0\nbeat_unigrams = true\n")
    with pytest.raises(SystemExit) as exit_:
        main(["service", "serve", str(tmp_path / "tiny.toml"), "--state", str(tmp_path / "st"),
              "--policy", str(tmp_path / "p.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [
        f"error: {tmp_path / 'p.toml'}: unknown policy key 'beat_unigrams'; the keys are max_epsilon, "
        "delta, max_rho, beat_public_model, beat_unigram, allow_caveats"], err
    assert not (tmp_path / "st").exists()
