"""`dpfleet fleet run`: one command for a local coordinator and an emulated fleet.

Why subprocesses (not threads or one event loop): they are the same two programs a user runs
by hand, `service serve` and `fleet emulate`, so `fleet run` tests what ships, a crash of
one is visible as an exit code, and Ctrl-C can stop them in the right order: the coordinator
first through its admin API (it finishes or abandons the open round durably), then the fleet.
Both run in their own sessions so a terminal's Ctrl-C reaches only this supervisor.
Re-running the same command continues: `serve` continues an existing state, the fleet reuses
its key file. The fleet's files live beside STATE, in STATE_fleet/ (STATE belongs to `serve`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dpfleet.edge.wire.admin_client import AdminClient, target_from_state
from dpfleet.edge.wire.protocol import PLAN_FILE, PUBLIC_FILE
from dpfleet.errors import DpfleetError

STARTUP_TIMEOUT_S = 600.0  # the coordinator prepares the data and the model before it listens
FLEET_LINGER_S = 60.0  # after the coordinator finished, the devices' last check-ins end the fleet


class FleetInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped `run_fleet` cleanly (coordinator first, then the fleet); `status`: the
    coordinator's last status (empty if it never answered). The CLI exits 130."""

    def __init__(self, status: dict):
        super().__init__()
        self.status = status


def fleet_dir_of(state: Path) -> Path:
    """Where `fleet run` keeps the fleet's keys, registry and both programs' console logs."""
    return state.with_name(state.name + "_fleet")


def wait_for_admin(state: Path, proc: subprocess.Popen, log_path: Path,
                   timeout: float = STARTUP_TIMEOUT_S) -> dict:
    """STATE/admin.json once the coordinator we started (its pid) has written it."""
    path = state / "admin.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DpfleetError(f"the coordinator exited with code {proc.returncode}: "
                               f"{last_line(log_path)} (log: {log_path})")
        with contextlib.suppress(OSError, ValueError):
            admin = json.loads(path.read_text())
            if admin.get("pid") == proc.pid:
                return admin
        time.sleep(0.1)
    raise DpfleetError(f"the coordinator did not start within {timeout:.0f} s (log: {log_path})")


