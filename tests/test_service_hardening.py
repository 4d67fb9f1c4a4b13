"""Issue 32 (service part), attacked over real sockets on 127.0.0.1:

1. registration is no membership oracle: every refused register (unknown id, held-out id, an id
   another key holds, a key the fleet registry does not list, a bad signature, a stale time, a
   replayed nonce, a session-MAC'd register, a header naming another id) gets ONE answer (same
   status, body bytes and headers but Date), after the same work (one Ed25519 verification and
   one lookup each), with medians of 1,000 timed tries per kind within noise; off loopback serve
   refuses to start without the fleet registry (checked before anything binds);
2. malformed, oversized and deeply nested JSON bodies are 400 / 413 on every JSON route, never a
   500 nor a logged traceback; a hypothesis fuzz over every route (methods, path parameters,
   queries, headers, bodies, valid signatures included) sees no 500 and a bounded answer time;
   an unexpected exception is a generic 500 JSON without the traceback;
3. an upload above the clip norm by any amount is refused, an honestly clipped one never;
4. the state directory is 0700 and every file in it 0600 after a real serve;
5. `service serve` refuses dp.noise_seed with one error line (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import random
import stat
import statistics
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_fleet import checkin_all, close_all, device_keys, register_all, run_devices, tiny_cfg

import dpfleet.io as dpfleet_io
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.edge.clipping import clip_l2, norm64
from dpfleet.edge.wire import auth as wire_auth
from dpfleet.edge.wire.auth import mac_request, sign_request
from dpfleet.errors import DpfleetError
from dpfleet.service import auth
from dpfleet.service.server import check_exposure, private_state, shutdown, start
from dpfleet.service.uploads import UploadError, parse_update

SECRET = {"noise_seed": -1}  # what `service serve` accepts (secret noise)


# ---------------------------------------------------------------------------- a served coordinator

class Served:
    """A real coordinator on 127.0.0.1 in its own thread and event loop, spoken to with blocking
    http.client requests (so hypothesis and the timing loop run plain code)."""

    def __init__(self, cfg, state: Path, registry=None, poll_s: float = 0.5):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.lines: list[str] = []
        self.running = self.call(start(cfg, state, registry=registry, poll_s=poll_s,
                                       log=self.lines.append), 180)
        self.url = self.running.url
        self.port = int(self.url.rsplit(":", 1)[1])
        self.state = state

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def request(self, method: str, path_qs: str, body: bytes = b"", headers=None, conn=None):
        """(status, body bytes, headers as a list of pairs, seconds)."""
        own = conn is None
        conn = conn or self.connect()
        try:
            began = time.perf_counter()
            conn.request(method, path_qs, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, data, resp.getheaders(), time.perf_counter() - began
        finally:
            if own:
                conn.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.running.driver.stop()
            self.call(shutdown(self.running), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(cfg, root, train ids, held-out ids): the tiny run with secret noise and fast limits."""
    root = tmp_path_factory.mktemp("hardening")
    cfg = tiny_cfg(rounds=1, dp=SECRET, service={"overselect": 0.3, "rate_per_s": 1e6,
                                                 "rate_burst": 1_000_000, "max_body_mb": 0.25})
    _, data = prepare_data(cfg, root / "fleet" / "vocabulary")
    return cfg, root, [c.user for c in data.train], [c.user for c in data.test]


def register_request(device_id: str, key: Ed25519PrivateKey, *, body_key=None, sign_as=None):
    """(body, headers) of POST /v1/register for `device_id` with `body_key`'s public key (the
    signer's by default), signed by `key` under the header id `sign_as` (default device_id)."""
    pub = (body_key or key).public_key().public_bytes_raw()
    body = json.dumps({"device_id": device_id, "public_key": pub.hex()}).encode()
    headers = sign_request(key, sign_as or device_id, "POST", "/v1/register", body)
    headers["Content-Type"] = "application/json"
    return body, headers


def corrupt(headers: dict) -> dict:
    sig = headers["X-Dpfleet-Signature"]
    return {**headers, "X-Dpfleet-Signature": ("0" if sig[0] != "0" else "1") + sig[1:]}


