"""Request sessions (service/auth.py), attacked: after one Ed25519-signed handshake a device MACs
its requests with an X25519/HKDF session key. Each attack below is refused AND changes nothing:
a replayed MAC'd report, a report under another device's session, a forged MAC, a session
from before a coordinator restart, a handshake reply swapped by a man in the middle, and a
session opened without the identity key. The committed sum is compared bit for bit with the
honest reports' sum, and the refused vector would have moved it by a large margin."""

import asyncio
import json
import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st
from service_fleet import (
    capture_sums,
    checkin_all,
    close_all,
    honest_sum,
    one_round_world,
    register_all,
    tiny_cfg,
)
from test_service_security import raw

from dpfleet.edge.wire.auth import (
    H_MAC,
    H_SESSION,
    AuthError,
    DeviceHandshake,
    mac_request,
    session_key,
    sign_request,
)
from dpfleet.fleet.link import CoordinatorLink
from dpfleet.fleet.participant import train
from dpfleet.service.auth import NonceCache, Sessions, verify_request
from dpfleet.service.server import shutdown, start

KEY = Ed25519PrivateKey.generate()
PUB = KEY.public_key().public_bytes_raw()


def open_session(sessions: Sessions, device: str = "dev") -> tuple[str, bytes]:
    handshake = DeviceHandshake(device)
    return handshake.finish(sessions.open(device, handshake.body()))


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(["GET", "POST"]), path=st.text("abc/?=&0123", max_size=30),
       body=st.binary(max_size=64),
       field=st.sampled_from(["method", "path", "body", "time", "nonce", "device", "session",
                              "mac"]))
def test_any_change_to_a_maced_field_is_refused(method, path, body, field):
    sessions = Sessions()
    sid, key = open_session(sessions, "dev")
    sessions.open("other", DeviceHandshake("other").body())  # a second device's session
    other_sid = sessions._of_device["other"]
    headers = mac_request(key, sid, "dev", method, "/" + path, body)
    verify_request(dict(headers), method, "/" + path, body, PUB, NonceCache(not_before=0),
                   sessions=sessions)  # unchanged: accepted
    args = {"method": method, "path": "/" + path, "body": body}
    if field == "method":
        args["method"] = "PUT"
    elif field == "path":
        args["path"] += "x"
    elif field == "body":
        args["body"] += b"\0"
    elif field == "time":
        headers["X-Dpfleet-Time"] = repr(float(headers["X-Dpfleet-Time"]) + 0.5)
    elif field == "nonce":
        headers["X-Dpfleet-Nonce"] = secrets.token_hex(16)
    elif field == "device":
        headers["X-Dpfleet-Device"] = "other"
    elif field == "session":
        headers[H_SESSION] = other_sid
    else:
        headers[H_MAC] = bytes(a ^ (i == 3) for i, a in enumerate(bytes.fromhex(headers[H_MAC]))).hex()
    with pytest.raises(AuthError):
        verify_request(headers, args["method"], args["path"], args["body"], PUB,
                       NonceCache(not_before=0), sessions=sessions)


def test_both_sides_derive_one_key_and_a_new_handshake_ends_the_old_session():
    sessions = Sessions()
    sid, key = open_session(sessions)
    assert sessions.lookup(sid) == ("dev", key)
    sid2, key2 = open_session(sessions)
    assert sessions.lookup(sid) is None and sessions.lookup(sid2) == ("dev", key2)
    assert key2 != key and len(sessions) == 1
    old = mac_request(key, sid, "dev", "POST", "/v1/checkin", b"{}")
    with pytest.raises(AuthError) as exc:
        verify_request(old, "POST", "/v1/checkin", b"{}", PUB, NonceCache(not_before=0),
                       sessions=sessions)
    assert exc.value.code == "unknown_session"
    # a low-order X25519 point yields no shared secret: refused, no session made
    with pytest.raises(AuthError):
        sessions.open("dev2", {"x25519": "00" * 32})
    assert len(sessions) == 1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return one_round_world(tmp_path_factory.mktemp("sessions"))


