"""The HTTP side of the one round driver: devices that check in over the network collect the rounds.

The round's policy (open, collect, too few inputs -> abandon and reopen, else commit, stop) is
`coordinator.engine.round_driver.drive`'s, the same as `simulate`'s; `HttpCollector` is its
`Collector` over HTTP (named so: the one driver is `drive`) and holds what only a service has:
check-ins, assignments, deadlines, SecAgg's phases as messages arrive, pause / stop, the status
figures.

Why one asyncio task drives everything: selection, deadlines, the DP step and the commit happen
in one place and in order, while request handlers only record what devices sent and wake it.
A round is opened with the engine (selection among the devices that checked in, the simulation's
seeded draw, plus over-selection), recorded open in the store, handed out as assignments, and
then either committed (the engine's DP-FTRL step, release log and accounting in one store
transaction, `state_store.commit_round`) once the report goal's reports or SecAgg survivors are
in before the deadline, or abandoned (nothing released, no noise drawn, `fail_round`) and
opened again under the same number. The model of the next round is put up for download only
after the commit returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dpfleet.coordinator.config import resolve_noise
from dpfleet.coordinator.engine.participation import ParticipationGuard
from dpfleet.coordinator.engine.round_driver import (
    Collected,
    Failed,
    drive,
    selection_extra,
    survivors_short,
)
from dpfleet.coordinator.engine.round_engine import RoundEngine, RoundPlan, Stop, round_discretizer
from dpfleet.coordinator.engine.simulation import aggregation_seed, derive_seed
from dpfleet.coordinator.state.state_store import finish_run
from dpfleet.edge.wire import messages as msg
from dpfleet.errors import DpfleetError
from dpfleet.export.policy import PolicyRefused, ReleasePolicy
from dpfleet.io import atomic_write, sha256_hex
from dpfleet.jsonio import dumps
from dpfleet.secagg.encoding import rounding_seed
from dpfleet.secagg.round_sum import RingCosts, ring_sum
from dpfleet.service.boot import Booted
from dpfleet.service.faults import fault_from_env
from dpfleet.service.run_bundle import release_bundle
from dpfleet.service.secagg_round import SecAggRound
from dpfleet.service.servelog import ServiceLog
from dpfleet.service.uploads import PlainCollector, ReportStats, UploadError
from dpfleet.service.wakeups import Wakeups

NO_STATS = ReportStats(float("nan"), False, float("nan"))  # SecAgg devices report no statistics
CHECKIN_HOLD_S = 20.0  # the longest a waiting device's check-in is held (its long-poll)
# ... while a round it is not in runs: every expiry is one more request per idle device (on a
# 1,000-device fleet most of a round's requests), while the next round that takes it answers
# it at once anyway; kept below the devices' 60 s request timeout
IDLE_HOLD_S = 50.0


class ApiError(Exception):
    """An HTTP error answer: status, slug and one line (PROTOCOL.md, errors)."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


def registration_refused() -> ApiError:
    """THE answer to every refused registration, whatever the reason: the same status, body
    bytes and headers, so a register cannot tell whether an id is one of the run's devices, a
    held-out client, in the registry or claimed already (PROTOCOL.md, registration)."""
    return ApiError(403, "registration_refused", "registration refused")


@dataclass
class OpenRound:
    plan: RoundPlan
    number: int  # 1-based (= release number)
    attempt: int
    positions: dict[int, int]  # device index -> position
    assignments: dict[int, dict]  # position -> assignment
    opened_at: float
    plain: PlainCollector | None = None
    secagg: SecAggRound | None = None
    disc: object | None = None
    bounded: bool = True  # SecAgg: the graph plan's t is bounded (the record's threshold_bounded)
    state: str = "open"  # open | closing | committed | failed
    secagg_seconds: float = 0.0  # time in the SecAgg server state machine (handle, close_phase)
    # the coordinator's critical path (seconds devices wait on it, benchmarks/fleet_load.py):
    # "open" from when the round could open to its assignments being handed out, each SecAgg
    # phase's (SecAggRound.critical), "commit" from the last input to the commit's return
    critical: dict[str, float] = field(default_factory=dict)
    collected_at: float | None = None  # plain: arrival of the report that reached the goal
    done: asyncio.Event = field(default_factory=asyncio.Event)


