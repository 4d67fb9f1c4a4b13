"""Signed SecAgg(+) over HTTP through the coordinator service: a round commits with the sum of
its survivors' updates (within the encoding's proven quantization bound); a device that drops
after key sharing is left out and the round still commits from the survivors; fewer survivors
than the report goal fail the round cleanly (nothing released, no noise drawn) and the same
round number is opened again; devices refuse a setup that lists a key outside their pinned
fleet registry and send nothing for it."""

import asyncio
import json
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import (
    capture_sums,
    checkin_all,
    close_all,
    fleet_data,
    register_all,
    run_devices,
    serving,
    tiny_cfg,
)

from dpfleet.fleet.participant import local_policy, take_part
from dpfleet.secagg.round_sum import RECORD_KEYS
from dpfleet.service.server import shutdown, start

SECAGG = {"aggregation": {"kind": "secagg", "signed": True, "graph": "harary"},
          "service": {"overselect": 0.6, "report_deadline_s": 6.0, "secagg_phase_deadline_s": 3.0}}


# A phase deadline for tests whose devices act only after `checkin_all` returns: the unselected
# devices' check-ins are held 2 s (min(CHECKIN_HOLD_S, checkin_window_s + 1)) after the round
# opened, so the commit phase must outlast 2 s, with 3x margin (a stop ends an open phase at once,
# so the deadline costs a test nothing unless the test waits for it).
HELD_DEADLINE_S = 6.0


def secagg_cfg(**over):
    return tiny_cfg(**{**SECAGG, **over})


def policy_for(cfg):
    return lambda n: local_policy(cfg.dp.report_goal, cfg.aggregation.graph,
                                  cfg.aggregation.corruption, n)


def serve_with_devices(cfg, root, per_device_hooks=None, link_kw=None):
    users, examples = fleet_data(cfg, root / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    per_device = {d: {"before_phase": h} for d, h in (per_device_hooks or {}).items()}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None, poll_s=2.0)
        sums = capture_sums(running.driver.engine)
        devices = asyncio.create_task(run_devices(
            running.url, keys, examples, per_device=per_device, pinned=pinned,
            policy=policy_for(cfg), link_kw=link_kw))
        await asyncio.wait_for(asyncio.shield(running.task), 180)
        outcomes = await asyncio.wait_for(devices, 30)
        history, releases = running.driver.history, running.driver.store.releases()
        await shutdown(running)
        return users, sums, outcomes, history, releases

    return asyncio.run(main())


def plan_disc_bound(agg, m):
    """The encoding's proven L2 distance between the decoded and the exact sum of m inputs."""
    return agg.ring.decode.__self__.quantization_bound(m)


def check_sums(sums, outcomes):
    """Each committed sum is the sum of exactly its survivors' clipped updates."""
    for plan, agg in sums:
        done = {d: o for d, outs in outcomes.items() for r, a, o in outs
                if r == plan.round + 1 and o.kind == "secagg_done"}
        survivors = [plan.device_ids[u] for u in agg.survivors]
        assert sorted(survivors) == sorted(done)
        exact = np.sum([done[d].update.delta.astype(np.float64) for d in survivors], axis=0)
        error = float(np.linalg.norm(agg.total - exact))
        bound = plan_disc_bound(agg, len(survivors))
        assert error <= bound, (error, bound)
        assert float(np.linalg.norm(exact)) > 100 * error  # the sum is not trivially small


