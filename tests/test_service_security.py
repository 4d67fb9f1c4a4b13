"""Issue 12 item 7, attacked over real sockets (127.0.0.1): a replayed signed request is refused
and the sum is unchanged; NaN / wrong-length / over-norm uploads never reach the committed sum
(it equals, bit for bit, the sum of the honest reports); a device cannot speak as another one
nor read another one's data; admin and device credentials do not cross; bodies are bounded
(413), devices rate-limited (429 with Retry-After, which the link waits out); TLS with a
self-signed certificate works with the pinned CA and fails without it."""

import asyncio
import datetime
import ipaddress
import json

import aiohttp
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import (
    capture_sums,
    checkin_all,
    close_all,
    honest_sum,
    one_round_world,
    register_all,
    tiny_cfg,
)
from yarl import URL

from dpfleet.edge.wire.auth import sign_request
from dpfleet.fleet.link import CoordinatorLink, LinkError
from dpfleet.fleet.participant import train
from dpfleet.service.server import shutdown, start


class RecordingLink(CoordinatorLink):
    """A device link that keeps a copy of each signed request it sent (what an eavesdropper on
    a plain-HTTP hop would capture)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent = []

    async def request(self, method, path_qs, body=b"", *, signed=True, headers=None, **kw):
        if signed:
            hdrs = dict(headers or {})
            hdrs.update(sign_request(self.key, self.device_id, method, path_qs, body))
            self.sent.append((method, path_qs, body, hdrs))
            return await super().request(method, path_qs, body, signed=False, headers=hdrs, **kw)
        return await super().request(method, path_qs, body, signed=False, headers=headers, **kw)


async def raw(url, method, path_qs, body=b"", headers=None, ssl=None):
    async with aiohttp.ClientSession() as s, s.request(
            method, URL(url + path_qs, encoded=True), data=body or None, headers=headers or {},
            ssl=ssl if ssl is not None else True) as r:
        return r.status, await r.read(), dict(r.headers)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return one_round_world(tmp_path_factory.mktemp("security"))


def test_attacks_on_an_open_plain_round_never_change_the_sum(world):
    cfg, root, users, examples = world
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, root / "state", log=lambda s: None)
        sums = capture_sums(running.driver.engine)
        links = await register_all(running.url, keys, RecordingLink, retries=0)
        try:
            replies = await checkin_all(links)
            assigned = sorted((r["position"], u) for u, r in replies.items()
                              if r["kind"] == "assignment")
            assert len(assigned) == 4  # goal 3 + 1 over-selected
            (_, evil), *honest = assigned
            outsider = next(u for u in users if replies[u]["kind"] != "assignment")
            job = replies[evil]
            path = f"/v1/rounds/{job['round']}/report?attempt={job['attempt']}"
            url = running.url
            plan, good, _ = await train(links[evil], job, examples[evil])
            n = good.delta.size
            bad_uploads = {
                "nan": np.where(np.arange(n) == 7, np.nan, good.delta).astype("<f4").tobytes(),
                "inf": np.full(n, np.inf, "<f4").tobytes(),
                "short": good.delta[:-1].astype("<f4").tobytes(),
                "float64": good.delta.astype("<f8").tobytes(),
                "over_norm": (good.delta / np.linalg.norm(good.delta) * plan["clip_norm"] * 1.01
                              ).astype("<f4").tobytes(),
            }
            answers = {}
            for name, body in bad_uploads.items():
                hdrs = sign_request(keys[evil], evil, "POST", path, body)
                answers[name] = (await raw(url, "POST", path, body, hdrs))[0]
            assert answers == dict.fromkeys(bad_uploads, 400)
            # posting as another device: A's key, B's name
            _, victim = honest[0]
            body = np.zeros(n, "<f4").tobytes()
            forged = sign_request(keys[evil], victim, "POST", path, body)
            status, text, _ = await raw(url, "POST", path, body, forged)
            assert status == 401 and b"bad request signature" in text
            # a device that is not in the round cannot report into it
            with pytest.raises(LinkError) as exc:
                await links[outsider].report(job["round"], job["attempt"], np.zeros(n, "<f4"),
                                             norm=0.0, clipped=False, loss=0.0)
            assert exc.value.status == 409
            # honest reports; then replay one of them (captured signed request, byte for byte)
            updates = {}
            for _, u in honest:
                _, upd, _ = await train(links[u], replies[u], examples[u])
                updates[u] = upd
                await links[u].report(job["round"], job["attempt"], upd.delta, norm=upd.norm,
                                      clipped=upd.clipped, loss=upd.loss)
            method, p, b, h = links[honest[0][1]].sent[-1]
            replay = await raw(url, method, p, b, h)
            await asyncio.wait_for(asyncio.shield(running.task), 60)
            return sums, updates, honest, replay, good
        finally:
            await close_all(links)
            await shutdown(running)

    sums, updates, honest, replay, evil_update = asyncio.run(main())
    assert replay[0] == 401 and b"replayed" in replay[1]
    [(plan, agg)] = sums
    expected = honest_sum(agg.total, updates, honest)
    np.testing.assert_array_equal(agg.total, expected)  # bit for bit: nothing else got in
    assert len(agg.survivors) == 3
    # and the refused device's update would have moved the sum by a lot
    assert np.linalg.norm(evil_update.delta) > 0.1 * np.linalg.norm(expected)


def test_credentials_do_not_cross_and_no_device_reads_another_devices_data(world):
    cfg, root, users, examples = world
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    cfg2 = tiny_cfg(rounds=1, service={"overselect": 0.3})

    async def main():
        running = await start(cfg2, root / "state-cred", log=lambda s: None)
        url, token = running.url, running.token
        links = await register_all(url, keys, retries=0)
        try:
            admin = {"Authorization": f"Bearer {token}"}
            ok = (await raw(url, "GET", "/v1/admin/status", headers=admin))[0]
            signed = sign_request(keys[users[0]], users[0], "GET", "/v1/admin/status", b"")
            as_device = (await raw(url, "GET", "/v1/admin/status", headers=signed))[0]
            body = json.dumps({"eligibility": {"charging": True, "idle": True, "unmetered": True},
                               "runtime": "eager", "timer_expires_at": None}).encode()
            with_token = (await raw(url, "POST", "/v1/checkin", body, admin))[0]
            wrong = (await raw(url, "GET", "/v1/admin/status",
                               headers={"Authorization": "Bearer " + token[:-2] + "xx"}))[0]
            # re-registering someone else's id with another key is refused
            thief = Ed25519PrivateKey.generate()
            with pytest.raises(LinkError) as exc:
                await CoordinatorLink(url, users[1], thief, retries=0).register()
            replies = await checkin_all(links)
            job = next(r for r in replies.values() if r["kind"] == "assignment")
            public = json.loads((await raw(url, "GET", "/v1/public/status"))[1])
            return ok, as_device, with_token, wrong, exc.value.status, replies, job, public
        finally:
            await close_all(links)
            running.driver.stop()
            await shutdown(running)

    ok, as_device, with_token, wrong, takeover, replies, job, public = asyncio.run(main())
    assert (ok, as_device, with_token, wrong, takeover) == (200, 401, 401, 401, 403)
    for reply in replies.values():  # a plain assignment names no other device, no one's data
        if reply["kind"] == "assignment":
            assert set(reply) == {"kind", "round", "attempt", "position", "model_sha256",
                                  "plan_sha256", "client_seed", "aggregation", "secagg",
                                  "deadlines", "time_scale"}
    assert not any(u in json.dumps(public) for u in users)  # the public page names no device


def self_signed(folder):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return folder / "cert.pem", folder / "key.pem"


def test_tls_limits_and_rate_limits(world, tmp_path):
    cfg, root, users, examples = world
    cert, key = self_signed(tmp_path)
    limited = tiny_cfg(rounds=1, service={"max_body_mb": 0.01, "rate_per_s": 2.0, "rate_burst": 2})
    device, dkey = users[0], Ed25519PrivateKey.generate()

    async def main():
        running = await start(limited, tmp_path / "state", log=lambda s: None, tls_cert=cert,
                              tls_key=key)
        url = running.url
        assert url.startswith("https://127.0.0.1:")
        try:
            untrusted = CoordinatorLink(url, device, dkey, retries=0)
            with pytest.raises(LinkError) as no_ca:
                await untrusted.register()
            await untrusted.close()
            async with CoordinatorLink(url, device, dkey, ca_file=cert, retries=0) as link:
                await link.register()
                body = b"\0" * (64 * 1024)
                hdrs = sign_request(dkey, device, "POST", "/v1/rounds/1/report?attempt=1", body)
                import ssl

                ctx = ssl.create_default_context(cafile=str(cert))
                too_big = (await raw(url, "POST", "/v1/rounds/1/report?attempt=1", body, hdrs,
                                     ssl=ctx))[0]
                statuses = []
                for _ in range(4):
                    try:
                        await link.round_status(1, 1)
                        statuses.append(200)
                    except LinkError as exc:
                        statuses.append(exc.status)
            async with CoordinatorLink(url, device, dkey, ca_file=cert, retries=6,
                                       backoff_s=0.05) as patient:
                for _ in range(4):  # waits out Retry-After instead of failing
                    try:
                        await patient.round_status(1, 1)
                    except LinkError as exc:
                        assert exc.status != 429
                retried = patient.retried
            return no_ca.value, too_big, statuses, retried
        finally:
            running.driver.stop()
            await shutdown(running)

    no_ca, too_big, statuses, retried = asyncio.run(main())
    assert no_ca.status == 0 and "unreachable" in no_ca.code  # the TLS handshake failed
    assert too_big == 413
    assert 429 in statuses
    assert retried >= 1


def test_a_signed_request_captured_before_a_restart_is_refused_after_it(world):
    """A restarted coordinator has an empty nonce cache: a signed check-in an eavesdropper
    captured just before the restart (still inside the clock window) must not pass as new."""
    cfg, root, users, _ = world
    cfg = tiny_cfg(rounds=2)
    u = users[0]
    keys = {u: Ed25519PrivateKey.generate()}
    state = root / "replay_restart_state"
    body = json.dumps({"eligibility": {"charging": True, "idle": True, "unmetered": True},
                       "runtime": "eager", "timer_expires_at": None}).encode()

    async def main():
        running = await start(cfg, state, log=lambda s: None)
        links = await register_all(running.url, keys, retries=0)
        try:
            captured = sign_request(keys[u], u, "POST", "/v1/checkin", body)
            honest = await raw(running.url, "POST", "/v1/checkin", body, captured)
            await shutdown(running)
            running = await start(cfg, state, log=lambda s: None)
            replay = await raw(running.url, "POST", "/v1/checkin", body, captured)
            return honest, replay, running.driver.device_counts()["waiting"]
        finally:
            await close_all(links)
            await shutdown(running)

    honest, replay, waiting = asyncio.run(main())
    assert honest[0] == 200  # the captured request was a valid one
    assert replay[0] == 401 and b"before this coordinator process started" in replay[1]
    assert waiting == 0  # the replayed check-in put nobody in the restarted pool