def refusal_kinds(users, held_out, registry_mode: bool, claimed_by_other: str | None):
    """kind -> a function that builds one fresh refused register (body, headers)."""
    free = users[-1]  # never registered in these tests

    def unknown():
        return register_request(f"nobody-{random.getrandbits(64):x}", Ed25519PrivateKey.generate())

    def held():
        return register_request(random.choice(held_out), Ed25519PrivateKey.generate())

    def bad_signature():
        body, headers = register_request(free, Ed25519PrivateKey.generate())
        return body, corrupt(headers)

    kinds = {"unknown_id": unknown, "held_out_id": held, "bad_signature": bad_signature}
    if registry_mode:  # a train id, a key the registry does not list
        kinds["not_in_registry"] = lambda: register_request(free, Ed25519PrivateKey.generate())
    else:  # a train id another key holds
        kinds["claimed_id"] = lambda: register_request(claimed_by_other,
                                                       Ed25519PrivateKey.generate())
    return kinds


def without_date(headers) -> list:
    return sorted((k, v) for k, v in headers if k.lower() != "date")


# ---------------------------------------------------------------------------- 1. registration

@pytest.mark.parametrize("registry_mode", [False, True], ids=["open", "registry"])
def test_every_refused_registration_is_one_identical_answer(world, registry_mode):
    cfg, root, users, held_out = world
    keys = device_keys(users[:2])
    registry = {u: k.public_key().public_bytes_raw()  # the two honest devices' keys, and others
                for u, k in {**device_keys(users[2:-1]), **keys}.items()}
    served = Served(cfg, root / f"one-answer-{registry_mode}", registry if registry_mode else None)
    try:
        for u, k in keys.items():  # two devices registered honestly
            body, headers = register_request(u, k)
            assert served.request("POST", "/v1/register", body, headers)[0] == 200
        kinds = refusal_kinds(users, held_out, registry_mode, users[0])
        cases = {kind: make() for kind, make in kinds.items()}
        # and the refusals that do not depend on who asks
        body, headers = register_request(users[-1], Ed25519PrivateKey.generate())
        cases["stale_time"] = (body, sign_request(Ed25519PrivateKey.generate(), users[-1], "POST",
                                                  "/v1/register", body, now=time.time() - 1e4))
        honest_body, honest_headers = register_request(users[0], keys[users[0]])
        assert served.request("POST", "/v1/register", honest_body, honest_headers)[0] == 200
        cases["replayed_nonce"] = (honest_body, honest_headers)  # idempotent re-register, replayed
        cases["header_names_another_id"] = register_request(users[-1], keys[users[1]],
                                                            sign_as=users[1])
        session_key, sid = os.urandom(32), "ab" * 16
        cases["session_mac"] = (body, mac_request(session_key, sid, users[-1], "POST",
                                                  "/v1/register", body))
        cases["no_auth_headers"] = (body, {})
        answers = {kind: served.request("POST", "/v1/register", b, h)
                   for kind, (b, h) in cases.items()}
        bound = dict(served.running.driver.keys)
    finally:
        served.close()
    reference = answers["unknown_id"]
    assert reference[0] == 403
    assert reference[1] == b'{"error": "registration refused", "code": "registration_refused"}'
    for kind, (status, data, headers, _) in answers.items():
        assert (status, data, without_date(headers)) == (
            reference[0], reference[1], without_date(reference[2])), kind
    # nothing was bound by a refused register
    assert bound == {u: k.public_key().public_bytes_raw() for u, k in keys.items()}