@pytest.mark.parametrize("merge_posts", [True, False], ids=["merged-posts", "post-then-poll"])
def test_a_signed_secagg_round_over_http_commits_with_its_survivors_sum(tmp_path, monkeypatch,
                                                                        merge_posts):
    """Both ways of carrying SecAgg over HTTP: posts that return the next mail (PROTOCOL.md,
    merged posts) and the v1 post + GET long-poll, which older devices still use."""
    from dpfleet.fleet.link import CoordinatorLink

    calls = {"send": 0, "send_poll": 0, "poll": 0}
    for name, key in (("secagg_send", "send"), ("secagg_send_poll", "send_poll"),
                      ("secagg_poll", "poll")):
        real = getattr(CoordinatorLink, name)

        async def counted(self, *a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return await _real(self, *a, **kw)
        monkeypatch.setattr(CoordinatorLink, name, counted)
    # no device drops here: a long masking deadline only keeps a loaded machine's first
    # (slow) training from failing the first attempt
    cfg = secagg_cfg(rounds=2, service={**SECAGG["service"], "report_deadline_s": 30.0})
    users, sums, outcomes, history, releases = serve_with_devices(
        cfg, tmp_path, link_kw={"merge_posts": merge_posts})
    assert [h["status"] for h in history] == ["committed", "committed"]
    assert [r["round"] for r in releases] == [1, 2]
    assert all(len(agg.survivors) == 5 for _, agg in sums)  # report goal 3 + 2 over-selected
    check_sums(sums, outcomes)
    # the coordinator's critical path of each committed round, by phase (fleet_load reads it)
    events = [json.loads(x) for x in (tmp_path / "state" / "service.log").read_text().splitlines()]
    critical = [e["seconds"] for e in events if e["event"] == "critical"]
    phases = {"open", "commit"} | {f"secagg_{p}" for p in ("commit", "keys", "shares", "masked",
                                                            "consistency", "unmask")}
    assert len(critical) == 2 and all(set(c) == phases for c in critical), critical
    assert all(0.0 <= t < 10.0 for c in critical for t in c.values()), critical
    parts = sum(len(agg.survivors) for _, agg in sums)  # 6 messages each, 5 of them wait
    if merge_posts:  # a GET only where a merged post's wait ran out empty
        assert calls["send_poll"] >= 5 * parts and calls["send"] == parts, calls
        assert calls["poll"] <= parts, calls
    else:
        assert calls["send_poll"] == 0 and calls["send"] == 6 * parts, calls
        assert calls["poll"] >= 5 * parts, calls


@pytest.mark.slow  # ~16 s, most of it waiting out SecAgg phase deadlines
def test_dropout_after_key_sharing_commits_from_survivors_and_too_few_fail_cleanly(tmp_path):
    from dpfleet.fleet.participant import DropOut

    cfg = secagg_cfg(rounds=2)
    users, _ = fleet_data(cfg, tmp_path / "probe")
    # five devices per attempt (goal 3, 2 over-selected; k = 4, t = 3) reach "mask" (after key
    # sharing), one attempt after the other: round 1 attempt 1: calls 1-5, three drop -> 2
    # survivors < goal: the round fails; attempt 2: calls 6-10, one drops -> 4 survivors:
    # commits (each survivor keeps t live neighbours). Round 2: nobody drops.
    calls = {"n": 0}

    def hook(phase):
        if phase == "mask":
            calls["n"] += 1
            if calls["n"] in (1, 2, 3, 6):
                raise DropOut("gone after sharing keys")

    users, sums, outcomes, history, releases = serve_with_devices(
        cfg, tmp_path, dict.fromkeys(users, hook))
    assert [(h["round"], h["status"]) for h in history] == [
        (1, "failed"), (1, "committed"), (2, "committed")]
    assert [r["round"] for r in releases] == [1, 2]  # the failed attempt released nothing
    assert [len(agg.survivors) for _, agg in sums] == [4, 5]
    plan_1, agg_1 = sums[0]
    dropped = {d for d, outs in outcomes.items() for r, a, o in outs
               if (r, a) == (1, 2) and o.kind == "dropped"}
    assert len(dropped) == 1
    assert set(releases[0]["participants"]) == {plan_1.device_ids[u] for u in agg_1.survivors}
    assert not dropped & set(releases[0]["participants"])  # the dropper is not accounted
    check_sums(sums, outcomes)
    # the aggregation record: simulate's keys (`round_sum.RECORD_KEYS`), these survivors
    metrics = [json.loads(x) for x in (tmp_path / "state" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(m["aggregation"]) for m in metrics] == [sorted(RECORD_KEYS)] * 2
    assert [m["aggregation"]["survivors"] for m in metrics] == [4, 5]
    assert [agg.info["dropped"] for _, agg in sums] == [
        sorted(set(range(5)) - set(agg_1.survivors)), []]


def test_a_dropout_between_commit_and_reveal_is_survived(tmp_path):
    """Old main failed the attempt when one committed device did not reveal (issue 22, hole 3);
    now the round commits from the other survivors, with the exact sum of their updates."""
    from dpfleet.fleet.participant import DropOut

    cfg = secagg_cfg(rounds=1)
    users, _ = fleet_data(cfg, tmp_path / "probe")
    calls = {"n": 0}

    def hook(phase):
        if phase == "advertise":  # the message carrying the graph-seed reveal
            calls["n"] += 1
            if calls["n"] == 2:
                raise DropOut("gone after committing")

    users, sums, outcomes, history, releases = serve_with_devices(
        cfg, tmp_path, dict.fromkeys(users, hook))
    assert [(h["round"], h["status"]) for h in history] == [(1, "committed")]
    dropped = {d for d, outs in outcomes.items() for _, _, o in outs if o.kind == "dropped"}
    assert len(dropped) == 1 and [len(agg.survivors) for _, agg in sums] == [4]
    assert not dropped & set(releases[0]["participants"])
    check_sums(sums, outcomes)


def test_a_device_refuses_a_setup_with_a_key_outside_its_pinned_registry(tmp_path):
    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": 2.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    cfg = secagg_cfg(rounds=1, data={"max_clients": 8}, dp={"report_goal": len(users)},
                     service={"overselect": 0.0, "secagg_phase_deadline_s": 2.0})
    fleet = {u: Ed25519PrivateKey.generate() for u in users}
    rogue = Ed25519PrivateKey.generate()  # the coordinator's own key, registered for users[0]
    pinned = {u: k.public_key().public_bytes_raw() for u, k in fleet.items()}

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None, poll_s=1.0)
        received = []
        handle = running.driver.__class__.secagg_post

        async def spy(self, device_id, number, attempt, body):
            received.append(device_id)
            return await handle(self, device_id, number, attempt, body)

        running.driver.secagg_post = spy.__get__(running.driver)
        links = await register_all(running.url, {u: rogue if u == users[0] else fleet[u]
                                                 for u in users})
        try:
            replies = await checkin_all(links)
            assert all(r["kind"] == "assignment" for r in replies.values())
            honest = users[1:]
            outcomes = await asyncio.gather(*(
                take_part(links[u], r, examples[u], pinned=pinned, policy=policy_for(cfg))
                for u, r in replies.items() if u in honest))
            return outcomes, received, running.driver.engine.next_round
        finally:
            await close_all(links)
            running.driver.stop()
            await shutdown(running)

    outcomes, received, next_round = asyncio.run(main())
    assert [o.kind for o in outcomes] == ["refused_setup"] * (len(users) - 1)
    assert all("pinned" in o.detail for o in outcomes)
    assert received == []  # not one SecAgg byte from an honest device
    assert next_round == 0  # nothing was released


