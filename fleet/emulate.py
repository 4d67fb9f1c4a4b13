"""`dpfleet fleet emulate`: prepare the devices, start K worker processes, watch them, summarize.

Why the parent prepares the data: the devices' examples must be exactly `simulate`'s
(`simulation.prepare_data`, device i = train client i), and tokenizing once is cheaper than once
per worker. The parent then hands each worker only its own devices' examples and keys (spawned
processes get a pickled copy of their slice and nothing else); it keeps the slices (not the
held-out clients or the raw text) only to start a dead worker's devices again.

Why the parent watches: a worker that dies (a crash, or `kill -9` in the fault tests) is started
again with the same devices and their timers (each assignment is reported at once), as phones
come back after a reboot; the round it was in completes from the survivors or fails cleanly at
the coordinator, which is the coordinator's business, not the fleet's.

Why the parent also watches the coordinator (`CoordinatorWatch`): the devices retry a lost
coordinator with backoff for ever (a phone cannot tell a restart from a shutdown), so a fleet
whose coordinator stopped would otherwise run silently until someone kills it. The parent asks
the coordinator's public status once a second and stops the fleet with one error line once it
has not answered for `gone_after_s` seconds (0: wait for ever, across restarts).

Why the workers ignore SIGINT: a terminal's Ctrl-C reaches the whole process group; the parent
alone handles it (stops its workers, says how to continue, exits 130), so the workers must not
die with a KeyboardInterrupt traceback each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpfleet.coordinator.config import SimulationConfig, public_words
from dpfleet.edge.wire.protocol import PUBLIC_STATUS
from dpfleet.errors import DpfleetError
from dpfleet.fleet.clock import read_time_scale
from dpfleet.fleet.worker import DeviceSpec, WorkerSpec, drain, one_blas_thread, worker_main

MAX_RESTARTS = 5  # per worker: a worker that keeps dying is a bug to report, not to hide
RESTART_DELAY_S = 1.0
GONE_AFTER_S = 5.0  # the coordinator silent this long: the fleet stops (`--coordinator-timeout`)
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 3.0


def fleet_keys(path: Path, devices: int):
    """The identity keys of devices 0..devices-1: read from `path`, or created there if absent."""
    from dpfleet.secagg.identity_keys import create_fleet_file, load_fleet_file

    path = Path(path)
    keys = load_fleet_file(path) if path.exists() else create_fleet_file(path, devices)
    if len(keys) < devices:
        raise DpfleetError(f"fleet key file {path} holds {len(keys)} device keys but the fleet has "
                           f"{devices} devices; use a new --fleet-keys file")
    return {i: keys[i] for i in range(devices)}


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored while a worker process starts: a spawned Python that starts with SIGINT
    ignored keeps ignoring it (no KeyboardInterrupt handler is installed), so a terminal's Ctrl-C
    reaches only the parent (module docstring). Outside the main thread: unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class CoordinatorWatch:
    """Asks `GET /v1/public/status` at most once per `PROBE_EVERY_S` (its rounds committed and
    planned, `rounds`, are the fleet's progress); `check()` raises one `DpfleetError` line once
    the coordinator has not answered for `gone_after_s` seconds (connection refused, reset, no
    answer in time). Any HTTP answer counts as alive (a busy
    coordinator's 503 too). A coordinator that said its run was finished and then went away
    is the normal end: `check()` returns True then."""

    def __init__(self, url: str, ca_file: str | None = None, gone_after_s: float = GONE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.url, self.gone_after_s, self.clock = url.rstrip("/"), gone_after_s, clock
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.answered = False  # it answered at least once
        self.finished = False  # it said its run is finished
        self.rounds: tuple[int, int] | None = None  # (committed, planned), as it last said
        self.failing_since: float | None = None
        self._next = 0.0

    def probe(self) -> str | None:
        """None if the coordinator answered, else why not (a few words)."""
        try:
            with urllib.request.urlopen(self.url + PUBLIC_STATUS, timeout=PROBE_TIMEOUT_S,
                                        context=self._ssl) as resp:
                body = resp.read()
            with contextlib.suppress(ValueError, AttributeError):
                said = json.loads(body)
                self.finished |= said.get("run_state") == "finished"
                committed, planned = said.get("rounds_committed"), said.get("rounds_planned")
                if isinstance(committed, int) and isinstance(planned, int):
                    self.rounds = (committed, planned)
            return None
        except urllib.error.HTTPError:
            return None  # an answer: it is there
        except urllib.error.URLError as exc:
            reason = exc.reason
        except (OSError, ValueError) as exc:
            reason = exc
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, TimeoutError):
            return f"no answer within {PROBE_TIMEOUT_S:g} s"
        return (getattr(reason, "strerror", None) or str(reason) or type(reason).__name__).lower()

    def check(self) -> bool:
        """Probe when due; True when the coordinator finished its run and is gone; raises when it
        is gone without finishing. With `gone_after_s` 0 it is probed only for `rounds` (the
        fleet's progress bar) and never given up on."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + PROBE_EVERY_S
        why = self.probe()
        if why is None:
            self.answered, self.failing_since = True, None
            return False
        if self.gone_after_s <= 0:
            return False
        if self.failing_since is None:
            self.failing_since = now
        if now - self.failing_since < self.gone_after_s:
            return False
        if self.finished:
            return True
        if self.answered:
            raise DpfleetError(
                f"the coordinator at {self.url} stopped answering ({why}); the fleet stopped. "
                "Start the coordinator again on its --state and rerun this command to continue "
                "(--coordinator-timeout 0 waits for it instead)")
        raise DpfleetError(
            f"no coordinator answers at {self.url} ({why}) after {self.gone_after_s:g} s; "
            "start `dpfleet service serve` first and pass the URL it prints "
            "(--coordinator-timeout 0 waits for it instead)")


def needs_coordinator_vocabulary(cfg: SimulationConfig) -> bool:
    """A DP word vocabulary is drawn with fresh noise: the fleet must use the coordinator's."""
    tok = cfg.tokenizer
    return (tok.kind == "word" and not tok.path and not public_words(tok)
            and not tok.allow_nonprivate_vocabulary)


def load_devices(cfg: SimulationConfig, devices: int = 0, vocabulary: Path | None = None
                 ) -> tuple[list[str], list[np.ndarray], int]:
    """(device ids, each device's examples, model parameters) as `simulate` prepares them."""
    import torch

    from dpfleet.coordinator.engine.simulation import DP_VOCABULARY, prepare_data
    from dpfleet.export.models import build_model

    if cfg.data.generated_population:
        raise DpfleetError("data.generated_population is for simulate's scale tests; the fleet "
                           "emulates the real clients only: remove it from this config")
    if needs_coordinator_vocabulary(cfg) and (
            vocabulary is None or not (Path(vocabulary) / DP_VOCABULARY).is_file()):
        raise DpfleetError("this config's word vocabulary is chosen with DP by the coordinator; "
                           "pass --vocabulary STATE/vocabulary (the coordinator's) so the "
                           "devices tokenize with the same one")
    tokenizer, data = prepare_data(cfg, Path(vocabulary) if vocabulary else None)
    if devices < 0 or devices > len(data.train):
        raise DpfleetError(f"--devices must be in 1..{len(data.train)} (the config's train "
                           f"clients), got {devices}")
    train = data.train[: devices or None]
    model = build_model(dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    params = sum(int(p.numel()) for p in model.parameters())
    del model
    torch.set_num_threads(1)
    return [c.user for c in train], [c.examples for c in train], params


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Fleet:
    """K worker processes owning the devices round-robin, restarted if they die."""

    def __init__(self, cfg: SimulationConfig, url: str, ids: list[str], examples: list[np.ndarray],
                 keys: dict, registry: dict[str, bytes], *, processes: int, seed: int,
                 model_bytes: int, start_hour: float, ca_file: str | None = None,
                 log: Callable[[str], None] = print, bundle_key: bytes | None = None):
        if processes < 1:
            raise DpfleetError("--processes must be >= 1")
        self.cfg, self.log = cfg, log
        self.ctx = mp.get_context("spawn")
        self.events = self.ctx.Queue()
        scale = read_time_scale(cfg)
        period_h = cfg.participation.timer_period if cfg.participation.mode == "timer" else 0.0
        origin = time.time()
        self.specs = [
            WorkerSpec(worker=w, cfg=cfg, url=url, devices=[
                DeviceSpec(i, ids[i], examples[i], keys[i].private_bytes_raw())
                for i in range(w, len(ids), processes)],
                pinned=registry, seed=seed, origin=origin, start_hour=start_hour,
                time_scale=scale, timer_period_s=period_h * 3600.0, model_bytes=model_bytes,
                ca_file=ca_file, bundle_key=bundle_key)
            for w in range(min(processes, len(ids)))]
        self.procs: dict[int, mp.Process] = {}
        self.counts: dict[int, dict[str, int]] = {}
        self.final: dict[int, tuple] = {}
        self.timers: dict[int, float] = {}  # device index -> simulated time of its last assignment
        self.bundle_serials: dict[int, dict[str, int]] = {}  # device index -> newest serial per key
        self.restarts = 0
        self.restarts_of: dict[int, int] = {}

    def start(self) -> None:
        for spec in self.specs:
            self._spawn(spec)

    def _spawn(self, spec: WorkerSpec) -> None:
        for d in spec.devices:
            d.timer_last = self.timers.get(d.index, d.timer_last)
            d.bundle_serials = dict(self.bundle_serials.get(d.index, d.bundle_serials))
        spec.counts = dict(self.counts.get(spec.worker, {}))  # counts go on across a restart
        proc = self._start_worker(spec)
        self.procs[spec.worker] = proc
        self.log(f"worker {spec.worker}: pid {proc.pid}, {len(spec.devices)} devices")

    def _start_worker(self, spec: WorkerSpec):
        """A started worker running `worker_main(spec, self.events)`: a local process here;
        `ray_workers.RayFleet` places it on a Ray actor (same handle: pid, is_alive, join,
        exitcode, terminate, kill)."""
        proc = self.ctx.Process(target=worker_main, args=(spec, self.events), daemon=True,
                                name=f"dpfleet-fleet-worker-{spec.worker}")
        with one_blas_thread(), sigint_ignored():
            proc.start()
        return proc

    @property
    def done(self) -> bool:
        return len(self.final) == len(self.specs)

    def poll(self, timeout: float = 0.5) -> None:
        """Take the workers' messages; restart a worker that died before it finished."""
        for message in drain(self.events, timeout):
            kind, worker = message[0], message[1]
            if kind == "counts":
                self.counts[worker] = message[2]
            elif kind == "timer":
                self.timers[message[2]] = message[3]
            elif kind == "bundle_serials":
                self.bundle_serials[message[2]] = message[3]
            elif kind == "final":
                self.counts[worker] = message[2]
                self.final[worker] = message
        for spec in self.specs:
            proc = self.procs[spec.worker]
            if spec.worker in self.final or proc.is_alive():
                continue
            proc.join()
            n = self.restarts_of.get(spec.worker, 0)
            if n >= MAX_RESTARTS:
                raise DpfleetError(f"worker {spec.worker} died {n + 1} times (exit {proc.exitcode}); "
                                   "giving up")
            self.log(f"worker {spec.worker} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                     f"restarting its {len(spec.devices)} devices")
            self.restarts_of[spec.worker] = n + 1
            self.restarts += 1
            time.sleep(RESTART_DELAY_S)
            self._spawn(spec)

    def total(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for counts in self.counts.values():
            for k, v in counts.items():
                out[k] = out.get(k, 0) + v
        return out

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()

    def summary(self, wall_s: float) -> dict:
        by_endpoint: dict[str, list[float]] = {}
        for f in self.final.values():
            for name, xs in f[3].items():
                by_endpoint.setdefault(name, []).extend(xs)
        latencies = [x for xs in by_endpoint.values() for x in xs]
        train = [x for f in self.final.values() for x in f[4]]
        return {
            "devices": sum(len(s.devices) for s in self.specs), "processes": len(self.specs),
            "wall_s": wall_s, "restarts": self.restarts, "counts": self.total(),
            "requests": len(latencies),
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "latency_by_endpoint": {name: {"requests": len(xs), "p50_s": percentile(xs, 50),
                                           "p99_s": percentile(xs, 99)}
                                    for name, xs in sorted(by_endpoint.items())},
            "train_s_total": float(sum(train)), "trainings": len(train),
            "outcomes": [list(o) for f in self.final.values() for o in f[5]],
            "busy": {str(w): f[6] for w, f in self.final.items()},  # training thread intervals
        }
