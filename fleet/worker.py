"""One worker process of the emulated fleet: a slice of devices as coroutines on one event loop.

Why processes with asyncio inside: a thousand phones are mostly asleep (timers, charging windows),
so each is a coroutine; what costs CPU is local training, which runs in ONE thread per process
(the loop's default executor, where the participant's `asyncio.to_thread` lands) with torch
threads = 1, so K processes train at most K devices at once and a 2-core machine is never
oversubscribed. The participant's runtime is cached per process and is not thread-safe, which
is a second reason for exactly one training thread.

A worker knows only its own devices: their examples, their private keys, their behaviour. It
reports counts (never data) to the parent through a queue, and each assignment at once, so that
a worker restarted after a crash gets its devices' timers back (a phone keeps its timer across a
reboot).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue as queue_mod
import random
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dpfleet.coordinator.config import SimulationConfig
from dpfleet.edge.devices import Behaviour, DeviceTimer
from dpfleet.edge.traces import load_replay
from dpfleet.edge.wire.protocol import PUBLIC_STATUS
from dpfleet.fleet.clock import FleetClock
from dpfleet.fleet.device import DeviceState, device_loop

REPORT_EVERY_S = 0.5
WATCH_EVERY_S = 2.0
POLL_PATH = "/secagg?"  # a GET here is a long-poll: its wait is not a request latency


@dataclass
class DeviceSpec:
    index: int
    device_id: str
    examples: np.ndarray
    key: bytes  # raw 32-byte Ed25519 private key
    timer_last: float | None = None  # simulated time of its last assignment (restarts)
    bundle_serials: dict[str, int] = field(default_factory=dict)  # newest bundle serial per key (restarts)


@dataclass
class WorkerSpec:
    worker: int
    cfg: SimulationConfig
    url: str
    devices: list[DeviceSpec]
    pinned: dict[str, bytes]  # the fleet's public registry, got out of band (SecAgg pins)
    seed: int
    origin: float  # unix time at simulated time 0 (shared by all workers)
    start_hour: float
    time_scale: float
    timer_period_s: float  # simulated seconds a device stays away after an assignment
    model_bytes: int  # size of one model / update on the wire (link sleeps)
    ca_file: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    bundle_key: bytes | None = None  # the run's bundle public key, pinned out of band ([fleet] client)


# numpy's BLAS (OpenBLAS) starts one spinning thread per core by default: in a worker that
# already has its one training thread, a 37k-entry dot product then cost ~18 ms instead of
# ~10 us on a loaded 2-core machine. Read when numpy loads, so set before the spawn.
ONE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_blas_thread():
    """The environment a worker process is spawned with (its BLAS on one thread)."""
    saved = {k: os.environ.get(k) for k in ONE_THREAD_ENV}
    os.environ.update(ONE_THREAD_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def worker_main(spec: WorkerSpec, events) -> None:
    """Process entry (multiprocessing spawn): run the slice's devices until all are done."""
    import torch

    from dpfleet import eventloop

    torch.set_num_threads(1)
    eventloop.run(_run(spec, events))


def _timed_link_class():
    from dpfleet.fleet.link import CoordinatorLink

    class TimedLink(CoordinatorLink):
        """The service's link, timing each request (with its retries) for the benchmark."""

        latencies: dict[str, list[float]]

        async def request(self, method, path_qs, body=b"", **kw):
            began = time.perf_counter()
            try:
                return await super().request(method, path_qs, body, **kw)
            finally:
                # a merged SecAgg post (`&after=`) waits for the next phase like a GET poll
                if not (POLL_PATH in path_qs and (method == "GET" or "&after=" in path_qs)):
                    self.latencies.setdefault(endpoint(method, path_qs), []).append(
                        time.perf_counter() - began)

    return TimedLink


class TrainingExecutor(ThreadPoolExecutor):
    """The one training thread of a worker; records when it was busy (unix start, end), so the
    load benchmark can subtract device compute from round wall time without counting the time
    a device waited for the thread."""

    def __init__(self):
        super().__init__(1, "train")
        self.busy: list[tuple[float, float]] = []

    def submit(self, fn, /, *args, **kwargs):
        def timed():
            began = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy.append((began, time.time()))

        return super().submit(timed)


class Hooks:
    """The participant's `before_phase` hook for one device: link delays and per-phase dropout."""

    def __init__(self, behaviour: Behaviour, clock: FleetClock, model_bytes: int, assignment: dict):
        self.b, self.clock, self.model_bytes = behaviour, clock, model_bytes
        self.round, self.attempt = int(assignment["round"]), int(assignment.get("attempt", 0))

    def _drop(self, phase: str) -> None:
        from dpfleet.fleet.participant import DropOut

        if self.b.drops(phase, self.round, self.attempt):
            raise DropOut(f"emulated dropout in phase {phase}")

    async def __call__(self, phase: str) -> None:
        if phase in ("train", "commit"):  # the participant downloads the plan and model next
            self._drop("download")
            await self.clock.sleep(self.b.transfer_seconds(self.model_bytes))
        self._drop(phase)
        big = phase in ("report", "mask")  # the update (or its masked form) goes up
        await self.clock.sleep(self.b.transfer_seconds(self.model_bytes if big else 256))


