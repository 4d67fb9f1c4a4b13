"""Run one SecAgg round with every party in this process: the simulation transport.

Messages travel as bytes through the same `handle()` calls a network shell would make, so the
simulation exercises the real encoding and checks. Clients can drop out before any of the
messages they would send (`dropouts`), and an `intercept` hook sees every message in flight
and may drop, alter, duplicate or add to it -- that is how the adversarial tests attack the
protocol. Rejected messages are recorded, never fatal, exactly as a server would log and
ignore them; a round that falls below the threshold raises `ThresholdError`.

Clients are run one after the other and each masked input is folded into the server's sum as
soon as it is produced, so memory stays at a few vectors however many clients take part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.progress import progress_bar
from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.errors import SecAggError
from dpfleet.secagg.graph import Graph
from dpfleet.secagg.identity_keys import pinned_keys
from dpfleet.secagg.messages import SERVER, Outbound
from dpfleet.secagg.params import RoundSetup
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.server import SecAggServer

# The client message of each phase, in protocol order; a dropout is keyed by the first one a
# client fails to send. The server phase collecting it is the matching SecAggServer.phase.
PHASES = ("commit", "advertise", "share", "mask", "consistency", "unmask")
_SERVER_PHASE = dict(
    zip(("commit", "keys", "shares", "masked", "consistency", "unmask"), PHASES, strict=True)
)

Intercept = Callable[[str, int, int, bytes], Sequence[bytes]]


@dataclass
class Rejection:
    """A message a party refused: in which phase, from whom, to whom, and why."""

    phase: str
    sender: int
    recipient: int
    error: SecAggError


@dataclass
class RoundReport:
    """The unmasked sum and what the round cost each party."""

    total: np.ndarray  # sum of the survivors' inputs in Z_(2^bits)
    survivors: tuple[int, ...]
    client_seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # phase -> client
    server_seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    bytes_sent: dict[int, int] = field(default_factory=dict)  # client -> bytes it sent
    bytes_received: dict[int, int] = field(default_factory=dict)  # client -> bytes it received
    phase_bytes_sent: dict[str, int] = field(default_factory=dict)  # phase -> all clients' bytes
    phase_bytes_received: dict[str, int] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)
    graph: Graph | None = None  # the masking graph the clients' reveals produced
    inconsistent: dict[int, list[int]] = field(default_factory=dict)  # owner -> bad holders
    aborted: SecAggError | None = None  # set instead of raising when raise_on_abort=False


def run_round(
    setup: RoundSetup,
    inputs: Callable[[int], np.ndarray],
    identities: Mapping[int, Ed25519PrivateKey] | None = None,
    dropouts: Mapping[str, Collection[int]] | None = None,
    intercept: Intercept | None = None,
    progress: bool = False,
    policy: ClientPolicy | None = None,
    raise_on_abort: bool = True,
) -> RoundReport:
    """One round over clients 0..n-1. `inputs(u)` returns client u's ring vector (asked for
    only when u is about to mask, so inputs can be produced lazily); `dropouts[phase]` lists
    the clients that vanish before sending that phase's message. In signed mode
    `identities` is the emulated fleet: each device pins the fleet's public keys from it,
    never from the setup. `policy` is every device's local policy (None: lenient, as every
    party is in this process)."""
    unknown = set(dropouts or {}) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown dropout phases {sorted(unknown)}; phases are {PHASES}")
    return _Round(setup, inputs, identities, dropouts or {}, intercept, progress, policy,
                  raise_on_abort).run()


class _Round:
    """One in-process round: the parties, who has vanished, and what it all cost."""

    def __init__(self, setup, inputs, identities, dropouts, intercept, progress, policy,
                 raise_on_abort) -> None:
        self.setup, self.inputs, self.dropouts = setup, inputs, dropouts
        self.intercept = intercept or (lambda phase, sender, recipient, data: [data])
        self.progress, self.raise_on_abort = progress, raise_on_abort
        self.server = SecAggServer(setup)
        pinned = pinned_keys(identities) if identities else None
        self.clients = {u: SecAggClient(setup, u, identities[u] if identities else None,
                                        policy or ClientPolicy.lenient(), pinned)
                        for u in range(setup.n)}
        self.gone: set[int] = set()
        self.report = RoundReport(
            total=np.zeros(0, dtype=setup.dtype), survivors=(),
            client_seconds={p: {} for p in PHASES}, server_seconds=dict.fromkeys(PHASES, 0.0),
            bytes_sent=dict.fromkeys(range(setup.n), 0),
            bytes_received=dict.fromkeys(range(setup.n), 0),
            phase_bytes_sent=dict.fromkeys(PHASES, 0),
            phase_bytes_received=dict.fromkeys(PHASES, 0),
        )

    def run(self) -> RoundReport:
        phase, batch = "commit", [(u, None) for u in range(self.setup.n)]
        while True:
            collecting = self.server.phase
            following = self._client_step(phase, batch)
            if self.server.phase == collecting:  # someone stayed silent: the deadline passes
                started = time.perf_counter()
                following = self.server.close_phase()
                self.report.server_seconds[phase] += time.perf_counter() - started
            if self.server.phase not in _SERVER_PHASE:
                break
            phase = _SERVER_PHASE[self.server.phase]
            batch = [(o.recipient, o.data) for o in following]
        for notice in following:  # abort notices, if any
            self._deliver("abort", SERVER, notice.recipient, notice.data,
                          self.clients[notice.recipient].handle)
        self.report.graph = self.server.graph
        self.report.inconsistent = self.server.inconsistent
        if self.server.phase == "aborted":
            if self.raise_on_abort:
                raise self.server.error
            self.report.aborted = self.server.error
            return self.report
        self.report.total = self.server.result()
        self.report.survivors = self.server.survivors
        return self.report

    def _client_step(self, phase: str, batch: list[tuple[int, bytes | None]]) -> list[Outbound]:
        """Deliver each server message and pass the client's reply straight to the server.
        Returns what the server sent when the phase filled up (nothing while it is open)."""
        following: list[Outbound] = []
        for u, data in progress_bar(batch, desc=phase, enabled=self.progress, terminal_only=False,
                                    leave=False):
            if u in self.gone or u in self.dropouts.get(phase, ()):
                self.gone.add(u)
                continue
            if phase == "mask":
                self.clients[u].provide_input(self.inputs(u))
            for reply in self._to_client(phase, u, data):
                self.report.bytes_sent[u] += len(reply.data)
                self.report.phase_bytes_sent[phase] += len(reply.data)
                for wire in self.intercept(phase, u, SERVER, reply.data):
                    out, seconds = self._deliver(phase, u, SERVER, wire, self.server.handle)
                    self.report.server_seconds[phase] += seconds
                    following.extend(out)
        return following

    def _to_client(self, phase: str, u: int, data: bytes | None) -> list[Outbound]:
        client = self.clients[u]
        if data is None:
            started = time.perf_counter()
            replies = client.start()
            self.report.client_seconds[phase][u] = time.perf_counter() - started
            return replies
        replies: list[Outbound] = []
        for wire in self.intercept(phase, SERVER, u, data):
            self.report.bytes_received[u] += len(wire)
            self.report.phase_bytes_received[phase] += len(wire)
            out, seconds = self._deliver(phase, SERVER, u, wire, client.handle)
            self.report.client_seconds[phase][u] = (
                self.report.client_seconds[phase].get(u, 0.0) + seconds)
            replies.extend(out)
        return replies

    def _deliver(self, phase, sender, recipient, wire, handle) -> tuple[list[Outbound], float]:
        started = time.perf_counter()
        try:
            out = handle(wire)
        except SecAggError as exc:
            self.report.rejections.append(Rejection(phase, sender, recipient, exc))
            out = []
        return out, time.perf_counter() - started