@pytest.mark.slow  # ~15 s: 1,000 timed tries of each kind
def test_refused_registrations_take_the_same_time(world):
    """1,000 tries of each refusal kind, interleaved at random over one keep-alive connection:
    the medians of all kinds differ by less than 5% of the overall median (or 25 us; skipping
    the Ed25519 verification on one path would be ~15%), and a permutation test of the two
    id-only kinds (unknown, held-out, claimed / not in the registry) furthest apart finds no
    difference (p > 1e-4). (A bad signature is the requester's own doing, not the id's: it is
    held to the 5% bound; its p-value is printed.) Also the work is the same, counted: one
    Ed25519 verification per refused register, whatever the kind."""
    cfg, root, users, held_out = world
    results = {}
    verifications = []
    original = auth._signature_ok

    def counting(*a):
        verifications.append(1)
        return original(*a)

    for registry_mode in (False, True):
        claimer = Ed25519PrivateKey.generate()
        registry = {users[0]: claimer.public_key().public_bytes_raw()} if registry_mode else None
        served = Served(cfg, root / f"timing-{registry_mode}", registry)
        mode = "registry" if registry_mode else "open"
        try:
            body, headers = register_request(users[0], claimer)
            assert served.request("POST", "/v1/register", body, headers)[0] == 200
            kinds = refusal_kinds(users, held_out, registry_mode, users[0])
            conn = served.connect()
            for kind in list(kinds) * 50:  # warm-up (not counted)
                served.request("POST", "/v1/register", *kinds[kind](), conn=conn)
            # up to 3 measurements: another process's load can push one kind's median past the
            # bound now and then (3 xdist workers on 2 cores: 5.5%, p 0.015); a leak in the
            # service shows in every measurement, so the best of three must pass
            for attempt in range(3):
                random.seed(7 + attempt)
                order = [kind for kind in kinds for _ in range(1000)]
                random.shuffle(order)
                times = {kind: [] for kind in kinds}
                fresh = [(kind, *kinds[kind]()) for kind in order]  # signed before the clock runs
                auth._signature_ok = counting
                try:
                    for kind, body, headers in fresh:
                        status, _, _, seconds = served.request("POST", "/v1/register", body,
                                                               headers, conn=conn)
                        assert status == 403, kind
                        times[kind].append(seconds)
                finally:
                    auth._signature_ok = original
                assert len(verifications) == len(fresh)  # one verification per refusal, every kind
                verifications.clear()
                ok, results[f"{mode} #{attempt + 1}"] = timing_verdict(mode, times)
                if ok:
                    break
            conn.close()
        finally:
            served.close()
        assert ok, results


