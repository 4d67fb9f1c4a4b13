"""Starting and stopping one coordinator process: state, engine, HTTP site, admin.json.

`start` is what `dpfleet service serve` and the in-process tests share: boot the engine on
the state directory, bind the site (port 0 picks a free one), write STATE/admin.json (0600:
URL, admin token, pid, TLS certificate) and start the round driver. While it serves, the
process umask is 077 (STATE 0700, every file in it 0600, also SQLite's -wal / -shm); off
loopback it refuses to start without the fleet's key registry (no id claimable without one).
`serve` runs until the run finishes (then answers "done" a little longer so devices learn it)
or a stop is asked for (admin stop, SIGINT, SIGTERM): an open round fails cleanly and a
restart continues.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.run_privacy.config_plan import RunPlan
from dpfleet.edge.wire.protocol import ADMIN_FILE
from dpfleet.errors import DpfleetError
from dpfleet.export.policy import ReleasePolicy
from dpfleet.io import hold_private_umask, release_private_umask, removed_on_failure, write_secret
from dpfleet.service.app import HTTP_LOG, POLL_S, make_app
from dpfleet.service.auth import new_admin_token
from dpfleet.service.boot import boot
from dpfleet.service.rounds import HttpCollector
from dpfleet.service.servelog import ServiceLog

SERVICE_LOG = "service.log"


@dataclass
class Running:
    url: str
    token: str
    driver: HttpCollector
    runner: web.AppRunner
    task: asyncio.Task
    log: ServiceLog
    admin_file: Path
    holds_umask: bool = False  # `shutdown` releases the process umask (`hold_umask`)


def parse_listen(listen: str, tls: bool) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    try:
        if not sep:
            raise ValueError
        port_n = int(port)
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise DpfleetError(f"--listen must be HOST:PORT with an IP address, got {listen!r}") from None
    if not 0 <= port_n < 65536:
        raise DpfleetError(f"--listen port must be 0..65535, got {port_n}")
    if not addr.is_loopback and not tls:
        raise DpfleetError(f"--listen {listen}: a non-loopback address needs --tls-cert/--tls-key")
    return host.strip("[]"), port_n


# the process umask is 077 while any coordinator of this process serves (`serve` is one per
# process; in-process tests may run several): the floor's holder, shared with the CLI's
hold_umask, release_umask = hold_private_umask, release_private_umask


def check_exposure(host: str, registry: dict | None) -> None:
    """Off loopback no device id may be claimed without a credential: the fleet's key registry
    (--fleet-public) is required there; on loopback (an emulation) registration may stay open."""
    if registry is None and not ipaddress.ip_address(host).is_loopback:
        raise DpfleetError(f"--listen {host}: off loopback anyone could claim a device id by "
                           "registering first; give --fleet-public FILE (the fleet's key "
                           "registry) so only the fleet's keys may register")


def private_state(state: Path) -> None:
    """STATE 0700 and everything in it 0600 (folders 0700), also what an older process left."""
    state.chmod(0o700)
    for root, dirs, files in os.walk(state):
        for d in dirs:  # os.walk does not enter a linked folder; chmod would follow the link
            if not Path(root, d).is_symlink():
                Path(root, d).chmod(0o700)
        for f in files:
            path = Path(root, f)
            if not path.is_symlink():
                path.chmod(0o600)


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise DpfleetError("TLS needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise DpfleetError(f"cannot load the TLS certificate/key: {exc}") from None
    return ctx


def bind(host: str, port: int, listen: str) -> socket.socket:
    """The coordinator's socket, bound to HOST:PORT (port 0: a free one) before anything is
    created or changed in STATE, so a busy port is one line that leaves no state behind (an
    existing STATE exactly as it was). It listens only once the site starts: until the state is
    booted a device's connection is refused, and its link retries."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DpfleetError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    return sock


async def start(cfg: SimulationConfig, state: Path, *, listen: str = "127.0.0.1:0",
                registry: dict[str, bytes] | None = None, tls_cert: Path | None = None,
                tls_key: Path | None = None, poll_s: float = POLL_S, log=print,
                policy: ReleasePolicy | None = None, plan: RunPlan | None = None) -> Running:
    """Boot the coordinator on `state` and serve it on `listen`; `plan`: the planned keys the
    config states (`config_plan.read_run_config`), which dp.target_epsilon's plan must agree with."""
    state = Path(state)
    ctx = tls_context(tls_cert, tls_key)
    host, port = parse_listen(listen, ctx is not None)
    check_exposure(host, registry)
    sock = bind(host, port, listen)  # before STATE is touched: a busy port leaves it as it was
    hold_umask()  # the state's files (SQLite, its -wal and -shm, logs, rounds): 0600
    try:  # a state this start creates and cannot boot (a config its data refuses) is removed again
        with removed_on_failure(state):
            booted = boot(cfg, state, log, plan)  # in this thread: the store's SQLite connection stays here
            private_state(state)
    except BaseException:
        sock.close()
        release_umask()
        raise
    if registry is None:
        log("registration is open: the first key to register a device id of this run claims it "
            "(loopback emulation only; off loopback serve needs --fleet-public)")
    service_log = ServiceLog(state / SERVICE_LOG)
    driver = HttpCollector(booted, service_log, registry, say=log, policy=policy)
    token = new_admin_token()
    runner = web.AppRunner(make_app(driver, token, poll_s=poll_s), access_log=None,
                           logger=HTTP_LOG)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ctx).start()
    bound = sock.getsockname()[1]
    url = f"{'https' if ctx else 'http'}://{'[' + host + ']' if ':' in host else host}:{bound}"
    admin_file = state / ADMIN_FILE
    admin_file.unlink(missing_ok=True)
    cert = str(Path(tls_cert).resolve()) if tls_cert else None  # not relative to our cwd
    write_secret(admin_file, json.dumps({"url": url, "token": token, "pid": os.getpid(),
                                         "tls_cert": cert}).encode())
    service_log.event("listen", url=url, registration="registry" if registry else "open")
    task = asyncio.create_task(driver.run())
    return Running(url, token, driver, runner, task, service_log, admin_file, True)


async def shutdown(running: Running) -> None:
    running.driver.stop()
    try:
        await running.task
    finally:
        await running.runner.cleanup()
        running.driver.store.close()
        running.log.close()
        running.admin_file.unlink(missing_ok=True)
        if running.holds_umask:
            running.holds_umask = False
            release_umask()


async def serve(cfg: SimulationConfig, state: Path, *, linger_s: float | None = None,
                log=print, **kw) -> dict:
    """Run a coordinator until its run finishes or it is stopped; returns its last status
    (with `stopped_by`: the signal's name, when SIGINT or SIGTERM stopped it; `outcome`: a
    finished run's result, which `result_lines` prints)."""
    running = await start(cfg, state, log=log, **kw)
    log(f"coordinator listening on {running.url} (admin token in {running.admin_file})")
    loop = asyncio.get_running_loop()
    signals: list[str] = []

    def stop(sig: signal.Signals) -> None:
        signals.append(sig.name)
        running.driver.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        await asyncio.wait([running.task])
        if running.driver.run_state == "finished":  # let devices learn that the run is done
            await asyncio.sleep(linger_s if linger_s is not None
                                else 3 * cfg.service.checkin_retry_s + 1.0)
        status = running.driver.status() | ({"stopped_by": signals[0]} if signals else {})
        if running.driver.outcome is not None:  # the finished run's result, for the console
            status["outcome"] = running.driver.outcome
    finally:
        await shutdown(running)
    running.task.result()  # re-raise what stopped the driver, if anything
    return status