def last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        if lines:
            return lines[-1].strip()
    return "(no output)"


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to `grace_s` for `proc` to end, then SIGTERM, then SIGKILL."""
    for sig, wait in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


def _dpfleet(*args: object) -> list[str]:
    return [sys.executable, "-m", "dpfleet", *map(str, args)]


def run_fleet(config: Path, state: Path, *, devices: int = 0, processes: int = 2,
              rounds: int | None = None, seed: int | None = None, grace_s: float = 20.0,
              progress: bool = True, log=print, backend: str = "local", address: str = "") -> dict:
    """Run (or continue) a local coordinator + fleet to the end; the last admin status.
    `backend` / `address`: where `fleet emulate` places its workers (fleet/ray_workers.py).
    Ctrl-C stops both cleanly, then raises `FleetInterrupted` with the last status."""
    from dpfleet.coordinator.config import load_config
    from dpfleet.coordinator.serve_plan import check_kept_plan, check_serve_config
    from dpfleet.fleet.emulate import fleet_keys, load_devices, needs_coordinator_vocabulary
    from dpfleet.secagg.registry import public_registry, write_public_registry

    if rounds is not None and rounds < 1:
        raise DpfleetError("--rounds must be >= 1")
    # a bad config fails here, before anything starts (--rounds checked with it, as serve does)
    cfg = load_config(config, None if rounds is None else {"rounds": rounds})
    # what `service serve` would refuse, refused here in its words, before anything starts
    # (else it fails inside the subprocess and shows only in serve.console.log)
    check_serve_config(cfg)
    check_kept_plan(cfg, Path(state))
    if needs_coordinator_vocabulary(cfg):
        raise DpfleetError("fleet run: the devices must tokenize with the coordinator's DP word "
                           "vocabulary; run `service serve` and `fleet emulate --vocabulary "
                           "STATE/vocabulary` by hand, or use a public tokenizer")
    state = Path(state)
    fleet_dir = fleet_dir_of(state)  # beside STATE: serve starts only in an empty or its own folder
    fleet_dir.mkdir(parents=True, exist_ok=True)
    keys_path, registry_path = fleet_dir / "fleet_keys.json", fleet_dir / "fleet_public.json"
    ids, _, _ = load_devices(cfg, devices)  # the registry first: serve admits only these keys
    write_public_registry(registry_path, public_registry(fleet_keys(keys_path, len(ids)), ids))

    serve_log, fleet_log = fleet_dir / "serve.console.log", fleet_dir / "emulate.log"
    serve_cmd = _dpfleet("service", "serve", config, "--state", state, "--listen",
                         "127.0.0.1:0", "--fleet-public", registry_path)
    if rounds is not None:
        serve_cmd += ["--rounds", str(rounds)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    admin: dict | None = None
    client: AdminClient | None = None
    status: dict = {}
    try:
        with open(serve_log, "ab") as out:
            serve = subprocess.Popen(serve_cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        procs.append(serve)
        admin = wait_for_admin(state, serve, serve_log)
        client = AdminClient(target_from_state(state), timeout=5.0)
        log(f"coordinator: {admin['url']} (pid {serve.pid}, log {serve_log})")
        emulate_cmd = _dpfleet("fleet", "emulate", config, "--coordinator", admin["url"],
                               "--devices", len(ids), "--processes", processes, "--fleet-keys",
                               keys_path, "--registry", registry_path, "--no-progress",
                               "--summary", fleet_dir / "summary.json",
                               *_emulate_flags(cfg, state, admin, seed, backend, address))
        with open(fleet_log, "ab") as out:
            fleet = subprocess.Popen(emulate_cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        procs.append(fleet)
        log(f"fleet: {len(ids)} devices in {processes} processes (pid {fleet.pid}, log {fleet_log})")
        status = _watch(client, serve, fleet, fleet_log, progress)
        stop_process(fleet, FLEET_LINGER_S)
    except KeyboardInterrupt:
        log("stopping: coordinator first (rerun the same command to continue)")
        status = _stop(client, procs, grace_s) or status
        raise FleetInterrupted(status) from None
    except BaseException:
        _stop(client, procs, grace_s)
        raise
    if serve.returncode not in (0, None):
        raise DpfleetError(f"the coordinator exited with code {serve.returncode}: "
                           f"{last_line(serve_log)} (log: {serve_log})")
    log(f"run directory: {state} (metrics.jsonl, participation.jsonl, privacy report, checkpoint/, "
        f"service.log); fleet: {fleet_dir}")
    return status


def _emulate_flags(cfg, state: Path, admin: dict, seed: int | None, backend: str, address: str
                   ) -> list[object]:
    """`fleet emulate`'s flags that depend on the run: its seed, the plan and bundle key serve
    wrote at boot (before admin.json), where the workers go, and the coordinator's certificate."""
    flags: list[object] = []
    if seed is not None:
        flags += ["--seed", str(seed)]
    if cfg.dp.target_epsilon > 0:
        flags += ["--plan", state / PLAN_FILE]
    if backend != "local":
        flags += ["--backend", backend] + (["--address", address] if address else [])
    if admin.get("tls_cert"):
        flags += ["--ca-file", admin["tls_cert"]]
    if cfg.fleet.client == "bundle":
        flags += ["--bundle-key", state / PUBLIC_FILE]
    return flags


def _watch(client: AdminClient, serve: subprocess.Popen, fleet: subprocess.Popen, fleet_log: Path,
           progress: bool) -> dict:
    """Show rounds committed / eps / accuracy until the coordinator exits; its last status."""
    bar, status = None, {}
    try:
        while serve.poll() is None:
            with contextlib.suppress(DpfleetError):
                status = client.status()
            if fleet.poll() is not None and fleet.returncode != 0:
                raise DpfleetError(f"the fleet exited with code {fleet.returncode}: "
                                   f"{last_line(fleet_log)} (log: {fleet_log})")
            if progress and status:
                if bar is None:
                    from dpfleet.progress import progress_bar

                    bar = progress_bar(total=status.get("rounds_planned"), desc="rounds", unit="round",
                                       dynamic_ncols=True, terminal_only=False)
                bar.n = status.get("rounds_committed", 0)
                acc = status.get("last_accuracy")
                bar.set_postfix(eps=f"{status.get('epsilon', 0.0):.2f}",
                                acc="-" if acc is None else f"{acc:.4f}",
                                failed=status.get("rounds_failed", 0), phase=status.get("phase"),
                                refresh=True)
            if status.get("run_state") == "finished":
                serve.wait(60)
                break
            time.sleep(1.0)
    finally:
        if bar is not None:
            bar.close()
    return status


def _stop(client: AdminClient | None, procs: list[subprocess.Popen], grace_s: float) -> dict:
    """Admin stop, then terminate, then kill: coordinator first, fleet second."""
    status: dict = {}
    if client is not None and procs and procs[0].poll() is None:
        with contextlib.suppress(DpfleetError):
            status = client.stop()
    for proc in procs:
        stop_process(proc, grace_s if proc is procs[0] else 5.0)
    return status