def timing_verdict(mode: str, times: dict[str, list[float]]) -> tuple[bool, tuple]:
    """(passes, summary) of one measurement: the medians of all kinds within 5% of the overall
    median (or 25 us), and the two id-only kinds furthest apart not told apart (p > 1e-4)."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    overall = statistics.median([t for v in times.values() for t in v])
    lo, hi = min(medians, key=medians.get), max(medians, key=medians.get)
    # the oracle's question (is this id a device of the run, claimed, in the registry?):
    # the kinds that differ only in the id, the two furthest apart
    ids = {k: m for k, m in medians.items() if k != "bad_signature"}
    a, b = min(ids, key=ids.get), max(ids, key=ids.get)
    p = permutation_p(times[a], times[b])
    print(f"{mode}: medians (us) { {k: round(m * 1e6, 1) for k, m in medians.items()} }, overall "
          f"{overall * 1e6:.1f} us, spread {(medians[hi] - medians[lo]) * 1e6:.1f} us; permutation p "
          f"({a} vs {b}) = {p:.4f}, ({lo} vs {hi}) = {permutation_p(times[lo], times[hi]):.4f}")
    ok = medians[hi] - medians[lo] < max(0.05 * overall, 25e-6) and p > 1e-4
    return ok, ({k: round(m * 1e6, 1) for k, m in medians.items()}, round(p, 4))


def permutation_p(a, b, rounds: int = 20_000, seed: int = 0) -> float:
    """Two-sided permutation p-value of the difference of medians of samples a and b (exact
    randomization inference here: the kinds were assigned to time slots at random)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    observed = abs(np.median(a) - np.median(b))
    pooled = np.concatenate([a, b])
    hits = 0
    for _ in range(rounds // 1000):
        shuffled = rng.permuted(np.broadcast_to(pooled, (1000, pooled.size)), axis=1)
        diff = np.abs(np.median(shuffled[:, :a.size], axis=1)
                      - np.median(shuffled[:, a.size:], axis=1))
        hits += int((diff >= observed).sum())
    return (hits + 1) / (rounds + 1)


@pytest.mark.parametrize("host, registry, refused", [
    ("0.0.0.0", None, True), ("192.0.2.10", None, True), ("::", None, True),
    ("2001:db8::1", None, True), ("192.0.2.10", {"d": b"k" * 32}, False),
    ("127.0.0.1", None, False), ("127.8.9.10", None, False), ("::1", None, False),
])
def test_off_loopback_registration_needs_the_fleet_registry(host, registry, refused):
    if refused:
        with pytest.raises(DpfleetError, match="off loopback .* --fleet-public"):
            check_exposure(host, registry)
    else:
        check_exposure(host, registry)


def test_serve_refuses_off_loopback_without_a_registry_before_anything_binds(world, tmp_path,
                                                                             capsys):
    """Through the CLI (one `error:` line, exit 2) and through `start` (before the state is
    written): no socket is ever bound off loopback here, the check comes first."""
    from test_service_security import self_signed

    from dpfleet.cli import main
    from dpfleet.coordinator.state.run_dir import to_toml

    cfg = world[0]
    umask = os.umask(0o077)
    os.umask(umask)
    cert, key = self_signed(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg.resolved()))
    with pytest.raises(SystemExit) as exit_:
        main(["service", "serve", str(config), "--state", str(tmp_path / "s"), "--listen",
              "192.0.2.10:8443", "--tls-cert", str(cert), "--tls-key", str(key)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: --listen 192.0.2.10: off loopback")
    assert err.count("\n") == 1 and "--fleet-public" in err
    assert not (tmp_path / "s").exists()
    with pytest.raises(DpfleetError, match="--fleet-public"):
        asyncio.run(start(cfg, tmp_path / "s2", listen="0.0.0.0:0", tls_cert=cert, tls_key=key,
                          log=lambda s: None))
    assert not (tmp_path / "s2").exists()
    assert os.umask(umask) == umask  # the refused start left the process umask alone


def test_loopback_serve_says_registration_is_open_in_one_line(world):
    cfg, root, users, _ = world
    served = Served(cfg, root / "open-line")
    registry = {users[0]: Ed25519PrivateKey.generate().public_key().public_bytes_raw()}
    closed = Served(cfg, root / "closed-line", registry)
    served.close()
    closed.close()
    open_lines = [s for s in served.lines if "registration is open" in s]
    assert len(open_lines) == 1 and "loopback" in open_lines[0] and "--fleet-public" in open_lines[0]
    assert not [s for s in closed.lines if "registration is open" in s]


# ---------------------------------------------------------------------------- 2. bodies, fuzz

class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def logged_errors():
    """The WARNING+ records and the records with a traceback that aiohttp and dpfleet log, at
    any level, from any thread, while the block runs (their loggers at DEBUG meanwhile)."""
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("aiohttp", "dpfleet")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    bad: list[logging.LogRecord] = []
    try:
        yield bad
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        bad += [r for r in handler.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.fixture(scope="module")
def open_round(world):
    """A served coordinator with every device registered and one plain round open (the first
    four devices to check in assigned), then paused (check-ins answer at once): (served, keys,
    assignment of the fuzzing device, model length)."""
    cfg, root, users, _ = world
    keys = device_keys(users)
    served = Served(cfg, root / "fuzz")

    async def setup():
        links = await register_all(served.url, keys, retries=0)
        try:
            replies = await checkin_all(dict(list(links.items())[:4]))
        finally:
            await close_all(links)
        return replies

    replies = asyncio.run(setup())
    jobs = {u: r for u, r in replies.items() if r["kind"] == "assignment"}
    assert len(jobs) == 4
    status = served.request("POST", "/v1/admin/pause", b"",
                            {"Authorization": f"Bearer {served.running.token}"})[0]
    assert status == 200
    device, reporter = list(jobs)[:2]  # the fuzzing device; the one of the over-the-wire report
    length = served.running.driver.current.plain.length
    yield served, keys, device, jobs[device], length, reporter
    served.close()


def signed(keys, device, method, path_qs, body, headers=None):
    return {**(headers or {}), **sign_request(keys[device], device, method, path_qs, body)}


def deep(n: int, kind: str = "[") -> bytes:
    closing = {"[": "]", "{": "}"}[kind]
    if kind == "{":
        return ('{"a":' * n + "1" + "}" * n).encode()
    return (kind * n + closing * n).encode()


def test_bad_json_bodies_are_400_or_413_never_500(open_round):
    served, keys, device, job, *_ = open_round
    limit = int(0.25 * 2**20)
    bodies = {
        "not_json": b"{\"a\":", "binary": os.urandom(64), "not_utf8": b"\xff\xfe\x00{",
        "nan": b'{"device_id": NaN}', "array": b"[1, 2]", "deep_list": deep(100_000),
        "deep_object": deep(30_000, "{"), "deep_but_fits": deep(30_000),
        "huge_number": b'{"a": ' + b"9" * 100_000 + b"}",
        "huge_string": b'{"a": "' + b"x" * (limit - 20) + b'"}',
    }
    results = {}
    with logged_errors() as errors:
        for path in ("/v1/register", "/v1/session", "/v1/checkin"):
            for name, body in bodies.items():
                status = served.request("POST", path, body, signed(keys, device, "POST", path,
                                                                   body))[0]
                unsigned = served.request("POST", path, body, {})[0]
                results[path, name] = (status, unsigned)
            too_big = b"[" * (limit + 1)
            results[path, "too_large"] = (served.request("POST", path, too_big, signed(
                keys, device, "POST", path, too_big))[0], None)
    expected = {}
    for (path, name), _ in results.items():
        if name == "too_large":
            expected[path, name] = (413, None)
        elif path == "/v1/register":  # proof of possession: the body names the key, parsed first
            expected[path, name] = (400, 400)
        else:  # authentication first: an unsigned body is never parsed
            expected[path, name] = (400, 401)
    assert results == expected
    assert not errors, [r.getMessage() for r in errors]


def test_attack_a_request_in_another_protocol_version_is_refused_in_one_line(open_round):
    """A message of another version is never read with this version's rules: 400 `bad_protocol`
    before authentication (so unsigned too), the same request in version 1 (or naming none, a
    client of before the header) is answered."""
    served, keys, device, job, *_ = open_round
    path, body = "/v1/checkin", json.dumps({"eligibility": {"charging": True, "idle": True,
                                                            "unmetered": True},
                                            "runtime": "eager", "timer_expires_at": None}).encode()
    for version in ("2", "0", "v1"):
        line = {"error": f"protocol version {version!r} is not spoken here: this coordinator "
                         "speaks version 1", "code": "bad_protocol"}
        for headers in (signed(keys, device, "POST", path, body), {}):
            status, data, *_ = served.request("POST", path, body,
                                              {**headers, "X-Dpfleet-Protocol": version})
            assert (status, json.loads(data)) == (400, line)
    for version in ({"X-Dpfleet-Protocol": "1"}, {}):
        status, data, *_ = served.request("POST", path, body,
                                          signed(keys, device, "POST", path, body, version))
        assert (status, json.loads(data)) == (200, job)  # a repeated check-in: its assignment


def test_an_unexpected_exception_is_a_generic_500_without_its_traceback(open_round):
    served, keys, device, job, *_ = open_round
    driver = served.running.driver
    path = f"/v1/rounds/{job['round']}/status?attempt={job['attempt']}"

    def boom(number, attempt):
        raise RuntimeError("secret internal detail")

    driver.round_status = boom
    try:
        with logged_errors() as errors:
            status, data, headers, _ = served.request("GET", path, b"",
                                                      signed(keys, device, "GET", path, b""))
    finally:
        del driver.round_status
    assert status == 500
    assert data == b'{"error": "internal error", "code": "internal"}'
    assert dict(headers)["Content-Type"].startswith("application/json")
    assert [r.getMessage() for r in errors] == [f"internal error on GET {path.split('?')[0]}"]
    events = [json.loads(line) for line in (served.state / "service.log").read_text().splitlines()]
    assert {"path": path.split("?")[0], "error": "RuntimeError"}.items() <= [
        e for e in events if e["event"] == "internal_error"][-1].items()


def test_over_the_wire_a_report_one_ulp_above_the_clip_norm_is_400(open_round):
    served, keys, _, job, length, device = open_round
    clip = served.running.driver.current.plain.clip_norm
    path = f"/v1/rounds/{job['round']}/report?attempt={job['attempt']}"
    base = np.random.default_rng(3).standard_normal(length).astype(np.float32)
    exact, _ = clip_l2(base, clip)
    over = exact.copy()
    i = int(np.argmax(np.abs(over)))
    while norm64(over) <= clip:
        over[i] = np.nextafter(over[i], np.float32(np.inf) * np.sign(over[i]))
    hdr = {"X-Dpfleet-Norm": "1.0", "X-Dpfleet-Loss": "1.0", "X-Dpfleet-Clipped": "1"}
    body = over.tobytes()
    status, data, _, _ = served.request("POST", path, body, signed(keys, device, "POST", path,
                                                                   body, hdr))
    assert status == 400 and b'"bad_report"' in data and b"exceeds" in data
    plain = served.running.driver.current.plain
    assert job["position"] not in plain.updates  # refused: never summed


ROUTES = [("POST", "/v1/register"), ("POST", "/v1/session"), ("POST", "/v1/checkin"),
          ("GET", "/v1/blobs/{sha}"), ("POST", "/v1/rounds/{round}/report"),
          ("POST", "/v1/rounds/{round}/secagg"), ("GET", "/v1/rounds/{round}/secagg"),
          ("GET", "/v1/rounds/{round}/status"), ("GET", "/v1/admin/status"),
          ("GET", "/v1/admin/history"), ("POST", "/v1/admin/pause"), ("POST", "/v1/admin/resume"),
          ("GET", "/v1/admin/report"), ("GET", "/v1/public/status"), ("GET", "/"),
          ("GET", "/{anything}")]
TEXT = st.text(max_size=30)
HEADER_VALUE = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c not in b"\r\n\0"))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.text(max_size=8), inner, max_size=4), max_leaves=20)