def test_a_device_can_neither_speak_for_nor_read_another_position(tmp_path):
    from dpfleet.secagg.client import SecAggClient
    from dpfleet.secagg.messages import decode
    from dpfleet.secagg.setup_wire import decode_setup

    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": 3.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        async with serving(cfg, tmp_path / "state", keys) as (running, links):
            replies = await checkin_all(links)
            jobs = {u: r for u, r in replies.items() if r["kind"] == "assignment"}
            (a, job_a), (b, job_b), *rest = sorted(jobs.items(), key=lambda x: x[1]["position"])
            setup = decode_setup(bytes.fromhex(job_a["secagg"]["setup"]))
            own = {u: SecAggClient(setup, jobs[u]["position"], keys[u],
                                   policy=policy_for(cfg)(setup.n),
                                   pinned={j["position"]: keys[v].public_key().public_bytes_raw()
                                           for v, j in jobs.items()}) for u in jobs}
            commit_b = own[b].start()[0].data
            try:  # A posts B's (validly signed by B) commitment under its own credentials
                await links[a].secagg_send(job_a["round"], job_a["attempt"], commit_b)
                as_b = None
            except Exception as exc:  # noqa: BLE001
                as_b = exc
            for u in jobs:  # everyone commits honestly
                await links[u].secagg_send(jobs[u]["round"], jobs[u]["attempt"],
                                           own[u].start()[0].data if u != b else commit_b)
            mail_a, _, _ = await links[a].secagg_poll(job_a["round"], job_a["attempt"], 0)
            return as_b, [decode(m).recipient for m in mail_a], job_a["position"]

    as_b, recipients, position_a = asyncio.run(main())
    assert getattr(as_b, "status", None) == 400 and "position" in as_b.message
    assert recipients and set(recipients) == {position_a}  # only A's own mail