async def _run(spec: WorkerSpec, events) -> None:
    import aiohttp

    from dpfleet.fleet.link import LinkError
    from dpfleet.fleet.participant import local_policy, take_part

    cfg = spec.cfg
    executor = TrainingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    clock = FleetClock(spec.time_scale, spec.origin, spec.start_hour)
    policy = functools.partial(local_policy, cfg.dp.report_goal, cfg.aggregation.graph,
                               cfg.aggregation.corruption)
    counts: dict[str, int] = spec.counts
    latencies: dict[str, list[float]] = {}  # endpoint -> seconds per request
    train_seconds: list[float] = []
    outcomes: list[tuple] = []  # (device id, round, attempt, outcome, training s, {step: CPU s})
    examples = {d.index: d.examples for d in spec.devices}

    def on_event(device: DeviceState, event: str) -> None:
        counts[event] = counts.get(event, 0) + 1
        if event == "assigned":  # at once: a restarted worker must not forget a timer
            events.put(("timer", spec.worker, device.index, device.timer.last))

    async def participate(device: DeviceState, assignment: dict) -> str:
        serials = dict(device.bundle_serials)
        outcome = await take_part(
            device.link, assignment, examples[device.index], policy=policy, pinned=spec.pinned,
            before_phase=Hooks(device.behaviour, clock, spec.model_bytes, assignment),
            speed=device.behaviour.profile.speed, threads=1, bundle_key=spec.bundle_key,
            bundle_serials=device.bundle_serials)
        if device.bundle_serials != serials:  # at once, like the timer: a restart keeps it
            events.put(("bundle_serials", spec.worker, device.index, dict(device.bundle_serials)))
        if outcome.train_seconds:
            train_seconds.append(outcome.train_seconds)
        outcomes.append((device.device_id, int(assignment["round"]), int(assignment["attempt"]),
                         outcome.kind, round(outcome.train_seconds, 6),
                         {k: round(v, 6) for k, v in outcome.cpu.items()}))
        if outcome.kind == "dropped":  # gone for this round: back only after its last deadline
            device.offline_until = clock.now() + offline_for(assignment) * clock.time_scale
        return outcome.kind

    async def report_counts() -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            events.put(("counts", spec.worker, dict(counts)))

    tls = ssl.create_default_context(cafile=spec.ca_file) if spec.ca_file else True
    link_cls = _timed_link_class()
    link_cls.latencies = latencies
    connector = aiohttp.TCPConnector(limit=0)  # every device may hold a long-poll at once
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        devices = _device_states(spec, link_cls, session)
        reporter = asyncio.ensure_future(report_counts())
        tasks = [asyncio.ensure_future(device_loop(
            dev, dev.link, clock, participate, rng=random.Random(dev.index), on_event=on_event,
            link_errors=(LinkError,))) for dev in devices]
        watcher = asyncio.ensure_future(_watch_run(spec.url, tls, session, tasks))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        reporter.cancel()
        watcher.cancel()
    for r in results:
        if isinstance(r, BaseException):  # CancelledError: asleep when the run finished
            name = "done" if isinstance(r, asyncio.CancelledError) else f"crashed_{type(r).__name__}"
            counts[name] = counts.get(name, 0) + 1
    events.put(("final", spec.worker, dict(counts), latencies, train_seconds, outcomes,
                executor.busy))
    # the queue's feeder thread must flush before the process exits
    if hasattr(events, "close"):
        events.close()
        events.join_thread()


def _device_states(spec: WorkerSpec, link_cls: type, session) -> list[DeviceState]:
    """The worker's devices: each its behaviour (the `[devices]` model, replaying the trace both
    simulate and the fleet replay: client i is trace device i mod T), its timer as it was left,
    and its own signed link over the worker's one HTTP session."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    cfg = spec.cfg
    trace = (load_replay(cfg.devices.trace, max(d.index for d in spec.devices) + 1)
             if cfg.devices.trace and spec.devices else None)
    devices = []
    for d in spec.devices:
        state = DeviceState(d.index, d.device_id, Behaviour(cfg.devices, spec.seed, d.index, trace,
                                                              cfg.participation.round_minutes),
                            DeviceTimer(spec.timer_period_s, d.timer_last),
                            runtime=cfg.client.runtime, bundle_serials=dict(d.bundle_serials))
        state.link = link_cls(spec.url, d.device_id, Ed25519PrivateKey.from_private_bytes(d.key),
                              ca_file=spec.ca_file, session=session,
                              rng=random.Random(f"{spec.seed}/{d.index}"))
        devices.append(state)
    return devices


async def _watch_run(url: str, tls: object, session, tasks: list[asyncio.Task]) -> None:
    """End devices asleep on a long timer once the run is over (they would only learn it at
    their next check-in), and end the worker if its parent is gone (orphaned by kill -9)."""
    import aiohttp

    parent = os.getppid()
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        finished = os.getppid() != parent
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            async with session.get(url.rstrip("/") + PUBLIC_STATUS, ssl=tls) as resp:
                if resp.status == 200:
                    finished |= (await resp.json()).get("run_state") == "finished"
        if finished:
            for task in tasks:
                task.cancel()
            return


def endpoint(method: str, path_qs: str) -> str:
    """A request's endpoint without ids: "POST checkin", "GET blobs", "POST rounds/secagg"."""
    parts = path_qs.split("?")[0].strip("/").split("/")[1:]  # drop "v1"
    name = "rounds/" + parts[2] if parts[:1] == ["rounds"] and len(parts) > 2 else parts[0]
    return f"{method} {name}"


def offline_for(assignment: dict, now: float | None = None) -> float:
    """Wall seconds a device that dropped out stays away: until the round's last deadline (a
    device that came straight back would be handed the same assignment and drop again)."""
    deadlines = [float(v) for v in (assignment.get("deadlines") or {}).values()]
    if not deadlines:
        return 0.0
    return max(0.0, max(deadlines) - (time.time() if now is None else now))


def drain(events, timeout: float) -> list[tuple]:
    """Everything the workers sent within `timeout` seconds (at least one get)."""
    out = []
    try:
        out.append(events.get(timeout=timeout))
        while True:
            out.append(events.get_nowait())
    except queue_mod.Empty:
        pass
    return out