def checkin_like(draw):
    return {"eligibility": draw(st.dictionaries(st.sampled_from(["charging", "idle", "unmetered",
                                                                 "x"]), JSON, max_size=4)),
            "runtime": draw(st.sampled_from(["eager", "onnx", "executorch", "", "x"]) | JSON),
            "timer_expires_at": draw(JSON)}


@st.composite
def fuzz_request(draw, job, length, device):
    method, template = draw(st.sampled_from(ROUTES))
    method = draw(st.sampled_from([method, method, "GET", "POST", "PUT", "DELETE", "PATCH",
                                   "OPTIONS", "HEAD"]))
    good_round = str(job["round"])
    params = {
        "round": draw(st.sampled_from([good_round, "0", "-1", "9" * 30, "x"])
                      | TEXT.map(urllib.parse.quote)),
        "sha": draw(st.sampled_from([job["model_sha256"], job["plan_sha256"], "0" * 64])
                    | TEXT.map(urllib.parse.quote)),
        "anything": draw(TEXT.map(lambda t: urllib.parse.quote(t, safe=""))),
    }
    path = template.format(**params)
    query = {}
    if draw(st.booleans()):
        query["attempt"] = draw(st.sampled_from([str(job["attempt"]), "-5", "1e9"]) | TEXT)
    if draw(st.booleans()):
        query["after"] = draw(st.sampled_from(["0", "-1", "99999999999"]) | TEXT)
    path_qs = path + ("?" + urllib.parse.urlencode(query) if query else "")
    body_kind = draw(st.sampled_from(["empty", "bytes", "json", "checkin", "deep", "floats",
                                      "huge"]))
    if body_kind == "empty":
        body = b""
    elif body_kind == "bytes":
        body = draw(st.binary(max_size=300))
    elif body_kind == "json":
        body = json.dumps(draw(JSON)).encode()
    elif body_kind == "checkin":
        body = json.dumps(checkin_like(draw)).encode()
    elif body_kind == "deep":
        body = deep(draw(st.integers(1, 200_000)), draw(st.sampled_from(["[", "{"])))
    elif body_kind == "floats":  # the model's length (or off by one) of random float32 values
        n = length + draw(st.sampled_from([0, 0, -1, 1]))
        scale = draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0, 1e30]))
        body = (np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(n)
                * scale).astype("<f4").tobytes()
    else:
        body = b"x" * int(0.25 * 2**20 + draw(st.integers(1, 2**18)))
    auth_kind = draw(st.sampled_from(["none", "signed", "signed", "garbage", "admin",
                                      "bad_admin"]))
    headers = {}
    if auth_kind == "signed":
        headers = sign_request(KEYS[device], device, method, path_qs, body)
    elif auth_kind == "garbage":
        for h in (wire_auth.H_DEVICE, wire_auth.H_TIME, wire_auth.H_NONCE, wire_auth.H_SIG,
                  wire_auth.H_SESSION, wire_auth.H_MAC):
            if draw(st.booleans()):
                headers[h] = draw(HEADER_VALUE)
    elif auth_kind == "admin":
        headers["Authorization"] = "Bearer " + TOKEN[0]
    elif auth_kind == "bad_admin":
        headers["Authorization"] = draw(HEADER_VALUE)
    for h in ("X-Dpfleet-Norm", "X-Dpfleet-Loss", "X-Dpfleet-Clipped", "Content-Type"):
        if draw(st.booleans()):
            headers[h] = draw(HEADER_VALUE)
    if method == "POST" and path in ("/v1/admin/pause", "/v1/admin/resume") and \
            auth_kind == "admin":
        headers["Authorization"] = "Bearer wrong"  # the run stays paused (check-ins answer at once)
    return method, path_qs, body, headers