@pytest.mark.slow
def test_a_lost_assignment_is_handed_out_again_until_the_device_has_spoken(tmp_path):
    from dpfleet.secagg.client import SecAggClient
    from dpfleet.secagg.setup_wire import decode_setup

    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": HELD_DEADLINE_S})
    users, _ = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        async with serving(cfg, tmp_path / "state", keys) as (running, links):
            replies = await checkin_all(links)
            u, job = next((u, r) for u, r in replies.items() if r["kind"] == "assignment")
            again = await links[u].checkin()  # the first reply was "lost"
            setup = decode_setup(bytes.fromhex(job["secagg"]["setup"]))
            client = SecAggClient(setup, job["position"], keys[u], policy=policy_for(cfg)(setup.n),
                                  pinned={j: setup.identities[j] for j in range(setup.n)})
            await links[u].secagg_send(job["round"], job["attempt"], client.start()[0].data)
            after = await links[u].checkin()
            return job, again, after

    job, again, after = asyncio.run(main())
    assert again == job
    # once it has spoken, never this job again: held through the round, then a check-in for
    # the next attempt (its assignment, or a retry)
    assert after != job and after.get("attempt") != job["attempt"], after
    assert after["kind"] == "assignment" or after["reason"] != "round full", after


def first_messages(cfg, jobs: dict, keys: dict) -> dict:
    """Each assigned device's first SecAgg message (its signed commitment), by device id."""
    from dpfleet.secagg.client import SecAggClient
    from dpfleet.secagg.setup_wire import decode_setup

    out = {}
    for u, job in jobs.items():
        setup = decode_setup(bytes.fromhex(job["secagg"]["setup"]))
        client = SecAggClient(setup, job["position"], keys[u], policy=policy_for(cfg)(setup.n),
                              pinned={j: setup.identities[j] for j in range(setup.n)})
        out[u] = client.start()[0].data
    return out


def test_a_merged_post_returns_only_the_senders_mail_and_a_bad_cursor_takes_nothing(tmp_path):
    """A post with `&after=` answers with the sender's own next mail once the phase closes; a
    negative cursor is refused before the message is taken (sending it again is no duplicate)."""
    from dpfleet.fleet.link import LinkError
    from dpfleet.secagg.messages import decode

    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": HELD_DEADLINE_S})
    users, _ = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        async with serving(cfg, tmp_path / "state", keys, poll_s=5.0) as (running, links):
            jobs = {u: r for u, r in (await checkin_all(links)).items() if r["kind"] == "assignment"}
            commits = first_messages(cfg, jobs, keys)
            a = sorted(jobs)[0]
            number, attempt = jobs[a]["round"], jobs[a]["attempt"]
            try:
                await links[a].request("POST", f"/v1/rounds/{number}/secagg?attempt={attempt}"
                                       "&after=-1", commits[a])
                bad = None
            except LinkError as exc:
                bad = exc
            mail = await asyncio.gather(*(links[u].secagg_send_poll(number, attempt, commits[u], 0)
                                          for u in jobs))
            return bad, {jobs[u]["position"]: m for u, m in zip(jobs, mail, strict=True)}

    bad, mail = asyncio.run(main())
    assert bad is not None and bad.status == 400 and bad.code == "bad_cursor"
    assert len(mail) == cfg.dp.report_goal
    for position, (messages, cursor, phase) in mail.items():
        assert messages and cursor == len(messages) and phase == "keys"
        assert {decode(m).recipient for m in messages} == {position}  # its own mail only


def test_a_stop_during_a_secagg_phase_does_not_wait_out_its_deadline(tmp_path):
    """Ctrl-C, SIGTERM or an operator's stop while devices are silent in a SecAgg phase: the
    service stops at once (before, it sat out the phase deadline: 30 s by default, here 120 s),
    and the round is not released."""
    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": 120.0,
                                        "report_deadline_s": 120.0})
    users, _ = fleet_data(cfg, tmp_path / "fleet")

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None, poll_s=1.0)
        links = await register_all(running.url, {u: Ed25519PrivateKey.generate() for u in users})
        try:
            replies = await checkin_all(links)  # the round opens; no device answers its setup
            assert any(r["kind"] == "assignment" for r in replies.values())
            assert running.driver.current is not None and running.driver.current.secagg is not None
            began = time.monotonic()
            await asyncio.wait_for(shutdown(running), 20)
            return time.monotonic() - began, running.driver.engine.next_round
        finally:
            await close_all(links)

    seconds, next_round = asyncio.run(main())
    assert seconds < 20 and next_round == 0
