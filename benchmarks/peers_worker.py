"""One system of `benchmarks/peers.py`, run in its own process on the workload file it wrote.

    python benchmarks/peers_worker.py SYSTEM WORKLOAD.npz OUT_PREFIX [SEED_INDEX]

SYSTEM is `plain`, `pfl`, `flower` (these three run in the peers' venv too: only torch, numpy and
dpfleet's model zoo / minibatch order are imported at the top) or `dpfleet_sequential` /
`dpfleet_cohort` (dpfleet's environment). Every system trains the same rounds: per seed, the
same start weights, the same cohorts, each client's rows in the same minibatch order, lr, batch,
one local epoch, the L2 clip of the client's delta, and a Gaussian mechanism on the mean
(std noise_multiplier * clip_norm / cohort). The peers use their own DP code for clip and noise
(pfl: CentrallyAppliedPrivacyMechanism(GaussianMechanism); Flower:
DifferentialPrivacyServerSideFixedClipping); the plain loop and dpfleet's trainers share this
file's `server_step`. Writes OUT_PREFIX.json (timings, ru_maxrss, versions) and OUT_PREFIX.npz
(final weights per seed; the harness scores them all with one loss).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dpfleet.edge.minibatch import batches
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat, set_flat

PEAK_KEY = "peers-ru-maxrss-mib"


@dataclass
class Workload:
    clients: list[np.ndarray]  # int64 token rows [n, seq_len + 1] per client
    cohorts: np.ndarray  # [seeds, rounds, cohort] client indices
    batch_seeds: np.ndarray  # [seeds, rounds, cohort] minibatch-order seeds
    theta0: np.ndarray  # [seeds, params] start weights
    seeds: list[int]
    model: ModelConfig
    lr: float
    batch_size: int
    clip_norm: float
    noise_multiplier: float

    @classmethod
    def load(cls, path: str | Path, seed: int | None = None) -> Workload:
        """The whole plan, or only seed `seed`'s rounds."""
        z = np.load(path)
        meta = json.loads(str(z["meta"]))
        rows, offsets = z["rows"].astype(np.int64), z["offsets"]
        pick = slice(None) if seed is None else slice(seed, seed + 1)
        return cls([rows[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)],
                   z["cohorts"][pick], z["batch_seeds"][pick], z["theta0"][pick], meta["seeds"][pick],
                   ModelConfig(**meta["model"]), meta["lr"], meta["batch_size"], meta["clip_norm"],
                   meta["noise_multiplier"])

    def save(self, path: str | Path) -> None:
        """The one file every system loads (clients concatenated as int32 rows + offsets)."""
        meta = {"seeds": list(self.seeds), "model": self.model.to_dict(), "lr": self.lr,
                "batch_size": self.batch_size, "clip_norm": self.clip_norm,
                "noise_multiplier": self.noise_multiplier}
        np.savez(path, rows=np.concatenate(self.clients).astype(np.int32),
                 offsets=np.cumsum([0] + [len(x) for x in self.clients]), cohorts=self.cohorts,
                 batch_seeds=self.batch_seeds, theta0=self.theta0, meta=json.dumps(meta))

    def ordered(self, client: int, seed: int) -> np.ndarray:
        """The client's rows in dpfleet's minibatch order: consecutive slices of batch_size are
        exactly dpfleet's minibatches (so frameworks that iterate in order see the same ones)."""
        return self.clients[client][np.concatenate(batches(len(self.clients[client]), self.batch_size, seed))]

    def steps(self) -> int:
        """Local SGD steps in one pass over all seeds and rounds."""
        return int(sum(-(-len(self.clients[c]) // self.batch_size) for c in self.cohorts.reshape(-1)))


def server_step(theta: np.ndarray, deltas: list[np.ndarray], w: Workload, seed: int, r: int) -> np.ndarray:
    """Mean of the clipped deltas plus the Gaussian mechanism's noise (the peers' own rule)."""
    std = w.noise_multiplier * w.clip_norm / len(deltas)
    noise = np.random.default_rng([seed, r]).standard_normal(theta.size).astype(np.float32)
    return theta + np.mean(deltas, axis=0, dtype=np.float32) + std * noise


def cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The peers' loss: fused cross-entropy ignoring PAD targets (equal to dpfleet's masked mean)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=PAD)


class PlainLoop:
    """The fastest honest plain loop: one client after another, autograd.grad + a foreach SGD
    update on the live parameters, the delta clipped as one flat tensor."""

    def __init__(self, w: Workload):
        self.w = w
        self.model = build_model(w.model)
        self.params = list(self.model.parameters())
        self.sizes = [p.numel() for p in self.params]

    def client(self, theta0: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        w, params = self.w, self.params
        with torch.no_grad():  # copy in: vector_to_parameters would alias theta0's storage
            torch._foreach_copy_(params, [t.view_as(p) for t, p in zip(theta0.split(self.sizes), params,
                                                                            strict=True)])
        data = torch.from_numpy(rows)
        for i in range(0, len(data), w.batch_size):
            b = data[i:i + w.batch_size]
            grads = torch.autograd.grad(cross_entropy(self.model, b[:, :-1], b[:, 1:]), params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-w.lr)
        with torch.no_grad():
            delta = torch.nn.utils.parameters_to_vector(params) - theta0
            delta.mul_(torch.clamp(w.clip_norm / delta.norm(), max=1.0))
        return delta.numpy()

    def round(self, theta: np.ndarray, clients: np.ndarray, seeds: np.ndarray) -> list[np.ndarray]:
        t0 = torch.from_numpy(theta)
        return [self.client(t0, self.w.ordered(int(c), int(s))) for c, s in zip(clients, seeds, strict=True)]


def run_rounds(w: Workload, train_round: Callable) -> tuple[list[np.ndarray], list[list[float]]]:
    """Seeds x rounds through `train_round(theta, clients, batch_seeds) -> clipped deltas` and
    `server_step`; per-round wall seconds include the server step."""
    finals, times = [], []
    for si, seed in enumerate(w.seeds):
        theta, rounds = w.theta0[si].copy(), []
        for r in range(w.cohorts.shape[1]):
            t0 = time.perf_counter()
            deltas = train_round(theta, w.cohorts[si, r], w.batch_seeds[si, r])
            theta = server_step(theta, deltas, w, seed, r)
            rounds.append(time.perf_counter() - t0)
        finals.append(theta)
        times.append(rounds)
    return finals, times


def dpfleet_round(trainer, w: Workload) -> Callable:
    """dpfleet's RoundTrainer interface (the exact call its simulator makes)."""

    def train_round(theta, clients, seeds):
        updates = trainer.train_round(theta, [w.clients[int(c)] for c in clients], [int(s) for s in seeds],
                                      lr=w.lr, batch_size=w.batch_size, clip_norm=w.clip_norm)
        return [u.delta for u in updates]

    return train_round


def run_dpfleet(w: Workload, kind: str) -> tuple[list[np.ndarray], list[list[float]], dict]:
    from dpfleet.coordinator.engine.backends import SequentialTrainer
    from dpfleet.edge.cohort import CohortTrainer
    from dpfleet.edge.runtime import EagerRuntime

    seq_len = w.clients[0].shape[1] - 1
    trainer = (SequentialTrainer(EagerRuntime(w.model)) if kind == "sequential" else
               CohortTrainer(w.model, seq_len=seq_len, batch_size=w.batch_size, device="cpu"))
    finals, times = run_rounds(w, dpfleet_round(trainer, w))
    from dpfleet.edge import cohort_pool

    workers = cohort_pool.pool_workers(torch.get_num_threads())  # the cohort's worker processes, if any
    return finals, times, {"cohort_chunk": getattr(trainer, "chunk", None),
                           "cohort_worker_processes": workers}


def run_plain(w: Workload) -> tuple[list[np.ndarray], list[list[float]], dict]:
    loop = PlainLoop(w)
    finals, times = run_rounds(w, loop.round)
    return finals, times, {}


class PflLM(torch.nn.Module):
    """dpfleet's CIFG with the `loss` / `metrics` methods pfl's PyTorchModel asks for."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.lm = build_model(cfg)

    def forward(self, x):
        return self.lm(x)

    def loss(self, x, y):
        self.train()
        return cross_entropy(self, x, y)

    def metrics(self, x, y, eval=False):  # noqa: A002  (pfl's keyword)
        from pfl.metrics import Weighted

        with torch.no_grad():
            n = int((y != PAD).sum())
            return {"loss": Weighted(float(cross_entropy(self, x, y)) * n, n)}


def run_pfl(w: Workload) -> tuple[list[np.ndarray], list[list[float]], dict]:
    """pfl 0.6's simulation: FederatedAveraging over SimulatedBackend, central DP with its
    GaussianMechanism; the user sampler replays the harness's cohorts; round times from a callback."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    class RoundClock(TrainingProcessCallback):
        def __init__(self):
            self.marks = []

        def on_train_begin(self, *, model):
            self.marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.marks.append(time.perf_counter())
            return False, Metrics()

    rounds, cohort = w.cohorts.shape[1], w.cohorts.shape[2]
    finals, times = [], []
    for si, _seed in enumerate(w.seeds):
        ids = [(r, k) for r in range(rounds) for k in range(cohort)]
        feed = iter(ids)

        def make_dataset(uid, si=si):
            r, k = uid
            rows = torch.from_numpy(w.ordered(int(w.cohorts[si, r, k]), int(w.batch_seeds[si, r, k])))
            return Dataset((rows[:, :-1], rows[:, 1:]), user_id=uid)

        train = FederatedDataset(make_dataset, lambda feed=feed: next(feed))
        module = PflLM(w.model)
        set_flat(module.lm, w.theta0[si])
        model = PyTorchModel(module, local_optimizer_create=torch.optim.SGD,
                             central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
        dp = CentrallyAppliedPrivacyMechanism(GaussianMechanism(w.clip_norm, w.noise_multiplier))
        backend = SimulatedBackend(training_data=train, val_data=None, postprocessors=[dp])
        clock = RoundClock()
        FederatedAveraging().run(
            algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=10 ** 9,
                                               train_cohort_size=cohort, val_cohort_size=None),
            backend=backend, model=model,
            model_train_params=NNTrainHyperParams(local_learning_rate=w.lr, local_num_epochs=1,
                                                  local_batch_size=w.batch_size),
            model_eval_params=NNEvalHyperParams(local_batch_size=w.batch_size), callbacks=[clock])
        if len(clock.marks) != rounds + 1:
            raise RuntimeError(f"pfl ran {len(clock.marks) - 1} rounds, expected {rounds}")
        finals.append(get_flat(module.lm))
        times.append(list(np.diff(clock.marks)))
    return finals, times, {"pfl": _version("pfl")}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def flower_client_train(msg, context):
    """Flower ClientApp: node k of round r trains the harness's cohort[seed, r, k] (partition-id k)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "2")))
    w = _flower_workload()
    si = int(msg.content["config"]["seed-index"])
    r = int(msg.content["config"]["server-round"]) - 1
    k = int(context.node_config["partition-id"])
    model = build_model(w.model)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=w.lr)
    rows = torch.from_numpy(w.ordered(int(w.cohorts[si, r, k]), int(w.batch_seeds[si, r, k])))
    model.train()
    for i in range(0, len(rows), w.batch_size):
        b = rows[i:i + w.batch_size]
        loss = cross_entropy(model, b[:, :-1], b[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # num-examples 1: the unweighted mean the DP wrapper's noise scale assumes
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": 1, PEAK_KEY: peak})})
    return Message(content=content, reply_to=msg)


_FLOWER_CACHE: dict[str, Workload] = {}


def _flower_workload() -> Workload:
    path, seed = os.environ["PEERS_WORKLOAD"], os.environ.get("PEERS_SEED")
    if path not in _FLOWER_CACHE:  # once per Ray actor process
        _FLOWER_CACHE[path] = Workload.load(path, None if seed is None else int(seed))
    return _FLOWER_CACHE[path]


def run_flower(w: Workload, workload_path: str) -> tuple[list[np.ndarray], list[list[float]], dict]:
    """Flower's simulation runtime (Ray backend, one actor per 2 CPUs), FedAvg wrapped in
    DifferentialPrivacyServerSideFixedClipping; round times from configure_train marks."""
    import flwr
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation

    os.environ["PEERS_WORKLOAD"] = workload_path
    rounds, cohort = w.cohorts.shape[1], w.cohorts.shape[2]
    threads = torch.get_num_threads()
    finals, times, actor_peaks, setup = [], [], [], []

    class Clocked(DifferentialPrivacyServerSideFixedClipping):
        marks: list[float] = []

        def configure_train(self, server_round, arrays, config, grid):
            self.marks.append(time.perf_counter())
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            actor_peaks.extend(float(m.content["metrics"][PEAK_KEY]) for m in replies)
            return super().aggregate_train(server_round, replies)

    for si, _seed in enumerate(w.seeds):
        template = build_model(w.model)
        set_flat(template, w.theta0[si])
        server, client = ServerApp(), ClientApp()
        client.train()(flower_client_train)
        t_launch = time.perf_counter()

        @server.main()
        def main(grid, context, si=si, template=template, t_launch=t_launch):
            strategy = Clocked(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=cohort,
                                      min_available_nodes=cohort),
                               w.noise_multiplier, w.clip_norm, cohort)
            strategy.marks = []
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(template.state_dict()),
                                    num_rounds=rounds, train_config=ConfigRecord({"seed-index": si}))
            strategy.marks.append(time.perf_counter())
            template.load_state_dict(result.arrays.to_torch_state_dict())
            times.append(list(np.diff(strategy.marks)))
            setup.append(strategy.marks[0] - t_launch)

        run_simulation(server_app=server, client_app=client, num_supernodes=cohort,
                       backend_config={"client_resources": {"num_cpus": threads, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": threads, "include_dashboard": False,
                                                     "log_to_driver": False}})
        if len(times) != si + 1 or len(times[-1]) != rounds:
            raise RuntimeError(f"Flower seed {si}: {times[si:]} round times, expected {rounds}")
        finals.append(get_flat(template))
    import ray

    return finals, times, {"flwr": flwr.__version__, "ray": ray.__version__,
                           "actor_peak_rss_mib": round(max(actor_peaks), 1),
                           "launch_seconds_per_seed": [round(s, 2) for s in setup]}


def main() -> None:
    system, workload_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else None
    threads = int(os.environ.get("PEERS_THREADS", "2"))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    w = Workload.load(workload_path, seed)
    t0 = time.perf_counter()
    runners = {"plain": lambda: run_plain(w), "pfl": lambda: run_pfl(w),
               "flower": lambda: run_flower(w, workload_path),
               "dpfleet_sequential": lambda: run_dpfleet(w, "sequential"),
               "dpfleet_cohort": lambda: run_dpfleet(w, "cohort")}
    if seed is not None:
        os.environ["PEERS_SEED"] = str(seed)  # Flower's actors load the same slice
    finals, times, extra = runners[system]()
    np.savez(out.with_suffix(".npz"), theta=np.stack(finals))
    out.with_suffix(".json").write_text(json.dumps({
        "system": system, "round_seconds": [[round(t, 4) for t in s] for s in times],
        "process_seconds": round(time.perf_counter() - t0, 2), "torch_threads": torch.get_num_threads(),
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__, "python": sys.executable, **extra,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