KEYS: dict = {}
TOKEN: list = [""]
MAX_SECONDS = 5.0  # the longest answer: a GET secagg long-poll is poll_s = 0.5 s


def test_fuzz_every_route_no_500_and_bounded_time(open_round):
    served, keys, device, job, length, _ = open_round
    KEYS.update(keys)
    TOKEN[0] = served.running.token
    seen: dict[int, int] = {}
    slowest = [0.0]

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(req=fuzz_request(job, length, device))
    def one(req):
        method, path_qs, body, headers = req
        try:
            status, data, _, seconds = served.request(method, path_qs, body, headers)
        except (ConnectionResetError, BrokenPipeError):
            # only an oversized body may be cut off (the server answers 413 and closes)
            assert len(body) > 0.25 * 2**20, (method, path_qs)
            return
        seen[status] = seen.get(status, 0) + 1
        slowest[0] = max(slowest[0], seconds)
        assert status != 500 and status < 600, (method, path_qs, body[:80], headers, data)
        assert b"Traceback" not in data
        assert seconds < MAX_SECONDS, (method, path_qs, seconds)

    def internal_errors() -> int:
        return (served.state / "service.log").read_text().count('"internal_error"')

    before = internal_errors()
    with logged_errors() as errors:
        one()
    print(f"fuzz statuses {dict(sorted(seen.items()))}, slowest {slowest[0]:.3f} s")
    assert not errors, [r.getMessage() for r in errors]
    assert internal_errors() == before
    assert {400, 401, 404}.issubset(seen)  # the fuzz got past routing and authentication


