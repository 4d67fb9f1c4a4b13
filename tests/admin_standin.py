"""A stand-in for the coordinator's admin API in tests of the operator CLI and the status page.

It stands in for the `service` branch's coordinator (`dpfleet service serve`): a real aiohttp
server on a real loopback socket (port 0, optional TLS with a self-signed certificate made with
`cryptography`) that serves protocol.md-shaped JSON and checks the bearer token, but runs no
rounds. The CLI under test talks to it exactly as it talks to the real one.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import secrets
import ssl
import threading
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dpfleet.service.status_page import add_status_routes

# device ids the stand-in knows; the page and the public status must never show them
DEVICE_IDS = ("THE_TRAGEDY_OF_KING_LEAR_KENT", "HAMLET_OPHELIA_x7", "uid-5f2c9e81")


def sample_status() -> dict:
    return {
        "run_state": "running", "round": 8, "phase": "secagg_shares",
        "rounds_committed": 7, "rounds_failed": 1, "rounds_planned": 20,
        "epsilon": 2.718, "delta": 1e-6, "last_accuracy": 0.1044,
        "devices": {"registered": 1000, "waiting": 412, "training": 100, "refused_timer": 37},
        "phase_seconds": {"select": 0.12, "secagg_keys": 1.5, "secagg_shares": 0.8,
                          "secagg_masked": 3.25, "secagg_unmask": 0.4},
        "started_at": 1_700_000_000.0, "uptime_s": 3725.0,
    }


def sample_history() -> dict:
    rounds = []
    for r in range(1, 9):
        failed = r == 5
        rounds.append({"round": r, "status": "failed" if failed else "committed",
                       "clients": 0 if failed else 100,
                       "epsilon": round(2.718 * r / 8, 4),
                       "accuracy": None if failed else round(0.03 + 0.0093 * r, 4),
                       "loss": None if failed else 5.0 - 0.1 * r, "wall_s": 4.2 + r / 10})
    return {"rounds": rounds,
            "participation_histogram": {"0": 380, "1": 450, "2": 150, "3": 20},
            "device_states": {"waiting": 412, "training": 100, "refused_timer": 37,
                              "offline": 451}}


def make_cert(folder: Path, name: str = "coordinator") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, PEM files in `folder`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class StandInCoordinator:
    """Serves the admin API in a background thread; `.url`, `.token`, `.status`, `.calls`."""

    def __init__(self, tls: tuple[Path, Path] | None = None, delay_s: float = 0.0):
        self.token = secrets.token_hex(32)
        self.status = sample_status()
        self.history = sample_history()
        self.report = "# Privacy report\n\neps = 2.718 at delta = 1e-06\n"
        self.calls: list[tuple[str, str]] = []
        self.delay_s = delay_s
        self.busy = 0  # answer this many admin calls 503 + Retry-After (committing a round)
        self.tls = tls
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _app(self) -> web.Application:
        app = web.Application()

        def authorized(request: web.Request) -> bool:
            return secrets.compare_digest(request.headers.get("Authorization", ""),
                                          f"Bearer {self.token}")

        def admin(handler):
            async def wrapped(request: web.Request) -> web.StreamResponse:
                self.calls.append((request.method, request.path))
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if not authorized(request):
                    return web.json_response({"error": "admin token required", "code": "unauthorized"},
                                             status=401)
                if self.busy:
                    self.busy -= 1
                    return web.json_response({"error": "a round is being committed", "code": "committing"},
                                             status=503, headers={"Retry-After": "0.2"})
                return handler()
            return wrapped

        def transition(new_state: str):
            def handler() -> web.Response:
                if self.status["run_state"] == "finished":
                    return web.json_response({"error": "the run has finished", "code": "finished"},
                                             status=409)
                self.status["run_state"] = new_state
                return web.json_response(self.status)
            return handler

        app.router.add_get("/v1/admin/status", admin(lambda: web.json_response(self.status)))
        app.router.add_get("/v1/admin/history", admin(lambda: web.json_response(self.history)))
        app.router.add_post("/v1/admin/pause", admin(transition("paused")))
        app.router.add_post("/v1/admin/resume", admin(transition("running")))
        app.router.add_post("/v1/admin/stop", admin(transition("stopping")))
        app.router.add_get("/v1/admin/report", admin(lambda: web.Response(text=self.report)))
        add_status_routes(app, lambda: self.status, lambda: self.history)
        return app

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(self._app())
        self._loop.run_until_complete(runner.setup())
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self.tls)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        self._loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        self.url = f"{'https' if ctx else 'http'}://127.0.0.1:{port}"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> StandInCoordinator:
        self._thread.start()
        assert self._ready.wait(10), "stand-in coordinator did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def write_admin_json(self, state: Path, pid: int = 12345, tls_cert: str | None = None) -> Path:
        state.mkdir(parents=True, exist_ok=True)
        path = state / "admin.json"
        path.write_text(json.dumps({"url": self.url, "token": self.token, "pid": pid,
                                    "tls_cert": tls_cert}))
        path.chmod(0o600)
        return path



def run(capsys, *args: str) -> tuple[int, str, str]:
    """`dpfleet service ARGS` in this process: (exit code, stdout, stderr)."""
    from dpfleet import cli

    code = 0
    try:
        cli.main(["service", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(stderr: str) -> str:
    """The one `error: ...` line a user mistake gives (no traceback, nothing else)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    return lines[0]