class MitmLink(CoordinatorLink):
    """A device whose session handshake reply is rewritten on the way by a man in the middle
    (plain HTTP): the device gets the attacker's X25519 key instead of the coordinator's."""

    attacker = None

    async def _json(self, method, path_qs, payload=None, **kw):
        reply = await super()._json(method, path_qs, payload, **kw)
        if path_qs == "/v1/session":
            spoof = DeviceHandshake(self.device_id)  # the attacker's own key pair
            MitmLink.attacker = (spoof, reply["session"], payload)
            reply = {**reply, "x25519": spoof.public.hex()}
        return reply


def test_session_attacks_are_refused_and_never_change_the_sum(world):
    cfg, root, users, examples = world
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None)
        sums = capture_sums(running.driver.engine)
        links = await register_all(running.url, keys, retries=0)
        url = running.url
        try:
            replies = await checkin_all(links)
            assert all(link.sessions_opened == 1 for link in links.values())
            assigned = sorted((r["position"], u) for u, r in replies.items()
                              if r["kind"] == "assignment")
            (_, evil), *honest = assigned
            job = replies[evil]
            path = f"/v1/rounds/{job['round']}/report?attempt={job['attempt']}"
            _, evil_update, _ = await train(links[evil], job, examples[evil])
            body = evil_update.delta.astype("<f4").tobytes()
            victim = honest[0][1]
            answers = {}
            # 1. another device's session: the evil device's session id and key, the victim's name
            sid, key = links[evil]._auth
            answers["other_session"] = await raw(url, "POST", path, body,
                                                 mac_request(key, sid, victim, "POST", path, body))
            # 2. the victim's session id with a MAC under a key the attacker made up
            vsid = links[victim]._auth[0]
            answers["forged_mac"] = await raw(url, "POST", path, body,
                                              mac_request(secrets.token_bytes(32), vsid, victim,
                                                          "POST", path, body))
            # 3. a session id the coordinator never issued
            answers["made_up_session"] = await raw(
                url, "POST", path, body, mac_request(key, secrets.token_hex(16), victim, "POST",
                                                     path, body))
            # 4. a session opened with a MAC instead of the identity signature
            hs = DeviceHandshake(evil)
            hbody = json.dumps(hs.body()).encode()
            answers["maced_handshake"] = await raw(url, "POST", "/v1/session", hbody,
                                                   mac_request(key, sid, evil, "POST",
                                                               "/v1/session", hbody))
            # 5. a man in the middle swaps the coordinator's handshake key: the attacker knows
            # the key the device derived, but the coordinator holds another one
            mitm = MitmLink(url, victim, keys[victim], retries=0)
            await mitm._open_session()
            spoof, msid, sent = MitmLink.attacker
            shared = spoof._key.exchange(X25519PublicKey.from_public_bytes(
                bytes.fromhex(sent["x25519"])))
            known = session_key(shared, victim, msid, bytes.fromhex(sent["x25519"]), spoof.public)
            assert known == mitm._auth[1]  # the attacker did learn the device's derived key
            answers["mitm"] = await raw(url, "POST", path, body,
                                        mac_request(known, msid, victim, "POST", path, body))
            await mitm.close()
            # the victim's own link: its session was replaced by the MITM'd handshake (one
            # session per device), so it opens a new one by itself and reports honestly
            updates = {}
            for _, u in honest:
                _, upd, _ = await train(links[u], replies[u], examples[u])
                updates[u] = upd
            *first_two, (_, last) = honest
            for _, u in first_two:
                upd = updates[u]
                await links[u].report(job["round"], job["attempt"], upd.delta, norm=upd.norm,
                                      clipped=upd.clipped, loss=upd.loss)
            assert links[victim].sessions_opened == 2  # re-opened after "unknown_session"
            # 6. the last honest report, MAC'd and captured on the wire: accepted once, and its
            # byte-for-byte resend is a replay
            upd = updates[last]
            lbody = upd.delta.astype("<f4").tobytes()
            lsid, lkey = links[last]._auth
            captured = {**mac_request(lkey, lsid, last, "POST", path, lbody),
                        "X-Dpfleet-Norm": repr(float(upd.norm)), "X-Dpfleet-Loss": repr(upd.loss),
                        "X-Dpfleet-Clipped": "1" if upd.clipped else "0"}
            first = await raw(url, "POST", path, lbody, captured)
            answers["replay"] = await raw(url, "POST", path, lbody, captured)
            await asyncio.wait_for(asyncio.shield(running.task), 60)
            return sums, updates, honest, answers, evil_update, first
        finally:
            await close_all(links)
            await shutdown(running)

    sums, updates, honest, answers, evil_update, first = asyncio.run(main())
    status = {k: (v[0], json.loads(v[1])["code"]) for k, v in answers.items()}
    assert status["other_session"] == (401, "unauthorized")
    assert b"another device" in answers["other_session"][1]
    assert status["forged_mac"] == (401, "unauthorized")
    assert b"bad request MAC" in answers["forged_mac"][1]
    assert status["made_up_session"] == (401, "unknown_session")
    assert status["maced_handshake"] == (401, "unauthorized")
    assert status["mitm"] == (401, "unauthorized")
    assert b"bad request MAC" in answers["mitm"][1]
    assert first[0] == 200  # the captured request itself was the honest report
    assert status["replay"] == (401, "unauthorized") and b"replayed" in answers["replay"][1]
    [(plan, agg)] = sums
    expected = honest_sum(agg.total, updates, honest)
    np.testing.assert_array_equal(agg.total, expected)  # bit for bit: nothing else got in
    assert len(agg.survivors) == 3
    assert np.linalg.norm(evil_update.delta) > 0.1 * np.linalg.norm(expected)