# ---------------------------------------------------------------------------- 3. the clip norm

def test_an_upload_above_the_clip_norm_by_any_amount_is_refused():
    clip = 0.5
    base = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    exact, _ = clip_l2(base * np.float32(100), clip)
    assert norm64(exact) <= clip
    parse_update(exact.tobytes(), exact.size, clip)  # the honest clip: accepted
    refused = 0
    for factor in (1 + 1e-7, 1 + 2**-23, 1 + 1e-6, 1 + 1e-4 / 2, 1 + 1e-4, 1.001):
        over = (exact.astype(np.float64) * (clip * factor / norm64(exact))).astype(np.float32)
        while norm64(over) <= clip:  # float32 rounding: move it out until it is really above
            over = np.nextafter(over, np.float32(np.inf) * np.sign(over))
        assert clip < norm64(over) <= clip * (1 + 2 * factor - 2 + 1e-6)
        with pytest.raises(UploadError, match="exceeds the round's clip norm"):
            parse_update(over.tobytes(), over.size, clip)
        refused += 1
    # the smallest step there is: one coordinate one float32 ulp away from zero
    nudged = exact.copy()
    i = int(np.argmax(np.abs(nudged)))
    while norm64(nudged) <= clip:
        nudged[i] = np.nextafter(nudged[i], np.float32(np.inf) * np.sign(nudged[i]))
    assert norm64(nudged) - clip < 1e-7
    with pytest.raises(UploadError):
        parse_update(nudged.tobytes(), nudged.size, clip)
    assert refused == 6


@settings(max_examples=300, deadline=None)
@given(dim=st.integers(1, 5000), scale=st.floats(1e-6, 1e6), clip=st.floats(1e-3, 1e3),
       seed=st.integers(0, 2**32 - 1), dist=st.sampled_from(["normal", "uniform", "one_hot"]))
