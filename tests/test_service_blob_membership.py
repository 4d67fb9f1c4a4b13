"""Round membership through the blob store, attacked over real sockets (127.0.0.1).

`GET /v1/blobs/{sha256}` needs no credentials (content addressing is what lets a cache or a
mirror serve blobs). So no blob may name a device: if each participant's plan (its device id
and client seed) were a blob, anyone who can write the plan a device WOULD get (the run's
config is no secret, the seed derivation is public) could ask for its hash and read a 200 for
a participant and a 404 for anyone else: the membership oracle registration closed, reopened
for outsiders. Neither an outsider nor another device of the round may tell a participant's
plan from a non-participant's, and a plain assignment names no other device."""

import asyncio
import hashlib
import json

import aiohttp
import pytest
from service_fleet import checkin_all, close_all, device_keys, one_round_world, register_all
from yarl import URL

from dpfleet.coordinator.engine.simulation import derive_seed
from dpfleet.edge.wire.auth import sign_request
from dpfleet.jsonio import dumps
from dpfleet.service.server import shutdown, start


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return one_round_world(tmp_path_factory.mktemp("membership"))


async def get(url: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(URL(url + path, encoded=True),
                                                   headers=headers or {}) as r:
        return r.status, await r.read()


def would_be_plan(shared: dict, users: list, seed: int, user: str) -> bytes:
    """The plan blob `user` would get in this round if plans were per device: the shared plan
    plus its id and the public derivation of its client seed (the simulation's)."""
    fields = {k: v for k, v in shared.items() if k not in ("device_id", "client_seed")}
    seed_of = derive_seed(seed, shared["round"] - 1, users.index(user))
    return dumps({**fields, "device_id": user, "client_seed": seed_of}).encode()


def test_no_blob_tells_a_participant_from_a_non_participant(world):
    cfg, root, users, _ = world
    keys = device_keys(users)

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None)
        links = await register_all(running.url, keys, retries=0)
        try:
            replies = await checkin_all(links)
            assigned = sorted((r["position"], u) for u, r in replies.items()
                              if r["kind"] == "assignment")
            (_, spy), (_, member), *_ = assigned
            outsider = next(u for u in users if replies[u]["kind"] != "assignment")
            path = f"/v1/blobs/{replies[spy]['plan_sha256']}"
            own = json.loads((await get(running.url, path))[1])
            answers = {}
            for who in (member, outsider):  # the spy guesses both, with and without its key
                sha = hashlib.sha256(would_be_plan(own, users, cfg.seed, who)).hexdigest()
                blob = f"/v1/blobs/{sha}"
                answers[who] = [await get(running.url, blob),
                                await get(running.url, blob, sign_request(keys[spy], spy, "GET",
                                                                           blob, b""))]
            return replies, assigned, own, answers, (member, outsider)
        finally:
            await close_all(links)
            running.driver.stop()
            await shutdown(running)

    replies, assigned, own, answers, (member, outsider) = asyncio.run(main())
    assert len(assigned) == 4  # report goal 3 + 1 over-selected, 4 of 8 left out
    # the participant's guessed plan and the non-participant's get the same answer, byte for byte
    assert answers[member] == answers[outsider]
    assert [status for status, _ in answers[member]] == [404, 404]
    # the plan blob is one per attempt, shared, naming nobody
    assert not {"device_id", "client_seed"} & set(own)
    assert len({replies[u]["plan_sha256"] for _, u in assigned}) == 1
    # the seed comes over the device's authenticated channel: its own assignment
    for _, u in assigned:
        job = replies[u]
        assert job["client_seed"] == derive_seed(cfg.seed, job["round"] - 1, users.index(u))
        others = [v for v in users if v != u]
        assert "devices" not in job and not any(v in dumps(job) for v in others), job
