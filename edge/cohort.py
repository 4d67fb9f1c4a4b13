"""Cohort training: all clients of a round trained at once, one weight copy per client.

The sequential path (`client_update`) runs one Python loop of minibatches per client, so a small
on-device model is dominated by per-op dispatch, not arithmetic. Here each client's weights are
one row of a stacked tensor and a local SGD step of every client is one call of
`vmap(grad(loss))` (torch.func), i.e. batched matmuls over the client axis.

Exactness with the sequential path, client by client:
* the same shuffled minibatches (`minibatch.batches` with the same seed);
* a short last minibatch is filled with all-PAD rows: the loss masks PAD targets, so sum and count
  (hence loss and gradient) are unchanged;
* clients are sorted by their number of minibatches (longest first), so the clients still training
  at step s are a prefix of the chunk: step s updates a view `w[:k_s]` and finished clients stop
  (ragged clients by masking, without copying weights);
* delta, non-finite check and clipping are `finish_update`, the sequential path's own code.
What differs is float rounding of batched vs single matmuls (tolerance in tests/test_edge_cohort.py).

Determinism. On CPU a config always gives the same chunks (the budget is a config value, not the
free memory) and the same ops, so a run and its resume are bit for bit equal at a fixed thread
count (tests/test_simulation_cohort.py, tests/test_resume.py). On CUDA (`client.device`, "auto"
when a GPU is visible) the embedding backward accumulates with atomics, so repeated runs agree
only to float32 rounding; the stated tolerance there is the CPU one against the sequential path
(deltas 1e-6 absolute), not yet measured on a GPU. For bit-exact GPU resumes set
`torch.use_deterministic_algorithms(True)` and CUBLAS_WORKSPACE_CONFIG=:4096:8 (slower).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.func import functional_call, grad_and_value, vmap

from dpfleet.edge.client_update import ClientUpdate, finish_update
from dpfleet.edge.cohort_lstm import RECURRENT, fused_bytes_per_client, recurrent_grads
from dpfleet.edge.cohort_pool import discard_pool, shared_pool
from dpfleet.edge.minibatch import batches
from dpfleet.edge.model_output import logits_of
from dpfleet.edge.precision import FLOAT32, Precision, resolve_precision
from dpfleet.edge.tokenizer import PAD
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model, next_token_loss
from dpfleet.export.params import ParamLayout
from dpfleet.heap import keep_freed_memory

# CPU budget for one chunk's weights, gradients and activations. Small on purpose: on CPU the
# stacked weight gradients of a big chunk fall out of cache (issue 15 workload, 1 thread: chunks of
# 4 / 8 / 16 / 28 clients ran 1.44 / 1.06 / 0.88 / 0.77x the sequential speed). The fused
# recurrent path gets 9 clients from it; one round, 1 thread, load ~4: chunks of 5 / 10 / 25 / 50
# ran 1.77 / 1.96 / 0.99 / 0.88x sequential (the recurrent weights of big chunks leave the cache).
DEFAULT_MEMORY_MB = 160


def model_params(cfg: ModelConfig) -> int:
    """The zoo model's parameter count (what "auto" precision's size rule reads)."""
    return ParamLayout.of(build_model(cfg)).total


def bytes_per_client(cfg: ModelConfig, batch_size: int, seq_len: int, fused: bool = False) -> int:
    """Working memory of one client in a chunk (float32), the rule the chunk size is chosen by.

    `fused`: the hand-written recurrent path (`cohort_lstm.fused_bytes_per_client`); otherwise
    the torch.func path:
    Weights + gradient + update temporary (3 x params), plus activations saved for backward per
    minibatch: the vocabulary-sized logits, log-softmax and their gradients (4 x V per token), and
    per recurrent step / block about 12 x hidden + 8 x embedding floats per token and layer.
    """
    params = model_params(cfg)
    if fused:
        return fused_bytes_per_client(cfg, batch_size, seq_len, params)
    tokens = batch_size * seq_len
    per_token = 4 * cfg.vocab_size + cfg.num_layers * (12 * cfg.hidden_dim + 8 * cfg.embedding_dim)
    return 4 * (3 * params + tokens * per_token)


def chunk_size(cfg: ModelConfig, batch_size: int, seq_len: int, device: torch.device,
               memory_mb: int = DEFAULT_MEMORY_MB, fused: bool = False) -> int:
    """Clients per chunk: floor(budget / bytes_per_client), at least 1.

    On CPU the budget is `memory_mb` (a config value, not the machine's free memory, so the chunks
    - and the float rounding - are the same on every run of a config). On CUDA it is half the
    device's free memory at the start of the run.
    """
    budget = memory_mb * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 2
    return max(1, budget // bytes_per_client(cfg, batch_size, seq_len, fused))


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA when a GPU is visible, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DpfleetError("client.device = 'cuda' but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise DpfleetError(f"client.device must be 'auto', 'cpu' or 'cuda', not {name!r}")
    return torch.device(name)


def _on_threads(fn, items: list, workers: int) -> list:
    """fn over items on `workers` Python threads, torch single-threaded in each (torch releases
    the GIL inside its ops). Each item's result is computed by one thread with one torch thread,
    so it does not depend on the scheduling: a config's results are the same on every run."""
    threads = torch.get_num_threads()

    def one(item):
        torch.set_num_threads(1)
        return fn(item)

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, items))
    finally:
        torch.set_num_threads(threads)


