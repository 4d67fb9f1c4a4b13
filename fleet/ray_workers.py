"""`dpfleet fleet emulate --backend ray`: the fleet's worker processes placed on Ray actors.

Why Ray: one machine's cores bound how many devices can train at once; a Ray cluster (`ray start
--head` on one machine, `ray start --address HEAD:6379` on the others, the same dpfleet install
on each) spreads the workers over its machines while this process keeps the parent's role. Each
worker is one actor (one CPU) running the unchanged `worker.worker_main` on its slice of devices,
so the devices, their keys, behaviour, timers and reports are exactly the local fleet's; the
actors talk to the coordinator over HTTP themselves, so its URL must be reachable from every node
(`serve --listen 0.0.0.0:PORT`, not 127.0.0.1, on a real cluster).

Messages (counts, timers, the final summary) come back through a `ray.util.queue.Queue` instead
of a multiprocessing queue, and `ActorWorker` gives an actor the handle the parent's
watch-and-restart loop (`emulate.Fleet.poll`) expects of a process, so the kill / restart
semantics are the local fleet's: a worker whose actor dies (killed, node lost) is started again
on a fresh actor with its devices' timers, up to `emulate.MAX_RESTARTS` times. An actor has no
exit code; a dead actor reports -1 and a worker that raised reports 1.
"""

from __future__ import annotations

import os
import socket

from dpfleet.coordinator.engine.ray_backend import connect_ray
from dpfleet.errors import DpfleetError
from dpfleet.fleet.emulate import Fleet
from dpfleet.fleet.worker import ONE_THREAD_ENV, WorkerSpec, worker_main

PLACE_TIMEOUT_S = 120.0  # an actor not running by then: the cluster has no free CPU for it


class _FleetActor:
    """One fleet worker on Ray; max_concurrency 2 so `where` answers while `run` runs."""

    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    def run(self, spec: WorkerSpec, events) -> None:
        worker_main(spec, events)


class ActorWorker:
    """A started fleet worker on a Ray actor, with a process's pid / is_alive / join / exitcode
    / terminate / kill."""

    def __init__(self, ray, actor_cls, spec: WorkerSpec, events, place_timeout: float):
        self._ray, self.exitcode = ray, None
        self.actor = actor_cls.remote()
        self.ref = self.actor.run.remote(spec, events)
        try:
            self.host, self.pid = ray.get(self.actor.where.remote(), timeout=place_timeout)
        except ray.exceptions.GetTimeoutError as exc:
            ray.kill(self.actor, no_restart=True)
            raise DpfleetError(f"Ray did not start fleet worker {spec.worker} within "
                               f"{place_timeout:.0f} s: the cluster needs one free CPU per "
                               "--processes") from exc

    def is_alive(self) -> bool:
        ready, _ = self._ray.wait([self.ref], timeout=0)
        if not ready:
            return True
        if self.exitcode is None:
            try:
                self._ray.get(self.ref)
                self.exitcode = 0
            except self._ray.exceptions.RayActorError:
                self.exitcode = -1  # the actor's process died
            except self._ray.exceptions.RayTaskError:
                self.exitcode = 1  # the worker raised
        return False

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self.ref], timeout=timeout)

    def terminate(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    kill = terminate


class RayFleet(Fleet):
    """`emulate.Fleet` with its workers on Ray actors (module docstring)."""

    def __init__(self, *args, address: str = "", place_timeout: float = PLACE_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.ray = connect_ray(address, len(self.specs), "fleet emulate --backend ray")
        from ray.util.queue import Queue

        self.address, self.place_timeout = address, place_timeout
        self.events = Queue(actor_options={"num_cpus": 0})  # takes no worker's CPU
        # Same environment as a local worker process: one BLAS thread (worker.one_blas_thread).
        self.actor_cls = self.ray.remote(num_cpus=1, max_concurrency=2,
                                         runtime_env={"env_vars": dict(ONE_THREAD_ENV)})(_FleetActor)

    def _start_worker(self, spec: WorkerSpec) -> ActorWorker:
        worker = ActorWorker(self.ray, self.actor_cls, spec, self.events, self.place_timeout)
        self.log(f"worker {spec.worker}: Ray actor on {worker.host}")
        return worker

    def summary(self, wall_s: float) -> dict:
        out = super().summary(wall_s)
        out["placement"] = {"backend": "ray", "address": self.address or "local",
                            "hosts": sorted({p.host for p in self.procs.values()})}
        return out