class HttpCollector:
    """The rounds' collector over HTTP and the device API's logic (service/app.py maps HTTP onto
    it); `round_driver.drive` runs the rounds through it."""

    def __init__(self, booted: Booted, log: ServiceLog, registry: dict[str, bytes] | None = None,
                 say: Callable[[str], None] = lambda s: None, policy: ReleasePolicy | None = None):
        self.b, self.cfg, self.log = booted, booted.cfg, log
        # `serve --policy`: the finished model is released (STATE/release) only if the run meets it;
        # `release` is the verdict's one line (status page, console, service.log)
        self.policy, self.release = policy, None
        self.say = say  # the console: one line per committed or failed round (`round_line`)
        self.engine, self.store = booted.engine, booted.store
        self.svc = self.cfg.service
        self.registry = registry
        self.index = {u: i for i, u in enumerate(booted.users)}
        self.keys: dict[str, bytes] = {}
        for u in booted.users:
            row = self.store.device(u)
            if row and row["public_key"] is not None:
                self.keys[u] = bytes(row["public_key"])
        self.fault = fault_from_env()
        self.store.fault = self.fault
        self.run_state = "starting"
        self.stop_requested = False
        self.pool: dict[int, float] = {}  # device index -> monotonic expiry of its check-in
        self.waiting_since: dict[int, float] = {}  # device index -> when it entered the pool
        self.ended_at = time.monotonic()  # the last round's commit or failure
        self.current: OpenRound | None = None
        self.outcomes: dict[tuple[int, int], str] = {}
        self.history: list[dict] = [  # committed before a restart: from the store's metrics
            {"round": m["round"], "status": "committed", "clients": m["clients"],
             "epsilon": m.get("epsilon"), "accuracy": m["accuracy"], "loss": m["loss"], "wall_s": None}
            for m in self.engine.metrics]
        self.refused_timer: set[int] = set()
        self.phase_seconds: dict[str, list[float]] = {}
        self.wake = asyncio.Event()
        self.stopping = asyncio.Event()  # set once by stop(): ends any wait on devices at once
        self.held = Wakeups()  # held check-ins, woken by device (wakeups.py)
        self.started_at = time.time()
        self.finished = asyncio.Event()
        self.stopped_early: str | None = None
        self.outcome: dict | None = None  # the finished run's result (`_finish`): serve prints it
        self.open_due: float | None = None  # monotonic: when the round being gathered could open

    # ------------------------------------------------------------------ device API

    def may_register(self, device_id: str, public_key: bytes) -> bool:
        """Whether `public_key` may hold `device_id`: one of the run's train clients, the fleet
        registry's key for it (when there is a registry), not bound to another key. In memory
        only, every lookup made whatever the first one says (the same work on every path)."""
        known = device_id in self.index
        listed = self.registry is None or self.registry.get(device_id) == public_key
        free = self.keys.get(device_id, public_key) == public_key
        return known & listed & free

    def register(self, device_id: str, public_key: bytes) -> bool:
        """Bind the key (`may_register` said yes); any refusal is `registration_refused`."""
        if not self.may_register(device_id, public_key):
            raise registration_refused()
        try:
            new = self.store.bind_key(device_id, public_key)
        except DpfleetError:  # bound to another key in the store: the same single answer
            raise registration_refused() from None
        self.keys[device_id] = public_key
        if new:
            self.log.event("register", device=device_id)
        return new

    async def checkin(self, device_id: str, body: dict) -> dict:
        i, now, retry = self.index[device_id], time.time(), self.svc.checkin_retry_s
        if self.run_state == "finished":
            return msg.done()
        asked = msg.parse_checkin(body)  # a 400 `bad_checkin` (WireError) for a malformed one
        timer = asked.timer_expires_at
        cur = self.current
        if cur is not None and i in cur.positions and cur.state == "open" and (
                cur.plain is not None and cur.positions[i] not in cur.plain.updates
                or cur.secagg is not None and cur.positions[i] not in cur.secagg.spoken):
            return cur.assignments[cur.positions[i]]  # a repeated check-in, same job
        if self.run_state in ("paused", "stopping", "starting"):
            return msg.retry(retry, self.run_state)
        if not asked.eligible:
            return msg.refused("ineligible", retry)
        if asked.runtime != self.cfg.client.runtime:
            return msg.refused("runtime", retry)
        spent = 0.0  # seconds this request was held already
        if cur is not None and i in cur.positions:  # it answered in the open round already
            await self.held.hold(i, lambda: self.current is not cur or self.run_state != "running",
                                 CHECKIN_HOLD_S)
            ended = self.current is not cur
            if not ended or self.run_state != "running":
                return msg.retry(0.0 if ended else retry, "round full")
            # the round ended: this same request checks in for the next one (the guard and the
            # device's timer are asked now), sparing the device a second check-in
            spent, now, cur = time.time() - now, time.time(), self.current
        guard = self.engine.participation.guard
        r = self.engine.next_round
        if not guard.admits(i, r) or (timer is not None and timer > now):
            self.refused_timer.add(i)
            capped = guard.max_participation and guard.count[i] >= guard.max_participation
            return msg.refused("max_participation" if capped else "timer", retry)
        self.refused_timer.discard(i)
        # held while a round runs, too (until the next one, which opens as this one ends): a
        # waiting device is reachable the moment a round opens with it, not at its next poll
        hold = IDLE_HOLD_S if cur is not None else min(CHECKIN_HOLD_S,
                                                       self.svc.checkin_window_s + 1.0)
        hold = max(0.0, min(hold, IDLE_HOLD_S - spent))  # held at most IDLE_HOLD_S in all
        self.pool[i] = time.monotonic() + hold + retry + 2.0
        self.waiting_since.setdefault(i, time.monotonic())
        self.wake.set()
        await self.held.hold(i, lambda: self.current is not None and self.current is not cur
                             and i in self.current.positions or self.run_state != "running", hold)
        if self.run_state == "finished":
            return msg.done()
        if self.current is not None and i in self.current.positions and self.current.state == "open":
            return self.current.assignments[self.current.positions[i]]
        if self.run_state != "running":
            return msg.retry(retry, self.run_state)
        return msg.retry(0.0, "no round open")  # poll again at once


    def _round_of(self, device_id: str, number: int, attempt: int) -> tuple[OpenRound, int]:
        """The open round a device addresses, and its position; 409 for anything stale."""
        if self.run_state == "finished":
            raise ApiError(410, "run_done", "the run has finished")
        cur, i = self.current, self.index[device_id]
        if cur is None or (cur.number, cur.attempt) != (number, attempt) or cur.state != "open":
            raise ApiError(409, "stale_round", f"round {number} attempt {attempt} is not open")
        if i not in cur.positions:
            raise ApiError(409, "not_assigned", f"this device is not in round {number}")
        return cur, cur.positions[i]

    def report(self, device_id: str, number: int, attempt: int, body: bytes, headers,
               arrived: float | None = None) -> None:
        cur, position = self._round_of(device_id, number, attempt)
        if cur.plain is None:
            raise ApiError(409, "wrong_aggregation", "this round aggregates with SecAgg")
        if cur.plain.complete and position not in cur.plain.updates:  # an over-selected straggler
            raise ApiError(409, "round_full", f"round {number} already has its report goal")
        try:
            cur.plain.accept(position, body, headers)
        except UploadError as exc:
            self.log.event("report_refused", round=number, attempt=attempt, reason=str(exc))
            raise ApiError(400, "bad_report", str(exc)) from None
        if cur.plain.complete:
            cur.collected_at = cur.collected_at or arrived
            cur.done.set()

    async def secagg_post(self, device_id: str, number: int, attempt: int, body: bytes,
                          arrived: float | None = None, after: int | None = None,
                          timeout: float = 25.0) -> tuple[list[bytes], int, str] | None:
        """Take one client message; with a cursor `after`, then long-poll the device's mail
        like `secagg_poll` (a merged post: one request instead of a post and a poll)."""
        from dpfleet.secagg.errors import SecAggError

        cur, position = self._round_of(device_id, number, attempt)
        if cur.secagg is None:
            raise ApiError(409, "wrong_aggregation", "this round aggregates in plain")
        if after is not None and after < 0:  # refused before the message is taken
            raise ApiError(400, "bad_cursor", "after must be >= 0")
        began = time.perf_counter()
        try:
            await cur.secagg.handle(position, body, arrived)
        except SecAggError as exc:
            raise ApiError(400, "secagg_refused", f"{type(exc).__name__}: {exc}") from None
        finally:
            cur.secagg_seconds += time.perf_counter() - began
        if cur.secagg.finished:
            cur.done.set()
        if after is None:
            return None
        msgs, nxt = await cur.secagg.poll(position, after, timeout)
        return msgs, nxt, cur.secagg.phase

    async def secagg_poll(self, device_id: str, number: int, attempt: int, after: int,
                          timeout: float = 25.0) -> tuple[list[bytes], int, str]:
        cur, position = self._round_of(device_id, number, attempt)
        if cur.secagg is None:
            raise ApiError(409, "wrong_aggregation", "this round aggregates in plain")
        if after < 0:
            raise ApiError(400, "bad_cursor", "after must be >= 0")
        msgs, nxt = await cur.secagg.poll(position, after, timeout)
        return msgs, nxt, cur.secagg.phase

    def round_status(self, number: int, attempt: int) -> dict:
        cur = self.current
        if cur is not None and (cur.number, cur.attempt) == (number, attempt):
            state = "open" if cur.state in ("open", "closing") else cur.state
        else:
            state = self.outcomes.get((number, attempt))
            if state is None:
                raise ApiError(404, "no_such_round", f"no round {number} attempt {attempt}")
        return {"round": number, "attempt": attempt, "state": state}

    # ------------------------------------------------------------------ admin

    def pause(self) -> None:
        if self.run_state in ("running", "starting"):
            self.run_state = "paused"
            self.log.event("pause")
            self.held.wake_all()

    def resume(self) -> None:
        if self.run_state == "paused":
            self.run_state = "running"
            self.log.event("resume")
            self.wake.set()

    def stop(self) -> None:
        if self.run_state != "finished":
            self.stop_requested, self.run_state = True, "stopping"
            self.log.event("stop")
            self.wake.set()
            self.stopping.set()
            self.held.wake_all()
            if self.current is not None:
                self.current.done.set()

    # ------------------------------------------------------------------ the loop

    def _time(self, phase: str, seconds: float) -> None:
        self.phase_seconds.setdefault(phase, []).append(seconds)

    async def run(self) -> None:
        """Open, run and close rounds (the one round policy, `round_driver.drive`, with this
        driver as its HTTP `Collector`) until the run ends or a stop is asked for."""
        if self.run_state == "starting":
            self.run_state = "running"
        self.log.event("start", after_round=self.store.last_committed())
        self.selecting_since = time.monotonic()
        try:
            stop = await drive(self.engine, self)
            if stop is not None:
                self.stopped_early = None if stop.reason == "done" else stop.message
                await self._finish()
        finally:
            if self.current is not None and self.current.state in ("open", "closing"):
                self.engine.abandon_round(self.current.plan)
                self.failed(self.current.plan, "the coordinator stopped")

    # ------------------------------------------------------------------ the Collector

    async def open(self, engine: RoundEngine) -> RoundPlan | Stop | None:
        """The next round, once enough allowed devices checked in (pause waits; None: stopped)."""
        while not self.stop_requested:
            if self.run_state == "paused":
                await self._nap(1.0)
                continue
            self.open_due = None
            opened = await self._try_open()
            if isinstance(opened, Stop):
                return opened
            if opened is None:  # wake when the check-in window closes, not up to 0.2 s late
                left = (self.open_due or 0.0) - time.monotonic()
                await self._nap(left if 0.0 < left < 0.2 else 0.2)
                continue
            self._time("select", time.monotonic() - self.selecting_since)
            return opened.plan
        return None

    async def collect(self, plan: RoundPlan) -> Collected | Failed | None:
        """The open round's reports (plain) or SecAgg sum by the deadlines; None: stopped."""
        cur = self.current
        if cur.plain is None:
            return await self._run_secagg(cur)
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cur.done.wait(), self.svc.report_deadline_s)
        self._time("report", time.monotonic() - started)
        if self.stop_requested:
            return None
        if not cur.plain.complete:
            return Failed(f"{len(cur.plain.updates)} of {self.cfg.dp.report_goal} reports by the "
                          "deadline")
        return Collected(cur.plain.total(plan.count_threshold),
                         [cur.plain.stats.get(u, NO_STATS) for u in range(len(plan.devices))])

    async def _nap(self, seconds: float) -> None:
        self.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)

    async def _try_open(self) -> OpenRound | Stop | None:
        eng, m = self.engine, self.cfg.dp.report_goal
        r = eng.next_round
        now = time.monotonic()
        self.pool = {i: t for i, t in self.pool.items() if t > now}
        self.waiting_since = {i: self.waiting_since[i] for i in self.pool}
        avail, total = (allowed_waiting(eng.participation.guard, self.pool, r)
                        if r < self.cfg.rounds else ([], 0))
        if total < m:
            plan = eng.open_round()  # the engine says why no round can open (done / unfillable)
            if not isinstance(plan, Stop):
                raise RuntimeError("the engine opened a round the guard cannot fill")
            return plan
        if len(avail) < m:
            return None
        # the window runs from when m were waiting and no round was open (its devices come back)
        ready_since = max(sorted(self.waiting_since[i] for i in avail)[m - 1], self.ended_at)
        # when the round could open: the window's end, or the last allowed device's check-in
        self.open_due = (ready_since + self.svc.checkin_window_s if len(avail) < total
                         else max(self.waiting_since[i] for i in avail))
        if len(avail) < total and now - ready_since < self.svc.checkin_window_s:
            return None  # gather more check-ins (everyone there opens at once)
        extra = min(selection_extra(self.cfg), len(avail) - m)
        plan = eng.open_round(available=avail, extra=extra)
        if isinstance(plan, Stop):
            return plan
        if not set(plan.devices) <= set(avail):  # disjoint blocks: wait for the block's devices
            eng.abandon_round(plan)
            return None
        return await self._publish(plan)

    async def _publish(self, plan: RoundPlan) -> OpenRound:
        cfg, b = self.cfg, self.b
        number = plan.round + 1
        model_sha = b.blobs.put(plan.theta.astype("<f4").tobytes())
        common = {"round": number, "lr": cfg.client.lr, "batch_size": cfg.client.batch_size,
                  "seq_len": cfg.data.seq_len, "clip_norm": plan.clip_norm,
                  "model": b.model_config, "runtime": cfg.client.runtime,
                  "tokenizer_sha256": b.tokenizer_sha256, "aggregation": cfg.aggregation.kind,
                  "noise": resolve_noise(cfg), "noise_multiplier": cfg.dp.noise_multiplier}
        self.store.open_round(number, sha256_hex(dumps(common).encode()))
        attempt = int(self.store.round(number)["attempts"])
        self.fault("opened")
        n = len(plan.devices)
        now = time.time()
        cur = OpenRound(plan, number, attempt, {d: u for u, d in enumerate(plan.devices)}, {},
                        time.monotonic())
        # ONE plan blob per attempt, the same for every device: blobs are served to anyone
        # (content addressing), so none may name a device. Its id and client seed go in its own
        # assignment, over its authenticated channel (PROTOCOL.md, "Who learns who takes part")
        shared_plan = {**common, "attempt": attempt}
        plan_sha = b.blobs.put(dumps(shared_plan).encode())  # every device's: names nobody
        secagg_json = None
        if cfg.aggregation.kind == "secagg":
            secagg_json = self._secagg_setup(cur, model_sha, shared_plan)
            phase_dl = self.svc.secagg_phase_deadline_s
            t, deadlines = now, {}
            for phase in ("commit", "keys", "shares", "masked", "consistency", "unmask"):
                t += self.svc.report_deadline_s if phase == "masked" else phase_dl
                deadlines[phase] = t
        else:
            cur.plain = PlainCollector(n, plan.theta.size, plan.clip_norm, cfg.dp.report_goal)
            deadlines = {"report": now + self.svc.report_deadline_s}
        keep = {model_sha, plan_sha}
        # research mode only: each device rounds to the ring with the simulation's keyed draw
        # (secagg/encoding.py; THREAT_MODEL.md, "Research-mode rounding"); else its own
        research = secagg_json is not None and cfg.dp.noise_seed >= 0
        for u, d in enumerate(plan.devices):
            cur.assignments[u] = msg.assignment(
                round=number, attempt=attempt, position=u, model_sha256=model_sha,
                plan_sha256=plan_sha, client_seed=derive_seed(cfg.seed, plan.round, d),
                aggregation=cfg.aggregation.kind, secagg=secagg_json, deadlines=deadlines,
                time_scale=self.svc.time_scale,
                # SecAgg's design: each device pins its peers' keys
                devices=plan.device_ids if secagg_json is not None else None,
                # the signed program the device trains with (PROTOCOL.md)
                bundle=b.bundle.assignment_field() if b.bundle is not None else None,
                rounding_seed=rounding_seed(cur.disc.seed, u) if research else None)
        b.blobs.retain(keep)
        self.current = cur
        for d in plan.devices:
            self.pool.pop(d, None)
            self.waiting_since.pop(d, None)
        self.log.event("open", round=number, attempt=attempt, devices=n)
        self.held.wake(plan.devices)  # only the selected devices' held check-ins can change
        if self.open_due is not None:
            cur.critical["open"] = time.monotonic() - self.open_due
        return cur

    def _secagg_setup(self, cur: OpenRound, model_sha: str, shared_plan: dict) -> dict:
        """The attempt's SecAgg setup; its terms bind the inputs' meaning, the model's hash and
        the plan every device shares (`round_terms`), exactly as each device recomputes them
        from what it downloaded (THREAT_MODEL.md, "Model consistency")."""
        from dpfleet.secagg import round_terms
        from dpfleet.secagg.count_bit import input_length, terms_digest
        from dpfleet.secagg.params import fleet_margins, plan_round
        from dpfleet.secagg.setup_wire import encode_setup

        cfg, eng, plan = self.cfg, self.engine, cur.plan
        agg = cfg.aggregation
        disc = round_discretizer(cfg, plan.theta.size, plan.clip_norm,
                                 aggregation_seed(cfg.seed, plan.round, cur.attempt),
                                 eng.ring.ring_clients if eng.ring else None)
        identities = {u: self.keys[self.b.users[d]] for u, d in enumerate(plan.devices)}
        threshold = plan.count_threshold  # adaptive clipping: each device masks its bit too
        # the dropout the over-selection absorbs, and d missing reveals (the devices' policy
        # recomputes both from the same config: fleet.participant.local_policy)
        dropout, unrevealed = fleet_margins(len(plan.devices), cfg.dp.report_goal)
        setup, _, graph_plan = plan_round(len(plan.devices), input_length(disc, threshold), agg.bits,
                                 agg.graph, dropout=dropout, corruption=agg.corruption,
                                 unrevealed=unrevealed,
                                 signed=agg.signed, public_keys=identities if agg.signed else None,
                                 terms=round_terms.bind_round(
                                     terms_digest(disc, threshold), bytes.fromhex(model_sha),
                                     json.loads(dumps(shared_plan))))  # as the devices read it
        cur.secagg, cur.disc, cur.bounded = SecAggRound(setup), disc, graph_plan.bounded
        return {"setup": encode_setup(setup).hex(),
                "discretizer": {"length": disc.length, "clip_norm": disc.clip_norm,
                                "bits": disc.bits, "clients": disc.clients, "seed": disc.seed},
                "count_threshold": threshold}

    async def _phase_change_or_stop(self, sa, phase: str, limit: float) -> None:
        """Wait for the SecAgg phase to move on, its deadline, or a stop: Ctrl-C, SIGTERM or an
        operator's stop must not sit out a phase deadline (30 s by default, the masked phase's
        report deadline 120 s) before the service can save and exit."""
        changed = asyncio.ensure_future(sa.wait_phase_change(phase, limit))
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (changed, stopped):
                task.cancel()
            await asyncio.gather(changed, stopped, return_exceptions=True)

    async def _run_secagg(self, cur: OpenRound) -> Collected | Failed | None:
        sa, svc = cur.secagg, self.svc
        while not sa.finished and not self.stop_requested:
            phase, began = sa.phase, time.monotonic()
            limit = svc.report_deadline_s if phase == "masked" else svc.secagg_phase_deadline_s
            await self._phase_change_or_stop(sa, phase, limit)
            if self.stop_requested:
                return None
            if sa.phase == phase:  # the deadline passed: go on with whoever answered
                closing = time.perf_counter()
                await sa.close_phase(began + limit)
                cur.secagg_seconds += time.perf_counter() - closing
                self.log.event("phase_closed", round=cur.number, phase=phase)
            self._time(f"secagg_{phase}", time.monotonic() - began)
            self.fault(f"secagg_{phase}")
        if sa.phase != "done":
            return Failed(f"secure aggregation aborted: {sa.server.error}")
        survivors = list(sa.server.survivors)
        if short := survivors_short(self.cfg, cur.plan, len(survivors)):  # the driver's rule,
            return Failed(short)  # before a decode of too few inputs
        # the decode, the survivors' clipped count and the record: as `simulate`'s (`round_sum`);
        # the costs are the coordinator's (the devices' encoding is theirs, unseen: None)
        costs = RingCosts(bytes_sent=sa.bytes_in, bytes_received=sa.bytes_out(),
                          seconds=time.monotonic() - cur.opened_at, rejected_messages=sa.rejected)
        return Collected(ring_sum(sa.server.result(), cur.disc, sa.setup, survivors,
                                  counted=cur.plan.count_threshold is not None, bounded=cur.bounded,
                                  costs=costs), [NO_STATS] * len(cur.plan.devices))

    def closing(self, plan: RoundPlan) -> None:
        # the engine commits in the event loop's thread: the store's SQLite connection belongs
        # to it, and nothing may be answered about this round while its commit is under way
        self.current.state = "closing"
        self.fault("before_commit")

    def committed(self, plan: RoundPlan, record: dict, seconds: float) -> None:
        cur = self.current
        self._time("commit", seconds)
        inputs_in = cur.secagg.changed_at if cur.secagg is not None else cur.collected_at
        if cur.secagg is not None:
            cur.critical.update({f"secagg_{p}": t for p, t in cur.secagg.critical.items()})
        cur.state = "committed"
        self.outcomes[(cur.number, cur.attempt)] = "committed"
        self.current, self.ended_at = None, time.monotonic()
        self.history.append({"round": cur.number, "status": "committed",
                             "clients": record["clients"], "epsilon": record["epsilon"],
                             "accuracy": record["accuracy"], "loss": record["loss"],
                             "wall_s": time.monotonic() - cur.opened_at, "commit_s": seconds,
                             "secagg_server_s": cur.secagg_seconds if cur.secagg else None})
        self.log.event("commit", round=cur.number, attempt=cur.attempt, clients=record["clients"],
                       epsilon=record["epsilon"], accuracy=record["accuracy"])
        self.say(round_line(cur.number, self.cfg.rounds, record))
        self.held.wake(cur.positions)  # its participants wait to join the pool for the next round
        if inputs_in is not None:
            cur.critical["commit"] = time.monotonic() - inputs_in
        self.log.event("critical", round=cur.number, attempt=cur.attempt, seconds=cur.critical)
        self.fault("after_commit")
        self.selecting_since = time.monotonic()

    def failed(self, plan: RoundPlan, reason: str) -> None:
        """The round was abandoned (by the round driver, or as the coordinator stops)."""
        cur = self.current
        cur.state = "failed"
        self.store.fail_round(cur.number, reason)
        self.outcomes[(cur.number, cur.attempt)] = "failed"
        self.current, self.ended_at = None, time.monotonic()
        self.history.append({"round": cur.number, "status": "failed", "clients": 0,
                             "epsilon": None, "accuracy": None, "loss": None,
                             "wall_s": time.monotonic() - cur.opened_at, "reason": reason})
        self.log.event("fail", round=cur.number, attempt=cur.attempt, reason=reason)
        self.say(f"round {cur.number}/{self.cfg.rounds} failed (attempt {cur.attempt}): {reason}")
        self.held.wake(cur.positions)
        self.selecting_since = time.monotonic()

    async def _finish(self) -> None:
        b = self.b
        atomic_write(self.store.path / "metrics.jsonl",  # as `simulate` leaves it
                     "".join(dumps(m) + "\n" for m in self.store.log("metrics")))
        final, privacy = finish_run(
            self.store, self.engine, stopped_early=self.stopped_early,
            baseline=b.baseline, started=b.started,
            extra={"driver": "service", "rounds_failed": self.rounds_failed})
        summary = json.loads((self.store.path / "summary.json").read_text())
        self.outcome = {"final": final, "baseline": b.baseline, "privacy": privacy,
                        "warnings": summary.get("warnings", []), "stopped_early": self.stopped_early,
                        "run_dir": self.store.path, "initial": self.engine.initial,
                        "keyboard": summary.get("keyboard")}
        self.release = self._release(privacy.get("caveats", []))
        self.run_state = "finished"
        self.log.event("finish", accuracy=final.get("accuracy"), epsilon=privacy.get("epsilon"),
                       stopped_early=self.stopped_early)
        self.finished.set()
        self.held.wake_all()

    def _release(self, caveats: list[str]) -> str | None:
        """With a release policy: the finished model's bundle published in STATE/release when the
        run meets it, else nothing published; either way the one-line verdict, also logged."""
        if self.policy is None:
            return None
        try:
            summary = release_bundle(self.store.path, self.policy, caveats)
        except PolicyRefused as exc:
            self.log.event("release_refused", reason=str(exc))
            self.say(f"release: {exc}")
            return str(exc)
        except DpfleetError as exc:  # the export itself failed: the run stands, nothing published
            self.log.event("release_failed", reason=str(exc))
            self.say(f"release failed: {exc}")
            return f"release failed: {exc}"
        line = f"released: the model passed {self.policy.name}; signed bundle in {summary['bundle']}"
        self.log.event("release", bundle=summary["bundle"], policy_sha256=self.policy.sha256)
        self.say(line)
        return line

    # ------------------------------------------------------------------ reads for admin

    @property
    def rounds_failed(self) -> int:
        return sum(1 for h in self.history if h["status"] == "failed")

    def epsilon(self) -> float:
        """eps spent by the committed rounds: the last metrics record's, the run's ledger's figure
        (`RunAccountant.record`; never converted here, so status and privacy.json agree). Every
        committed round has one with the DP fields; a record without the key is skipped, never a
        500. A stored null is eps = inf (no noise: JSON has no inf); 0 before any round."""
        for m in reversed(self.engine.metrics):
            if "epsilon" in m:
                eps = m["epsilon"]
                return math.inf if eps is None else float(eps)
        return 0.0

    def last_accuracy(self) -> float | None:
        for m in reversed(self.engine.metrics):
            if m.get("accuracy") is not None:
                return float(m["accuracy"])
        return None

    def phase(self) -> str:
        cur = self.current
        if self.run_state == "finished":
            return "finished"
        if cur is None:
            return "selecting"
        if cur.state == "closing":
            return "committing"
        return f"secagg_{cur.secagg.phase}" if cur.secagg is not None else "training"

    def device_counts(self) -> dict:
        now = time.monotonic()
        training = 0
        cur = self.current
        if cur is not None:
            done = set(cur.plain.updates) if cur.plain is not None else set()
            training = len(cur.positions) - len(done)
        return {"registered": len(self.keys), "waiting": sum(1 for t in self.pool.values() if t > now),
                "training": training, "refused_timer": len(self.refused_timer)}

    def mean_phase_seconds(self) -> dict:
        return {p: float(np.mean(v)) for p, v in self.phase_seconds.items() if v}

    def round_number(self) -> int:
        return self.current.number if self.current is not None else self.engine.next_round + 1

    def status(self) -> dict:
        return {
            "run_state": self.run_state, "round": self.round_number(), "phase": self.phase(),
            "rounds_committed": self.store.last_committed(), "rounds_failed": self.rounds_failed,
            "rounds_planned": self.cfg.rounds, "epsilon": self.epsilon(),
            "delta": self.cfg.dp.delta, "last_accuracy": self.last_accuracy(),
            "devices": self.device_counts(), "phase_seconds": self.mean_phase_seconds(),
            "started_at": self.started_at, "uptime_s": time.time() - self.started_at,
            "release": self.release,
        }

    def history_json(self) -> dict:
        counts = np.bincount(self.engine.participation.guard.count) if self.b.users else []
        histogram = {str(k): int(v) for k, v in enumerate(counts) if v}
        return {"rounds": self.history, "participation_histogram": histogram,
                "device_states": self.device_counts()}


def round_line(number: int, planned: int, record: dict) -> str:
    """The console's line for a committed round: its number of the planned, its devices, eps
    spent so far (inf without noise: a null in the record), accuracy when it was evaluated."""
    eps = record.get("epsilon")
    line = (f"round {number}/{planned} committed: {record['clients']} devices, eps "
            f"{'inf' if eps is None else format(eps, '.3f')} so far")
    if record.get("accuracy") is not None:
        line += f", accuracy {record['accuracy']:.4f}"
    return line


def allowed_waiting(guard: ParticipationGuard, waiting, round_idx: int) -> tuple[list[int], int]:
    """(the waiting devices the guard allows in `round_idx`, ascending; how many devices it
    allows in all), from its refused set: O(waiting + recent participants), so opening a round
    never builds a mask over every registered device (the same answer as `allowed(r)`)."""
    ids = np.sort(np.fromiter(waiting, np.int64))
    return ids[guard.allows(ids, round_idx)].tolist(), guard.last.size - guard.blocked(round_idx).size