def test_a_session_from_before_a_restart_is_refused_and_the_link_opens_a_new_one(world):
    cfg, root, users, examples = world
    cfg = tiny_cfg(rounds=2)
    keys = {u: Ed25519PrivateKey.generate() for u in users[:2]}  # fewer than the report goal
    state = root / "restart_state"

    async def main():
        running = await start(cfg, state, log=lambda s: None)
        links = await register_all(running.url, keys, retries=0)
        u = users[0]
        link = links[u]
        try:
            await link._open_session()
            old_sid, old_key = link._auth
            await shutdown(running)
            running = await start(cfg, state, log=lambda s: None)
            # a fresh time and nonce under the old session: only the session can refuse it
            body = json.dumps({"eligibility": {"charging": True, "idle": True, "unmetered": True},
                               "runtime": "eager", "timer_expires_at": None}).encode()
            stale = await raw(running.url, "POST", "/v1/checkin", body,
                              mac_request(old_key, old_sid, u, "POST", "/v1/checkin", body))
            waiting = running.driver.device_counts()["waiting"]
            link.url = running.url
            reply = await link.checkin()  # the link opens a new session by itself
            return stale, waiting, reply, link.sessions_opened, link._auth[0] != old_sid
        finally:
            await close_all(links)
            await shutdown(running)

    stale, waiting, reply, opened, new_sid = asyncio.run(main())
    assert stale[0] == 401 and json.loads(stale[1])["code"] == "unknown_session"
    assert waiting == 0  # the refused check-in put nobody in the pool
    assert reply["kind"] == "retry" and opened == 2 and new_sid


def test_a_stolen_session_key_cannot_rebind_the_device_to_the_thiefs_key(world):
    """Whoever holds only a session key (not the identity key) MACs a register of its own
    public key for the device: a register must carry the signature of the key it registers, so
    it is refused (the one answer of every refused register); the key bound to the device stays
    the device's, and a request signed with the thief's key stays refused."""
    cfg, root, users, _ = world
    u = users[0]
    keys = {u: Ed25519PrivateKey.generate()}
    thief = Ed25519PrivateKey.generate()
    thief_pub = thief.public_key().public_bytes_raw()

    async def main():
        running = await start(cfg, root / "rebind_state", log=lambda s: None)
        links = await register_all(running.url, keys, retries=0)
        try:
            await links[u]._open_session()
            sid, skey = links[u]._auth
            body = json.dumps({"device_id": u, "public_key": thief_pub.hex()}).encode()
            rebind = await raw(running.url, "POST", "/v1/register", body,
                               mac_request(skey, sid, u, "POST", "/v1/register", body))
            checkin = b"{}"
            as_thief = await raw(running.url, "POST", "/v1/checkin", checkin,
                                 sign_request(thief, u, "POST", "/v1/checkin", checkin))
            return rebind, as_thief, running.driver.keys[u]
        finally:
            await close_all(links)
            await shutdown(running)

    rebind, as_thief, bound = asyncio.run(main())
    assert rebind[0] == 403 and b'"registration_refused"' in rebind[1]
    assert bound == keys[u].public_key().public_bytes_raw() != thief_pub
    assert as_thief[0] == 401 and b"bad request signature" in as_thief[1]