def test_an_honestly_clipped_update_is_always_accepted(dim, scale, clip, seed, dist):
    rng = np.random.default_rng(seed)
    if dist == "normal":
        raw = rng.standard_normal(dim)
    elif dist == "uniform":
        raw = rng.uniform(-1, 1, dim)
    else:
        raw = np.zeros(dim)
        raw[rng.integers(dim)] = 1.0
    delta = (raw * scale).astype(np.float32)
    clipped, _ = clip_l2(delta, clip)
    np.testing.assert_array_equal(parse_update(clipped.tobytes(), dim, clip), clipped)


# ---------------------------------------------------------------------------- 4. file modes

def test_state_is_0700_and_every_file_0600_after_a_real_serve(tmp_path):
    cfg = tiny_cfg(rounds=1, dp=SECRET)
    from service_fleet import fleet_data

    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = device_keys(users)
    state = tmp_path / "state"
    previous = os.umask(0o022)  # a usual login umask: files 0644 unless serve changes it

    def modes():
        out = {}
        for root, dirs, files in os.walk(state):
            for name in dirs + files:
                path = Path(root, name)
                out[str(path.relative_to(state))] = stat.S_IMODE(path.lstat().st_mode)
        return out

    async def main():
        running = await start(cfg, state, log=lambda s: None)
        try:
            await run_devices(running.url, keys, examples)
            await asyncio.wait_for(asyncio.shield(running.task), 60)
            during = modes()  # the store is still open: its -wal and -shm exist
        finally:
            await shutdown(running)
        return during

    try:
        during = asyncio.run(main())
        umask_after = os.umask(0o022)
    finally:
        os.umask(previous)
    after = modes()

    # shutdown put the process umask back (unless another coordinator of this process serves)
    assert umask_after == (0o077 if dpfleet_io._umask_holders["count"] else 0o022)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in ("state.sqlite", "state.sqlite-wal", "state.sqlite-shm", "service.log",
                 "metrics.jsonl"):
        assert name in during, sorted(during)
    for listing in (during, after):
        for name, mode in listing.items():
            is_dir = (state / name).is_dir()
            assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))
    print(f"{len(during)} paths in STATE during the serve, {len(after)} after: all 0600 / 0700")


def test_private_state_fixes_what_an_older_process_left(tmp_path):
    state = tmp_path / "old"
    (state / "sub").mkdir(parents=True)
    for name in ("state.sqlite", "round.pending", "sub/x.npy"):
        (state / name).write_bytes(b"x")
        (state / name).chmod(0o644)
    state.chmod(0o755)
    (state / "sub").chmod(0o755)
    private_state(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "sub").stat().st_mode) == 0o700
    for name in ("state.sqlite", "round.pending", "sub/x.npy"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600


# ---------------------------------------------------------------------------- 5. noise_seed

def test_serve_refuses_a_noise_seed_in_one_line(tmp_path, capsys):
    from dpfleet.cli import main
    from dpfleet.coordinator.state.run_dir import to_toml

    config = tmp_path / "seeded.toml"
    config.write_text(to_toml(tiny_cfg(rounds=1, dp={"noise_seed": 11}).resolved()))
    with pytest.raises(SystemExit) as exit_:
        main(["service", "serve", str(config), "--state", str(tmp_path / "state")])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == ""
    assert captured.err.startswith("error: dp.noise_seed = 11 is research mode")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert not (tmp_path / "state").exists()


def test_attack_a_noise_seed_slipped_in_by_set_is_refused_like_one_in_the_file(tmp_path, capsys):
    """`--set dp.noise_seed=...` on a secret-noise config: the override is applied before the
    research-mode check, so it cannot give the fleet noise whose seed the operator knows."""
    from dpfleet.cli import main
    from dpfleet.coordinator.state.run_dir import to_toml

    config = tmp_path / "secret.toml"
    config.write_text(to_toml(tiny_cfg(rounds=1).resolved()))
    with pytest.raises(SystemExit) as exit_:
        main(["service", "serve", str(config), "--state", str(tmp_path / "state"),
              "--set", "dp.noise_seed=11"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "error: dp.noise_seed = 11 is research mode" in err and "Traceback" not in err
    assert not (tmp_path / "state").exists()
