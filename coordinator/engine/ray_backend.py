"""`[backend] kind = "ray"`: a round's cohort sharded over Ray workers.

Each worker is a Ray actor holding one `CohortTrainer` (CPU, one torch thread, or its GPU when the
cluster gives it one); the coordinator sends the round's model once (`ray.put`) and each worker
its shard of clients, and gets back every client's clipped update, so secure aggregation, adaptive
clipping and accounting see exactly what the local backend gives them. Shards are balanced by
minibatch count (longest first, to the least loaded worker) and fixed by the round's data, so a
config gives the same shards on every run; the results equal the local cohort's up to float
rounding of different chunk compositions (tests/test_ray_backend.py: 1e-6 on deltas).

Precision: each worker resolves `client.precision` on its own CPU (`dpfleet.edge.precision`),
and the cohort then trains at one precision. "auto" is bfloat16 only where every worker's CPU has
native BF16; on a cluster where some lack it every worker runs float32, and summary.json says
which hosts lacked it. Not a mixed cohort: which shard trains on which node is Ray's placement, so
a mixed cohort's round would change from one run to the next, and a resume point records one
precision. An explicit "bfloat16" with a worker lacking BF16 is one error line naming its host.
At bfloat16 each worker builds the C kernels for its own CPU and compiler; summary.json and the
resume points keep the workers' builds (`cluster_kernels`), as a local run keeps its own.

Local: `address = ""` starts a private Ray instance with `workers` CPUs. A real cluster:
`ray start --head` on one machine, `ray start --address HEAD_IP:6379` on the others, then
`address = "HEAD_IP:6379"` (or "auto" on a cluster node) in `[backend]`.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence

import numpy as np

from dpfleet.edge.client_update import ClientUpdate
from dpfleet.edge.minibatch import batches
from dpfleet.edge.precision import PRECISIONS, Precision, resolve_precision
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig


class _Worker:
    """One Ray actor: a CohortTrainer on the worker's device, reused for every round. Built by
    `start` once the driver has chosen the cohort's precision from every worker's `cpu`."""

    def __init__(self, cfg: ModelConfig, seq_len: int, batch_size: int, memory_mb: int, device: str):
        import torch

        torch.set_num_threads(1)
        self.args = (cfg, seq_len, batch_size, memory_mb, device)
        self.trainer = None

    def cpu(self, size_rule: bool = True) -> tuple[str, Precision]:
        """(host, what "auto" resolves to on this worker's CPU: for this model's size with
        `size_rule`, else for the CPU alone, which is what an explicit "bfloat16" needs)."""
        import socket

        from dpfleet.edge.cohort import model_params

        cfg, device = self.args[0], self.args[4]
        params = model_params(cfg) if size_rule else None
        return socket.gethostname(), resolve_precision("auto", device, params=params)

    def start(self, precision: str) -> None:
        from dpfleet.edge.cohort import CohortTrainer

        cfg, seq_len, batch_size, memory_mb, device = self.args
        self.trainer = CohortTrainer(cfg, seq_len=seq_len, batch_size=batch_size, device=device,
                                     memory_mb=memory_mb, precision=precision)

    def kernels(self) -> tuple[str, dict[str, str]]:
        """(host, the elementwise kernels this worker's cohort runs: `CohortTrainer.elementwise`)."""
        import socket

        return socket.gethostname(), self.trainer.elementwise

    def train(self, theta0, examples, seeds, lr, batch_size, clip_norm):
        return self.trainer.train_round(theta0, examples, seeds, lr=lr, batch_size=batch_size,
                                        clip_norm=clip_norm)


def shards(steps: Sequence[int], workers: int) -> list[list[int]]:
    """Client indices per worker: longest first to the least loaded worker (ties: lowest index)."""
    heap = [(0, w) for w in range(workers)]
    out: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(steps)), key=lambda i: -steps[i]):
        load, w = heapq.heappop(heap)
        out[w].append(i)
        heapq.heappush(heap, (load + steps[i], w))
    return [sorted(s) for s in out]