def train_chunk(cfg: ModelConfig, layout: ParamLayout, theta: torch.Tensor, examples: list[np.ndarray],
                plans: list[list[np.ndarray]], lr: float, step: Callable | None = None,
                precision: Precision = FLOAT32) -> tuple[np.ndarray, list[float]]:
    """One chunk's local training from `theta`: (deltas [n, params], mean losses).

    `step` None: the fused recurrent path (`recurrent_grads`, the SGD step inside); otherwise
    `vmap(grad_and_value(loss))` over the stacked weights. A module-level function so a worker
    process (`cohort_pool`) runs exactly this code. `precision` bfloat16: on the fused path its own
    bfloat16 GEMMs (`recurrent_grads`' `dtype`: bfloat16 weight copies made once per step, not
    autocast's cast per op, which cost what the faster GEMMs saved); on the torch.func path the
    GEMMs under bfloat16 autocast. The weights (and so the SGD steps and the deltas) stay float32."""
    n = len(examples)
    width = max(x.shape[1] for x in examples)
    params = {
        name: part.reshape(shape).unsqueeze(0).repeat(n, *([1] * len(shape))).contiguous()
        for name, shape, part in zip(layout.names, layout.shapes, theta.split(layout.sizes), strict=True)
    }
    loss_sum = torch.zeros(n, dtype=torch.float64)
    steps = [len(p) for p in plans]
    if step is None:
        _local_steps(cfg, params, plans, examples, steps, width, theta.device, lr, step, loss_sum,
                     precision.dtype)
    else:
        with precision.autocast(theta.device.type):
            _local_steps(cfg, params, plans, examples, steps, width, theta.device, lr, step, loss_sum)
    # float32: what finish_update clips and sums; each weight's delta written in place (a
    # concatenated copy of the local weights, then their difference, cost two more passes over
    # [n, params]: 4% of a Gboard-size bfloat16 round)
    deltas = torch.empty(n, len(theta), dtype=torch.float32)
    for name, dst, part in zip(layout.names, deltas.split(layout.sizes, dim=1), theta.split(layout.sizes),
                               strict=True):
        torch.sub(params[name].reshape(n, -1).float().cpu(), part.float().cpu(), out=dst)
    deltas = deltas.numpy()
    losses = [float(loss_sum[j]) / steps[j] if steps[j] else float("nan") for j in range(n)]
    return deltas, losses


