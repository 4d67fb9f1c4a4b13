"""ONE device's part in one assignment: download by hash, train its own examples, clip, then
report (plain) or run SecAgg over the link.

Why the device decides so much itself: the coordinator is not trusted with what it could bend.
The plan and model are checked against their hashes (`link.blob`), and in SecAgg downloaded
before the first message and bound into the setup (`secagg/round_terms.py`: devices given
different models never share a sum); training uses the plan's
client seed with the same trainer code as `simulate` (`backends.SequentialTrainer`:
`client_update`), so an honest network run equals the in-process one; in SecAgg the device's
`ClientPolicy` is configured locally (never from the server) and the identity keys it checks
the setup against are the fleet's, pinned out of band: a setup naming any other key is refused
before the device sends a single byte of the round.

Hooks for the emulated fleet: `before_phase(phase)` (sync or async; raise `DropOut` to vanish
silently, or sleep to be slow) is called before each message the device would send, phases
"train", "report" (plain) or "commit", "advertise", "share", "mask", "consistency", "unmask"
(SecAgg); `speed` stretches the measured training time (2.0: a phone twice as slow).

Whose randomness rounds the update to the SecAgg ring: the device's own, unless it was set up
for a research-mode run (`research_rounding`, a test fleet's: `serve` refuses `dp.noise_seed`),
where it takes the assignment's `rounding_seed` so that the run releases `simulate`'s bits. A
device not set up so ignores that field and rounds with its own randomness: it cannot tell a
research run from a coordinator that wants to know (or choose) its rounding, and ignoring the
field leaves it exactly as private as without one, while refusing would only fail the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from dpfleet.coordinator.engine.backends import SequentialTrainer
from dpfleet.edge.bundle_format import BundleError
from dpfleet.edge.client_update import ClientUpdate
from dpfleet.edge.wire.messages import device_plan
from dpfleet.export.models import ModelConfig
from dpfleet.fleet.link import CoordinatorLink, LinkError

Hook = Callable[[str], Awaitable[None] | None]
# the client message the SecAggClient sends next, by its phase
_NEXT_MESSAGE = {"new": "commit", "committed": "advertise", "advertised": "share",
                 "shared": "mask", "masked": "consistency", "checked": "unmask"}


class DropOut(Exception):
    """Raised by a `before_phase` hook: the device vanishes from the round (sends nothing more)."""


@dataclass
class Outcome:
    """How the device's part ended: "reported", "secagg_done", "dropped", "refused_setup",
    "refused_bundle" (not the pinned key's bundle, or a plan it does not train), "aborted"
    (SecAgg abort), "stale" (the round closed without it) or "failed"."""

    kind: str
    detail: str = ""
    update: ClientUpdate | None = None  # what it trained (tests compare sums against it)
    train_seconds: float = 0.0
    # CPU seconds of this device's own work by step ("train", "setup", "encode" and the SecAgg
    # client's message handling by the message it answered): what the load benchmark splits a
    # round's non-training time with. Thread CPU time, so waiting and other devices never count.
    cpu: dict[str, float] = field(default_factory=dict)


_RUNTIMES: dict[str, tuple[object, threading.Lock]] = {}


def runtime_for(plan: dict, threads: int = 1, cache_dir: Path | None = None
                ) -> tuple[object, threading.Lock]:
    """The plan's training runtime, built once per (runtime, model) in this process, and the
    lock that lets one emulated device at a time hold its weights."""
    key = json.dumps([plan["runtime"], plan["model"], plan["seq_len"]], sort_keys=True)
    if key not in _RUNTIMES:
        from dpfleet.edge.runtimes import make_runtime

        runtime = make_runtime(plan["runtime"], ModelConfig(**plan["model"]), plan["seq_len"],
                               threads, cache_dir or Path(tempfile.gettempdir()) / "dpfleet-programs")
        _RUNTIMES[key] = (runtime, threading.Lock())
    return _RUNTIMES[key]


def local_policy(report_goal: int, graph: str, corruption: float, n: int):
    """The minimums a device configured with the fleet's own config demands of a round of n:
    at least the report goal, and the masking degree / threshold / corruption that config plans
    for n (`secagg.graph.plan_graph` with the dropout and the d missing graph-seed reveals of
    `secagg.params.fleet_margins`, as the coordinator plans it), no more missing reveals than
    d, signed mode always."""
    from dpfleet.secagg.params import fleet_margins
    from dpfleet.secagg.policy import ClientPolicy

    dropout, unrevealed = fleet_margins(n, min(report_goal, n))
    plan = _graph_plan(n, graph, dropout, corruption, unrevealed)
    return ClientPolicy(min_clients=report_goal, min_degree=plan.k, min_threshold=plan.threshold,
                        min_corrupt=plan.corrupt, require_signed=True,
                        max_unrevealed=unrevealed)


@lru_cache(maxsize=64)
def _graph_plan(n: int, graph: str, dropout: float, corruption: float, unrevealed: int):
    """`plan_graph` is a pure function of its arguments and costs ~10-25 ms (tail sums): every
    device of every round would recompute the same plan."""
    from dpfleet.secagg.graph import plan_graph

    return plan_graph(n, graph, dropout, corruption, unrevealed=unrevealed)


class CpuClock:
    """Adds up the calling thread's CPU seconds per step (`with clock("keys"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str):
        began = time.thread_time()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.thread_time() - began


async def _hook(hook: Hook | None, phase: str) -> None:
    if hook is not None:
        result = hook(phase)
        if inspect.isawaitable(result):
            await result


async def train(link: CoordinatorLink, assignment: dict, examples: np.ndarray, *, speed: float = 1.0,
                threads: int = 1, bundle_key=None, cpu: CpuClock | None = None,
                received: tuple[dict, bytes] | None = None) -> tuple[dict, ClientUpdate, float]:
    """(plan, clipped update, wall seconds) for this device's examples on the assigned model;
    with `bundle_key` (the pinned bundle public key) through the run's signed bundle.
    `received`: the (plan, model bytes) already downloaded, so that training uses exactly the
    model a SecAgg setup was checked against (None: downloaded here)."""
    cpu = cpu or CpuClock()
    if received is None:
        received = (device_plan(await link.blob(assignment["plan_sha256"]), assignment),
                    await link.blob(assignment["model_sha256"]))
    plan, model = received
    theta = np.frombuffer(model, dtype="<f4").astype(np.float32)
    await link.blob(plan["tokenizer_sha256"])  # what a phone would tokenize its text with
    if bundle_key is not None:
        from dpfleet.fleet.bundle_device import check_plan, fetch_bundle, train_update

        client, lock = await fetch_bundle(link, assignment.get("bundle"), bundle_key)
        check_plan(client, plan, theta)
        step = lambda: train_update(client, plan, theta, examples)  # noqa: E731
    else:
        runtime, lock = runtime_for(plan, threads)
        step = lambda: SequentialTrainer(runtime).train_round(  # noqa: E731
            theta, [examples], [int(plan["client_seed"])], lr=plan["lr"],
            batch_size=plan["batch_size"], clip_norm=plan["clip_norm"])[0]
    seconds = 0.0

    def run() -> ClientUpdate:
        nonlocal seconds
        with lock:
            began = time.perf_counter()
            with cpu("train"):
                out = step()
            seconds = time.perf_counter() - began
            return out

    update = await asyncio.to_thread(run)
    if speed > 1.0:
        await asyncio.sleep(seconds * (speed - 1.0))
    return plan, update, seconds * max(speed, 1.0)


async def take_part(link: CoordinatorLink, assignment: dict, examples: np.ndarray, *,
                    policy=None, pinned: Mapping[str, bytes] | None = None,
                    before_phase: Hook | None = None, speed: float = 1.0,
                    threads: int = 1, bundle_key=None,
                    bundle_serials: dict[str, int] | None = None,
                    research_rounding: bool = False) -> Outcome:
    """Run this device's part of `assignment` to the end. `policy`: a `ClientPolicy`, or a
    callable n -> ClientPolicy (`local_policy`); `pinned`: device id -> identity public key,
    the fleet registry the device got out of band (SecAgg); `bundle_key`: the run's bundle
    public key, also pinned out of band: the device trains only with a bundle it signed, and
    refuses the round ("refused_bundle", nothing sent) otherwise; `bundle_serials`: the
    device's {key hex: highest bundle serial accepted}, below which it refuses (a rollback);
    `research_rounding`: take a SecAgg assignment's `rounding_seed` (else ignore it, see above)."""
    try:
        if bundle_key is not None:  # before any byte of the round is sent (SecAgg commit too)
            from dpfleet.fleet.bundle_device import fetch_bundle

            await fetch_bundle(link, assignment.get("bundle"), bundle_key, bundle_serials)
        if assignment["aggregation"] == "secagg":
            return await _secagg(link, assignment, examples, policy, pinned, before_phase, speed,
                                 threads, bundle_key, research_rounding)
        await _hook(before_phase, "train")
        cpu = CpuClock()
        _, update, seconds = await train(link, assignment, examples, speed=speed, threads=threads,
                                         bundle_key=bundle_key, cpu=cpu)
        await _hook(before_phase, "report")
        await link.report(assignment["round"], assignment["attempt"], update.delta,
                          norm=update.norm, clipped=update.clipped, loss=update.loss)
        return Outcome("reported", update=update, train_seconds=seconds, cpu=cpu.seconds)
    except DropOut as exc:
        return Outcome("dropped", str(exc))
    except BundleError as exc:
        return Outcome("refused_bundle", str(exc))
    except LinkError as exc:
        if exc.status in (409, 410):
            return Outcome("stale", exc.message)
        return Outcome("failed", str(exc))


async def _send(link, number: int, attempt: int, data: bytes, cursor: int, wait: bool):
    """Post one SecAgg message; with `wait` and a link that merges posts with polls
    (`CoordinatorLink.merge_posts`), the reply is the mail from `cursor` on (else None)."""
    if wait and getattr(link, "merge_posts", False):
        return await link.secagg_send_poll(number, attempt, data, cursor)
    await link.secagg_send(number, attempt, data)
    return None


def _secagg_setup(link, assignment: dict, plan_bytes: bytes, model: bytes, policy, pinned):
    """(plan, setup, discretizer, count threshold, SecAgg client) of one assignment, checked: the
    setup must sign the vector's length, the clipped bit's slot and the round's terms, bound to
    the SHA-256 of the plan and model bytes received (never the server's name for them alone)."""
    from dpfleet.secagg import round_terms
    from dpfleet.secagg.client import SecAggClient
    from dpfleet.secagg.count_bit import check_layout, terms_digest
    from dpfleet.secagg.encoding import Discretizer
    from dpfleet.secagg.setup_wire import decode_setup

    plan = device_plan(plan_bytes, assignment)
    setup = decode_setup(bytes.fromhex(assignment["secagg"]["setup"]))
    disc = Discretizer(**assignment["secagg"]["discretizer"])
    threshold = assignment["secagg"].get("count_threshold")  # adaptive clipping's C^t
    threshold = None if threshold is None else float(threshold)
    terms = round_terms.bind_round(terms_digest(disc, threshold), round_terms.model_digest(model), plan)
    check_layout(setup, disc, threshold, terms)  # the length, bit slot and terms it signs
    if callable(policy):
        policy = policy(setup.n)
    pins = {u: pinned[d] for u, d in enumerate(assignment["devices"]) if pinned and d in pinned}
    client = SecAggClient(setup, assignment["position"], link.key if setup.signed else None, policy,
                          pins if pinned is not None else None)
    return plan, setup, disc, threshold, client


def _rounding(assignment: dict, research_rounding: bool) -> np.random.Generator:
    """The generator that rounds this device's update to the ring: its own (the coordinator never
    learns it), or, set up for research runs and sent one, the assignment's keyed one
    (`secagg.encoding.rounding_rng`; a malformed seed is a ValueError: the round is refused
    before any message)."""
    from dpfleet.secagg.encoding import rounding_rng

    seed = assignment.get("rounding_seed")
    if seed is None or not research_rounding:
        return np.random.default_rng()
    return rounding_rng(seed)


async def _secagg(link, assignment, examples, policy, pinned, before_phase, speed, threads,
                  bundle_key=None, research_rounding=False) -> Outcome:
    from dpfleet.coordinator.engine.adaptive_clipping import clipped_bit
    from dpfleet.secagg.count_bit import append_bit
    from dpfleet.secagg.errors import SecAggError

    number, attempt = assignment["round"], assignment["attempt"]
    cpu = CpuClock()
    # the plan and model before the first SecAgg message: the setup must bind the very model
    # bytes this device trains on (THREAT_MODEL.md, "Model consistency")
    plan_bytes = await link.blob(assignment["plan_sha256"])
    model = await link.blob(assignment["model_sha256"])
    try:
        with cpu("setup"):
            plan, setup, disc, threshold, client = _secagg_setup(link, assignment, plan_bytes, model,
                                                                 policy, pinned)
            rng = _rounding(assignment, research_rounding)
    except (SecAggError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return Outcome("refused_setup", f"{type(exc).__name__}: {exc}", cpu=cpu.seconds)
    training = asyncio.ensure_future(train(link, assignment, examples, speed=speed,
                                           threads=threads, bundle_key=bundle_key, cpu=cpu,
                                           received=(plan, model)))
    update, seconds = None, 0.0

    def outcome(kind: str, detail: str = "") -> Outcome:
        return Outcome(kind, detail, update, seconds, cpu.seconds)

    try:
        await _hook(before_phase, "commit")
        with cpu("commit"):
            first = client.start()
        cursor, mail = 0, None
        for j, out in enumerate(first, 1):
            mail = await _send(link, number, attempt, out.data, cursor, j == len(first))
        while client.phase not in ("done", "aborted"):
            if mail is None:
                mail = await link.secagg_poll(number, attempt, cursor)
            (messages, cursor, _), mail = mail, None
            if not messages:
                status = await link.round_status(number, attempt)
                if status["state"] != "open":
                    return outcome("stale", f"round {number} is {status['state']}")
                continue
            for k, data in enumerate(messages, 1):
                if client.phase == "shared" and update is None:  # masking needs the input
                    _, update, seconds = await training
                    with cpu("encode"):
                        values = disc.encode(update.delta, rng).values
                        if threshold is not None:  # the clipped bit, masked with the update
                            values = append_bit(values, clipped_bit(update.norm, threshold))
                        client.provide_input(values)
                phase = _NEXT_MESSAGE.get(client.phase)
                if phase == "consistency" and not setup.signed:
                    phase = "unmask"
                with cpu(phase or "other"):
                    replies = client.handle(data)
                for j, out in enumerate(replies, 1):
                    await _hook(before_phase, phase)
                    # only the device's last send before it would poll waits for mail (an
                    # earlier one would hold its own next message); its part's end waits for none
                    wait = (k, j) == (len(messages), len(replies)) and client.phase not in (
                        "done", "aborted")
                    mail = await _send(link, number, attempt, out.data, cursor, wait)
        if client.phase == "aborted":
            return outcome("aborted", "the server aborted the round")
        return outcome("secagg_done")
    except DropOut as exc:
        return outcome("dropped", str(exc))
    except SecAggError as exc:
        return outcome("aborted", f"{type(exc).__name__}: {exc}")
    finally:
        if not training.done():
            training.cancel()