def cluster_precision(requested: str, workers: Sequence[tuple[str, Precision]]) -> Precision:
    """The one precision a cohort trains at, from `client.precision` and each worker's (host, "auto"
    resolved on its CPU): module docstring. "bfloat16" where a worker lacks it: a DpfleetError."""
    if requested not in PRECISIONS:
        raise DpfleetError(f"client.precision must be one of {PRECISIONS}, not {requested!r}")
    if requested == "float32":
        return resolve_precision("float32")
    hosts = sorted({host for host, _ in workers})
    lacking = sorted({host for host, p in workers if p.name != "bfloat16"})
    why = {host: p.reason.removeprefix("auto: ") for host, p in workers}
    if not lacking:
        head = "auto: every" if requested == "auto" else "precision = 'bfloat16': every"
        return Precision("bfloat16", f"{head} Ray worker's CPU has native BF16 ("
                         + "; ".join(f"{h}: {why[h].removeprefix('CPU has ')}" for h in hosts) + ")")
    first = f"{lacking[0]}: {why[lacking[0]]}"
    if requested == "bfloat16":
        raise DpfleetError(f"client.precision = 'bfloat16' but the Ray workers on {', '.join(lacking)} "
                           f"have no native BF16 ({first}); use 'auto' or 'float32'")
    if lacking == hosts:
        return Precision("float32", f"auto: no Ray worker's CPU has native BF16 ({first})")
    return Precision("float32", f"auto: the Ray workers on {', '.join(lacking)} have no native BF16 "
                     f"({first}), so every worker runs float32: one precision for the cohort keeps a "
                     "round's result independent of which node trained which shard")


def cluster_kernels(workers: Sequence[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """summary.json's `elementwise` and `kernels` from each worker's (host, its cohort's): the
    one build where all workers run it, else each host's, in host order (which shard a build
    trains is Ray's placement, so such a run's bfloat16 bits are not reproducible; summary.json
    says so by listing them)."""
    builds = {host: built for host, built in workers if built}
    if not builds:
        return {}
    if len({tuple(b.items()) for b in builds.values()}) == 1:
        return next(iter(builds.values()))
    hosts = sorted(builds)
    return {"elementwise": "; ".join(f"{h}: {builds[h]['elementwise']}" for h in hosts),
            "kernels": " + ".join(dict.fromkeys(builds[h]["kernels"] for h in hosts))}


def connect_ray(address: str, num_cpus: int, what: str):
    """The `ray` module, connected: to the cluster at `address` ("HOST:6379" or "auto"), or to a
    private local instance with `num_cpus` CPUs when `address` is empty. Reuses a connection this
    process already has. `what` names the feature in the error when Ray is missing."""
    try:
        import ray
    except ImportError as exc:
        raise DpfleetError(f"{what} needs Ray: pip install 'dpfleet[ray]'") from exc
    if not ray.is_initialized():
        try:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            hint = ("; a cluster started with token auth (`ray start`'s default) needs "
                    "RAY_AUTH_MODE=token here" if address and "RAY_AUTH_MODE" not in os.environ else "")
            raise DpfleetError(f"could not start or reach Ray at {address or 'local'}: {exc}{hint}") from exc
    return ray


class RayTrainer:
    name = "ray"

    def __init__(self, cfg: ModelConfig, *, seq_len: int, batch_size: int, workers: int = 2,
                 address: str = "", memory_mb: int = 160, device: str = "cpu", precision: str = "float32"):
        """`precision`: `client.precision`, resolved on the workers' CPUs (`cluster_precision`;
        on CUDA by the CUDA rule); the result, with why, is `self.precision`."""
        if workers < 1:
            raise DpfleetError("backend.workers must be >= 1")
        ray = connect_ray(address, workers, "backend.kind = 'ray'")
        self._ray = ray
        actor = ray.remote(num_cpus=1, num_gpus=1 if device == "cuda" else 0)(_Worker)
        self.workers = [actor.remote(cfg, seq_len, batch_size, memory_mb, device) for _ in range(workers)]
        if device == "cuda" or precision == "float32":
            self.precision = resolve_precision(precision, device, "client.precision")
        else:
            self.precision = cluster_precision(
                precision, ray.get([w.cpu.remote(precision == "auto") for w in self.workers]))
        ray.get([w.start.remote(self.precision.name) for w in self.workers])
        # the workers' own builds of the bfloat16 kernels (their CPUs and compilers), for
        # summary.json and the resume points (`backends.trainer_precision`)
        self.elementwise = cluster_kernels(ray.get([w.kernels.remote() for w in self.workers]))

    def train_round(self, theta0: np.ndarray, examples: Sequence[np.ndarray], seeds: Sequence[int],
                    *, lr: float, batch_size: int, clip_norm: float) -> list[ClientUpdate]:
        if len(examples) != len(seeds):
            raise DpfleetError("ray backend: one seed per client is needed")
        theta_ref = self._ray.put(np.asarray(theta0, dtype=np.float32))
        steps = [len(batches(len(x), batch_size, 0)) for x in examples]
        parts = [s for s in shards(steps, len(self.workers)) if s]
        futures = [
            w.train.remote(theta_ref, [examples[i] for i in part], [seeds[i] for i in part], lr,
                           batch_size, clip_norm)
            for w, part in zip(self.workers, parts, strict=False)
        ]
        out: list[ClientUpdate | None] = [None] * len(examples)
        for part, updates in zip(parts, self._ray.get(futures), strict=True):
            for i, u in zip(part, updates, strict=True):
                out[i] = u
        return out  # type: ignore[return-value]