def _local_steps(cfg: ModelConfig, params: dict[str, torch.Tensor], plans: list[list[np.ndarray]],
                 examples: list[np.ndarray], steps: list[int], width: int, device: torch.device,
                 lr: float, step: Callable | None, loss_sum: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
    """`train_chunk`'s SGD steps on the stacked `params` in place, losses added to `loss_sum`
    (`dtype`: the fused path's GEMM precision)."""
    for s in range(steps[0] if steps else 0):
        k = sum(1 for m in steps if m > s)  # active clients: a prefix (sorted longest first)
        rows_s = max(len(plans[j][s]) for j in range(k))  # PAD rows only up to the widest
        block = np.full((k, rows_s, width), PAD, dtype=np.int64)
        for j in range(k):
            idx = plans[j][s]
            x = examples[j]
            block[j, : len(idx), : x.shape[1]] = x[idx]
        # trailing columns with no real target cannot change a causal model's earlier outputs
        real_cols = (block[:, :, 1:] != PAD).any(axis=(0, 1)).nonzero()[0]
        cols = int(real_cols[-1]) + 2 if len(real_cols) else 2
        rows = torch.from_numpy(np.ascontiguousarray(block[:, :, :cols])).to(device)
        active = {name: p[:k] for name, p in params.items()}
        if step is None:  # the SGD step is applied inside, fused into the gradient GEMMs
            _, loss = recurrent_grads(cfg, active, rows, lr=lr, dtype=dtype)
        else:
            grads, loss = step(active, rows)
            with torch.no_grad():
                for name, p in active.items():
                    p.sub_(grads[name], alpha=lr)
        loss_sum[:k] += loss.detach().to("cpu", torch.float64)


def _pooled_chunk(cfg: ModelConfig, layout: ParamLayout, theta: np.ndarray, examples: list[np.ndarray],
                  plans: list[list[np.ndarray]], lr: float, precision: Precision = FLOAT32
                  ) -> tuple[np.ndarray, list[float]]:
    """`train_chunk` of the fused path in a worker process (numpy in, numpy out)."""
    return train_chunk(cfg, layout, torch.from_numpy(theta), examples, plans, lr, None, precision)


def _deal(items: list[int], hands: int) -> list[list[int]]:
    """Deal `items` to `hands` back and forth (0, 1, .., h-1, h-1, .., 0, 0, ..)."""
    out: list[list[int]] = [[] for _ in range(hands)]
    for i, item in enumerate(items):
        turn, seat = divmod(i, hands)
        out[seat if turn % 2 == 0 else hands - 1 - seat].append(item)
    return out


class CohortTrainer:
    """Trains a round's clients in chunks of stacked weights (eager torch, CPU or CUDA)."""

    name = "cohort"
    clip = None  # a `dpfleet.extensions.ClippingRule` set by the driver; None: the L2 clip

    def __init__(self, cfg: ModelConfig, *, seq_len: int, batch_size: int, device: str = "auto",
                 memory_mb: int = DEFAULT_MEMORY_MB, chunk: int | None = None, fused: bool = True,
                 model: torch.nn.Module | None = None, processes: bool = True, precision: str = "float32"):
        """`model`: a module from outside the zoo (`dpfleet.simulate`), trained on the torch.func
        path (a copy; `cfg` then only gives vocab_size for the chunk size). `processes`: with 2+
        torch threads on CPU, train the fused path's chunks in worker processes (`cohort_pool`);
        False keeps them on Python threads (same results, slower: see cohort_pool). `precision`:
        "float32" | "bfloat16" | "auto" (`edge.precision`; the config's `client.precision`)."""
        self.cfg = cfg
        self.processes = processes
        self.device = resolve_device(device)
        keep_freed_memory()  # the steps' multi-MB temporaries reuse pages (dpfleet.heap)
        self.model = (build_model(cfg) if model is None else copy.deepcopy(model)).to(self.device)
        self.layout = ParamLayout.of(self.model)
        self.precision = resolve_precision(precision, self.device.type, "client.precision",
                                           params=self.layout.total)
        # recurrent models take the hand-written path (cohort_lstm.py); `fused=False` keeps them
        # on torch.func, the path the transformer always takes
        self.fused = fused and model is None and cfg.arch in RECURRENT
        if model is None:
            self.chunk = chunk or chunk_size(cfg, batch_size, seq_len, self.device, memory_mb, self.fused)
        else:  # unknown internals: weights x 3 and the vocabulary-sized activations only
            per_client = 4 * (3 * self.layout.total + batch_size * seq_len * 4 * cfg.vocab_size)
            self.chunk = chunk or max(1, memory_mb * 2**20 // per_client)

        def loss(params: dict, rows: torch.Tensor) -> torch.Tensor:
            logits = logits_of(functional_call(self.model, params, (rows[:, :-1],)))
            return next_token_loss(logits, rows[:, 1:], PAD)

        self._step = vmap(grad_and_value(loss))

    @property
    def elementwise(self) -> dict[str, str]:
        """The recurrent path's elementwise kernels at bfloat16 (summary.json's `precision`:
        `elementwise`, the C cell or torch ops and why; `kernels`, what decides that path's bits,
        which a resume point keeps), or {} where there are none (float32, the torch.func path)."""
        if self.precision.name != "bfloat16" or not self.fused:
            return {}
        if self.device.type != "cpu":
            return {"elementwise": "torch ops (the C kernels are the CPU's)", "kernels": "torch ops"}
        from dpfleet.edge.native_cell import cell

        return {"elementwise": cell().reason, "kernels": cell().identity}

    def train_round(self, theta0: np.ndarray, examples: Sequence[np.ndarray], seeds: Sequence[int],
                    *, lr: float, batch_size: int, clip_norm: float) -> list[ClientUpdate]:
        """Per-client clipped updates, in the order of `examples` (as the sequential path)."""
        if len(examples) != len(seeds):
            raise DpfleetError("cohort: one seed per client is needed")
        for rows in examples:
            if rows.ndim != 2 or rows.shape[1] < 2:
                raise DpfleetError(f"examples must be [n, L+1] token rows, got {rows.shape}")
        theta = torch.from_numpy(np.ascontiguousarray(theta0, dtype=np.float32)).to(self.device)
        plans = [batches(len(x), batch_size, s) for x, s in zip(examples, seeds, strict=True)]
        # longest first, then by rows: a chunk's short clients pad their rows to similar sizes
        order = sorted(range(len(examples)), key=lambda i: (-len(plans[i]), -len(examples[i])))
        workers = self._workers(len(order))
        size = min(self.chunk, -(-len(order) // workers))
        # consecutive clients of the longest-first order go to one group of `workers` chunks (a
        # chunk runs as many steps as its longest client), dealt out over the group's chunks
        # back and forth (so the chunks trained at once finish together: 4% less wall time than
        # dealing in turn on the peers workload)
        span = workers * size
        chunks = [c for g in range(0, len(order), span) for c in _deal(order[g : g + span], workers) if c]
        tasks = [(self.cfg, self.layout, theta, [examples[i] for i in ids], [plans[i] for i in ids], lr)
                 for ids in chunks]
        step = None if self.fused else self._step
        if workers < 2:
            results = [train_chunk(*task, step, self.precision) for task in tasks]
        else:
            results = self._in_parallel(tasks, workers)
        out: list[ClientUpdate | None] = [None] * len(examples)
        for ids, (deltas, losses) in zip(chunks, results, strict=True):
            for j, i in enumerate(ids):
                out[i] = finish_update(deltas[j], clip_norm, losses[j], len(examples[i]), self.clip)
        return out  # type: ignore[return-value]

    def _workers(self, clients: int) -> int:
        """Chunks trained at once on CPU, one per torch thread (fused path only): the per-step
        products have only `batch` rows per client, too small to split over threads, so torch's
        own threads idle; a chunk per worker keeps each one's weights in its own cache."""
        if self.device.type != "cpu" or not self.fused or clients < 2:
            return 1
        return min(torch.get_num_threads(), clients)

    def _in_parallel(self, tasks: list[tuple], workers: int) -> list[tuple[np.ndarray, list[float]]]:
        """The chunks on the worker processes (`cohort_pool`), or on Python threads of one torch
        thread each where processes are off or cannot start (the same bits either way)."""
        size = torch.get_num_threads()
        pool = shared_pool(size, preload=__name__) if self.processes else None
        if pool is None:
            return _on_threads(lambda task: train_chunk(*task, None, self.precision), tasks, workers)
        arrays = [(cfg, layout, theta.numpy(), *rest, self.precision) for cfg, layout, theta, *rest in tasks]
        try:
            return pool.map(_pooled_chunk, arrays)
        except BaseException:  # a dead worker, or Ctrl-C while the workers train
            discard_pool(size)
            raise
