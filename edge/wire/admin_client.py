"""The operator's side of the coordinator's admin API (`/v1/admin/*`, bearer token, optional TLS).

An operator reaches a coordinator either through the `STATE/admin.json` that `serve` wrote
(url, token, pid, tls_cert; mode 0600) or with an explicit URL and token file. Every way this
can go wrong (no admin.json, nothing listening, a wrong token, a certificate that does not
verify, no answer in time) becomes one `DpfleetError` line that says what to do, because the
person reading it is operating a live run and needs the cause, not a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from dpfleet.edge.wire.protocol import ADMIN, ADMIN_FILE
from dpfleet.errors import DpfleetError

# the fields of GET /v1/admin/status that the CLI relies on (PROTOCOL.md, admin API)
STATUS_FIELDS = ("run_state", "round", "phase", "rounds_committed", "rounds_failed",
                 "rounds_planned", "epsilon", "delta", "devices")


@dataclass(frozen=True)
class AdminTarget:
    """Where a coordinator's admin API is and how to prove we may use it."""

    url: str
    token: str
    tls_cert: Path | None = None
    pid: int | None = None
    admin_file: Path | None = None  # the admin.json it came from (for error messages)


def _check_url(url: str, where: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DpfleetError(f"{where}: expected a URL like http://127.0.0.1:8765, got {url!r}")
    return url.rstrip("/")


def _check_cert(path: Path, where: str) -> Path:
    if not path.is_file():
        raise DpfleetError(f"{where}: TLS certificate {path} not found")
    return path


def target_from_state(state: Path) -> AdminTarget:
    """The coordinator that `serve --state STATE` runs (it wrote STATE/admin.json)."""
    state = Path(state)
    path = state / ADMIN_FILE
    if not path.is_file():
        why = "does not exist" if not state.exists() else f"has no {ADMIN_FILE}"
        raise DpfleetError(
            f"state directory {state} {why}: no coordinator is running there "
            f"(`dpfleet service serve CONFIG --state {state}` writes it while it runs); "
            "or give --url and --token-file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DpfleetError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DpfleetError(f"{path}: expected a JSON object with url and token")
    url, token, pid, cert = (data.get(k) for k in ("url", "token", "pid", "tls_cert"))
    if not isinstance(url, str) or not isinstance(token, str) or not token:
        raise DpfleetError(f"{path}: expected string fields 'url' and 'token'")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        raise DpfleetError(f"{path}: 'pid' must be an integer, got {pid!r}")
    if cert is not None and not isinstance(cert, str):
        raise DpfleetError(f"{path}: 'tls_cert' must be a path or null, got {cert!r}")
    tls_cert = None
    if cert is not None:  # absolute; or relative to STATE, else to where serve was started (cwd)
        tls_cert = state / cert if (state / cert).is_file() or not Path(cert).is_file() else Path(cert)
        _check_cert(tls_cert, str(path))
    return AdminTarget(_check_url(url, str(path)), token, tls_cert, pid, path)


def target_from_url(url: str, token_file: Path, tls_cert: Path | None = None) -> AdminTarget:
    """A coordinator named by URL (possibly on another machine), its token read from a file so
    that it never appears in the shell history or the process list."""
    token_file = Path(token_file)
    try:
        token = token_file.read_text().strip()
    except FileNotFoundError:
        raise DpfleetError(f"token file {token_file} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DpfleetError(f"token file {token_file} is not readable ({exc})") from None
    if not token:
        raise DpfleetError(f"token file {token_file} is empty")
    cert = None if tls_cert is None else _check_cert(Path(tls_cert), "--tls-cert")
    return AdminTarget(_check_url(url, "--url"), token, cert)


def _pid_note(target: AdminTarget) -> str:
    if target.pid is None or target.admin_file is None:
        return ""
    try:
        os.kill(target.pid, 0)
        alive = "still running"
    except ProcessLookupError:
        alive = "no longer running"
    except PermissionError:  # exists, owned by someone else
        alive = "still running"
    return f"; it wrote {target.admin_file} pid {target.pid}, which is {alive}"


def _ssl_context(target: AdminTarget) -> ssl.SSLContext | None:
    if not target.url.startswith("https://"):
        return None
    try:
        ctx = ssl.create_default_context(cafile=None if target.tls_cert is None
                                         else str(target.tls_cert))
    except (ssl.SSLError, OSError) as exc:
        raise DpfleetError(f"TLS certificate {target.tls_cert} is not a PEM certificate ({exc})") \
            from None
    # a coordinator's self-signed certificate is pinned as a trust anchor of its own
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


class AdminClient:
    """Blocking calls to one coordinator's admin API; each raises `DpfleetError` on failure."""

    def __init__(self, target: AdminTarget, timeout: float = 10.0):
        if not timeout > 0:
            raise DpfleetError(f"--timeout must be > 0 seconds, got {timeout}")
        self.target = target
        self.timeout = timeout

    def status(self) -> dict:
        return self._status(self._call("GET", f"{ADMIN}/status"))

    def history(self) -> dict:
        out = self._call("GET", f"{ADMIN}/history")
        if not isinstance(out, dict):
            raise DpfleetError(f"{self.target.url} sent a history that is not a JSON object")
        return out

    def pause(self) -> dict:
        return self._status(self._call("POST", f"{ADMIN}/pause"))

    def resume(self) -> dict:
        return self._status(self._call("POST", f"{ADMIN}/resume"))

    def stop(self) -> dict:
        return self._status(self._call("POST", f"{ADMIN}/stop"))

    def report(self) -> str:
        return self._call("GET", f"{ADMIN}/report", text=True)

    def _status(self, out: object) -> dict:
        missing = [k for k in STATUS_FIELDS if not isinstance(out, dict) or k not in out]
        if missing:
            raise DpfleetError(f"{self.target.url} is not a dpfleet coordinator speaking protocol "
                               f"v1: its status lacks {', '.join(missing)}")
        return out

    def _call(self, method: str, path: str, text: bool = False):
        return asyncio.run(self._request(method, path, text))

    async def _request(self, method: str, path: str, text: bool):
        """One call; a 503 with Retry-After (the coordinator is committing a round or starting)
        is retried while the --timeout budget lasts."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.timeout
        while True:
            try:
                return await self._request_once(method, path, text)
            except _Busy as busy:
                if loop.time() + busy.after_s >= give_up:
                    raise DpfleetError(busy.message) from None
                await asyncio.sleep(busy.after_s)

    async def _request_once(self, method: str, path: str, text: bool):
        t = self.target
        url = t.url + path
        headers = {"Authorization": f"Bearer {t.token}"}
        ssl_ctx = _ssl_context(t)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.request(method, url, headers=headers,
                                    ssl=ssl_ctx if ssl_ctx is not None else True) as resp:
                body = await resp.read()
                status, headers = resp.status, resp.headers
        except aiohttp.ClientConnectorCertificateError as exc:
            raise DpfleetError(
                f"TLS: the certificate of {t.url} does not verify ({exc.certificate_error}); "
                + ("pass the coordinator's certificate with --tls-cert" if t.tls_cert is None
                   else f"it is not the one in {t.tls_cert}")) from None
        except (aiohttp.ClientSSLError, ssl.SSLError) as exc:
            raise DpfleetError(f"TLS handshake with {t.url} failed ({_one_line(exc)}); "
                               "does the coordinator serve https on that port?") from None
        except aiohttp.ClientConnectorError as exc:
            reason = (exc.os_error.strerror or str(exc.os_error)).lower()
            raise DpfleetError(f"cannot connect to the coordinator at {t.url} ({reason}): "
                               f"is the coordinator running?{_pid_note(t)}") from None
        except TimeoutError:
            raise DpfleetError(f"the coordinator at {t.url} did not answer {method} {path} within "
                               f"{self.timeout:g} s (--timeout)") from None
        except aiohttp.ClientError as exc:
            raise DpfleetError(f"the connection to {t.url} failed during {method} {path} "
                               f"({_one_line(exc)}); "
                               "is it a dpfleet coordinator, with the right http/https?") from None
        if status == 401:
            where = f"the token in {t.admin_file}" if t.admin_file else "the --token-file"
            raise DpfleetError(f"the coordinator at {t.url} refused the admin token (401): "
                               f"{where} is not this coordinator's admin token")
        if status == 503 and _retry_after(headers) is not None:
            raise _Busy(_retry_after(headers), f"the coordinator at {t.url} is busy "
                        f"({_error_text(body)}) and stayed so for --timeout {self.timeout:g} s")
        if status >= 400:
            raise DpfleetError(f"the coordinator at {t.url} answered {method} {path} with "
                               f"{status}: {_error_text(body)}")
        try:
            decoded = body.decode()
            return decoded if text else json.loads(decoded)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise DpfleetError(f"{t.url} answered {method} {path} with something that is not "
                               f"{'text' if text else 'JSON'}; is it a dpfleet coordinator?") from None


class _Busy(Exception):
    def __init__(self, after_s: float, message: str):
        super().__init__(message)
        self.after_s, self.message = after_s, message


def _retry_after(headers) -> float | None:
    try:
        value = float(headers.get("Retry-After", ""))
    except ValueError:
        return None
    return min(value, 30.0) if value >= 0 else None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _error_text(body: bytes) -> str:
    """The one-line `error` of the contract's error body, else the start of what was sent."""
    try:
        err = json.loads(body)
        if isinstance(err, dict) and isinstance(err.get("error"), str):
            return " ".join(err["error"].split())
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return " ".join(body[:200].decode(errors="replace").split()) or "(empty body)"
