"""Worker processes for the cohort trainer's CPU chunks: one torch thread each.

Why processes, not threads. A fused chunk's step is hundreds of ~10 us ops (per time step, 16
rows a client), and the interpreter between them serializes Python threads: on the peers
workload (`benchmarks/peers.py`; CIFG 32/64/32, two 10-client chunks of one round, 1 torch thread each, quiet
2-core machine) the chunks took 1.87 s and 1.90 s alone, 2.79 s together on two Python threads
(1.35x) and 1.98 s together in two processes (1.90x).

Why `subprocess` and pipes, not `multiprocessing`. Its spawn and forkserver children re-run the
user's main script (a script calling `dpfleet.simulate` without an `if __name__ == "__main__"`
guard would train again in every worker), and fork copies a process that may hold other threads'
locks (the coordinator service, Ray, tqdm). A worker here is a fresh `python -c` that imports only
dpfleet's training code and serves chunks from its stdin.

Same bits as in-process training. A worker runs the parent's `train_chunk` on one torch thread
with the parent's environment (so the same ATen kernels), which is what `CohortTrainer` does with
its thread fallback (`processes=False`, or where no process can be started): a chunk's result
does not depend on where it ran (tested bit for bit in tests/test_cohort_pool.py). The workers
are started on the first parallel round, which waits for their imports (about 1.5 s), and kept
for the life of the process.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import BinaryIO

from dpfleet.errors import DpfleetError
from dpfleet.heap import keep_freed_memory

_HEADER = struct.Struct("<Q")
_READY = b"ready"

_BOOT = (
    "import sys; sys.path[:0] = {path!r}; "
    "from dpfleet.edge.cohort_pool import serve; serve({preload!r})"
)


def _send(stream: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream: BinaryIO) -> object:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("cohort worker closed its pipe")
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("cohort worker closed its pipe mid-message")
    return pickle.loads(data)


def serve(preload: str = "") -> None:
    """Worker side: import module `preload` (where the tasks' functions live: the caller names it,
    this pool knows no caller), then answer `(function, args)` messages on stdin until it closes.

    Replies are ("ok", result) or ("error", traceback text) on a private copy of the stdout pipe;
    fd 1 itself is pointed at stderr first, so nothing else the worker prints (Python's print, or
    native code writing to fd 1, e.g. OpenMP's notices) can enter or break the protocol."""
    import signal

    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch

    # Ctrl-C in a terminal reaches the whole process group: the parent handles it (and says how
    # to resume); a worker ends when the parent closes its stdin, without a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    keep_freed_memory()  # as the parent's CohortTrainer does: the steps' temporaries reuse pages
    if preload:  # what the tasks call: imported before "ready"
        importlib.import_module(preload)

    stdin = sys.stdin.buffer
    _send(replies, _READY)
    while True:
        try:
            fn, args = _recv(stdin)
        except EOFError:
            return
        try:
            reply = ("ok", fn(*args))
        except Exception:  # a bug or resource failure: the parent raises it with this text
            reply = ("error", traceback.format_exc())
        _send(replies, reply)


class WorkerError(DpfleetError):
    """A worker died (out of memory, killed) or a task raised in it (the message carries the
    worker's traceback): the run stops with this one error, nothing of the round is released."""


class _Worker:
    def __init__(self, preload: str = "") -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        boot = _BOOT.format(path=list(sys.path), preload=preload)
        self.proc = subprocess.Popen([sys.executable, "-c", boot],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.ready = False

    def call(self, fn: Callable, args: tuple) -> object:
        try:
            if not self.ready:  # called before it said so: wait for its imports
                self.ready = _recv(self.proc.stdout) == _READY
            _send(self.proc.stdin, (fn, args))
            status, value = _recv(self.proc.stdout)
        except (EOFError, OSError, ValueError) as exc:  # ValueError: its pipe closed here (killed)
            raise WorkerError(f"cohort worker process {self.proc.pid} exited (code {self.proc.poll()}): "
                              "out of memory or killed? Lower client.cohort_memory_mb or the torch "
                              f"threads ({exc})") from exc
        if status != "ok":
            raise WorkerError(f"cohort worker process {self.proc.pid} failed:\n{value}")
        return value

    def close(self, kill: bool = False) -> None:
        """End the worker: close its stdin (it exits when idle), or kill it (mid-task)."""
        if self.proc.poll() is None:
            try:
                if kill:
                    self.proc.kill()
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


class WorkerPool:
    """`size` worker processes, started at once, each importing module `preload` first."""

    def __init__(self, size: int, preload: str = ""):
        self.workers: list[_Worker] = []
        try:
            for _ in range(size):
                self.workers.append(_Worker(preload))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()  # one task list on the pipes at a time

    def map(self, fn: Callable, arg_tuples: list[tuple]) -> list:
        """fn(*args) for each tuple, task i on worker i mod size; each worker's tasks in order on
        one parent I/O thread (so no pipe can fill up against a blocked reader)."""
        with self._lock:
            return self._map(fn, arg_tuples)

    def _map(self, fn: Callable, arg_tuples: list[tuple]) -> list:
        results: list = [None] * len(arg_tuples)
        errors: list[BaseException] = []

        def drive(j: int) -> None:
            try:
                for i in range(j, len(arg_tuples), len(self.workers)):
                    results[i] = self.workers[j].call(fn, arg_tuples[i])
            except BaseException as exc:  # re-raised in the caller's thread below
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(j,), daemon=True)
                   for j in range(min(len(self.workers), len(arg_tuples)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def close(self, kill: bool = False) -> None:
        for w in self.workers:
            w.close(kill)


_POOLS: dict[int, WorkerPool] = {}
_LOCK = threading.Lock()


_UNAVAILABLE: list[str] = []  # why workers cannot start here (then chunks stay on threads)


def shared_pool(size: int, preload: str = "") -> WorkerPool | None:
    """The process's pool of `size` workers (started on first request, each importing module
    `preload`, kept for later rounds and trainers, closed at exit); None where processes cannot be
    started (a sandbox without fork/exec: the caller trains on threads)."""
    with _LOCK:
        if _UNAVAILABLE:
            return None
        pool = _POOLS.get(size)
        if pool is None:
            try:
                pool = _POOLS[size] = WorkerPool(size, preload)
            except OSError as exc:
                _UNAVAILABLE.append(str(exc))
                return None
        return pool


def pool_workers(size: int) -> int:
    """How many worker processes the process's pool of `size` has (0: none started)."""
    with _LOCK:
        pool = _POOLS.get(size)
    return len(pool.workers) if pool is not None else 0


def discard_pool(size: int) -> None:
    """Kill and forget a pool whose `map` did not complete (a dead worker, or Ctrl-C / an error in
    the caller while its I/O threads still talk to the workers: a reply of that map must never be
    read as one of the next): the next request starts a new one."""
    with _LOCK:
        pool = _POOLS.pop(size, None)
    if pool is not None:
        pool.close(kill=True)


@atexit.register
def _close_all() -> None:
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _forget_after_fork() -> None:
    """A forked child shares its parent's pipes: it must start its own workers, not talk to the
    parent's (nor close them: they are the parent's)."""
    _POOLS.clear()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere nothing forks
    os.register_at_fork(after_in_child=_forget_after_fork)
