"""Cohort chunks in worker processes (edge/cohort_pool.py): the same bits as in-process training,
clear failures, no re-run of the user's script, no orphans.

The workers here are the real thing (`python -c` children over pipes); nothing is faked.
"""

import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dpfleet.edge import cohort_pool
from dpfleet.edge.cohort import CohortTrainer, _deal
from dpfleet.edge.cohort_pool import WorkerError, WorkerPool, discard_pool, shared_pool
from dpfleet.edge.precision import native_bf16
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat

CFG = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=16, hidden_dim=24, projection_dim=16)


def clients(seed: int, n: int = 7) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        rows = rng.integers(4, 64, (int(rng.integers(3, 40)), 10)).astype(np.int32)
        rows[:, 0] = 1
        examples.append(rows)
    return examples, [int(s) for s in rng.integers(0, 2**31, n)]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def round_deltas(processes: bool, examples, seeds, theta, precision: str = "float32") -> np.ndarray:
    trainer = CohortTrainer(CFG, seq_len=9, batch_size=4, device="cpu", chunk=2, processes=processes,
                            precision=precision)
    ups = trainer.train_round(theta, examples, seeds, lr=0.5, batch_size=4, clip_norm=1e9)
    return np.stack([u.delta for u in ups])


def test_processes_give_the_bits_of_in_process_threads(two_threads):
    """Four chunks over two workers, against the thread path: equal bit for bit (a chunk's result
    does not depend on where it ran), and the workers were really used."""
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    examples, seeds = clients(1)
    calls = []
    real_map = WorkerPool.map

    def counting(self, fn, args):
        calls.append(len(args))
        return real_map(self, fn, args)

    WorkerPool.map = counting
    try:
        in_workers = round_deltas(True, examples, seeds, theta)
    finally:
        WorkerPool.map = real_map
    on_threads = round_deltas(False, examples, seeds, theta)
    assert calls == [4]
    assert np.array_equal(in_workers, on_threads)
    assert np.abs(in_workers).max() > 1e-3  # they trained


@pytest.mark.skipif(native_bf16() is None, reason="no native BF16 here (or ATEN_CPU_CAPABILITY=default)")
def test_bfloat16_chunks_in_processes_give_the_bits_of_threads(two_threads):
    """The bfloat16 path in worker processes: the thread path's bits (same machine, same
    precision, same bits), not float32's."""
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    examples, seeds = clients(2)
    in_workers = round_deltas(True, examples, seeds, theta, "bfloat16")
    assert np.array_equal(in_workers, round_deltas(False, examples, seeds, theta, "bfloat16"))
    assert not np.array_equal(in_workers, round_deltas(False, examples, seeds, theta))


@pytest.fixture(scope="module")
def one_worker():
    """One worker for the protocol tests that leave it serving (each asserts that it does): a
    worker's start imports torch, seconds each."""
    pool = WorkerPool(1)
    yield pool
    pool.close()


def test_a_task_that_raises_in_a_worker_carries_its_traceback(one_worker):
    with pytest.raises(WorkerError, match="math domain error") as info:
        one_worker.map(math.sqrt, [(-1.0,)])
    assert "Traceback" in str(info.value)
    assert one_worker.map(math.sqrt, [(4.0,)]) == [2.0]  # the worker lives on


def test_a_stray_write_to_stdout_in_a_worker_cannot_forge_or_break_a_reply(one_worker):
    """A C library (OpenMP's 'OMP: Info', a print in native code) writes straight to fd 1: the
    protocol must not share it. Attack: bytes that look like a reply header are written to fd 1
    during a task; the parent still gets each task's own result."""
    forged = struct.pack("<Q", 4) + b"junk"  # a well-formed header of a 4-byte 'reply'
    assert one_worker.map(os.write, [(1, forged)]) == [len(forged)]  # os.write returns its count
    assert one_worker.map(math.sqrt, [(25.0,)]) == [5.0]  # the stream is still in step


def test_ctrl_c_is_left_to_the_parent():
    """A terminal's SIGINT reaches the workers too: they ignore it (no traceback of their own)
    and keep serving; the parent decides."""
    pool = WorkerPool(1)
    try:
        assert pool.map(math.sqrt, [(9.0,)]) == [3.0]
        os.kill(pool.workers[0].proc.pid, signal.SIGINT)
        time.sleep(0.2)
        assert pool.workers[0].proc.poll() is None
        assert pool.map(math.sqrt, [(16.0,)]) == [4.0]
    finally:
        pool.close()
    assert pool.workers[0].proc.returncode == 0  # stdin closed: a clean exit


def test_a_killed_worker_is_a_clear_error_and_the_next_round_starts_new_workers(two_threads):
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    examples, seeds = clients(2)
    pool = shared_pool(2)
    pool.map(math.sqrt, [(1.0,), (1.0,)])  # both workers up
    pool.workers[1].proc.kill()
    pool.workers[1].proc.wait()
    with pytest.raises(DpfleetError, match="exited .*out of memory or killed"):
        round_deltas(True, examples, seeds, theta)
    fresh = shared_pool(2)
    assert fresh is not pool
    assert np.array_equal(round_deltas(True, examples, seeds, theta),
                          round_deltas(False, examples, seeds, theta))


def test_ctrl_c_during_a_round_kills_the_pool_so_no_stale_reply_is_read(two_threads, monkeypatch):
    """Ctrl-C lands in the caller while the pool's I/O threads still await the workers' replies:
    the pool is killed and replaced, and the next round gets its own results, not the old ones."""
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    examples, seeds = clients(3)
    pool = shared_pool(2)
    real_map = WorkerPool._map

    stale = []

    def in_flight(self, fn, args):  # the I/O of the interrupted map, still running
        try:
            real_map(self, fn, args)
        except WorkerError as exc:  # its workers were killed under it
            stale.append(exc)

    def interrupted(self, fn, args):
        threading.Thread(target=in_flight, args=(self, fn, args), daemon=True).start()
        raise KeyboardInterrupt

    monkeypatch.setattr(WorkerPool, "_map", interrupted)
    with pytest.raises(KeyboardInterrupt):
        round_deltas(True, examples, seeds, theta)
    monkeypatch.setattr(WorkerPool, "_map", real_map)
    assert all(w.proc.poll() is not None for w in pool.workers)  # killed
    fresh = shared_pool(2)
    assert fresh is not pool
    other_theta = theta + 0.01
    assert np.array_equal(round_deltas(True, examples, seeds, other_theta),
                          round_deltas(False, examples, seeds, other_theta))


SCRIPT = textwrap.dedent("""
    # no `if __name__ == "__main__"` guard: a multiprocessing spawn child would run this again
    import sys, time
    import numpy as np, torch
    print("TOP-LEVEL RAN", flush=True)
    torch.set_num_threads(2)
    from dpfleet.edge.cohort import CohortTrainer, _deal
    from dpfleet.edge.cohort_pool import shared_pool
    from dpfleet.export.models import ModelConfig
    cfg = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=8, hidden_dim=8, projection_dim=8)
    pool = shared_pool(2)
    rng = np.random.default_rng(0)
    ex = [np.c_[np.ones((5, 1), np.int32), rng.integers(4, 64, (5, 6))].astype(np.int32) for _ in range(4)]
    t = CohortTrainer(cfg, seq_len=6, batch_size=2, device="cpu")
    ups = t.train_round(np.zeros(sum(t.layout.sizes), np.float32), ex, [1, 2, 3, 4], lr=0.1,
                        batch_size=2, clip_norm=1.0)
    print("WORKERS", *[w.proc.pid for w in pool.workers], flush=True)
""")


@pytest.mark.slow
def test_workers_do_not_rerun_the_users_script_and_exit_with_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("TOP-LEVEL RAN") == 1
    pids = [int(p) for p in out.stdout.split("WORKERS")[1].split()]
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:  # the script's exit closed their stdin; they ended (and init reaped them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_forked_child_does_not_reuse_its_parents_workers():
    pool = shared_pool(1)
    pid = os.fork()
    if pid == 0:  # child: its pools were forgotten at fork
        os._exit(0 if not cohort_pool._POOLS else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shared_pool(1) is pool  # the parent's pool is untouched
    discard_pool(1)


@given(st.integers(0, 60), st.integers(1, 6))
def test_dealing_chunks_back_and_forth_keeps_every_client_once_and_balances(n, hands):
    dealt = _deal(list(range(n)), hands)
    assert sorted(c for hand in dealt for c in hand) == list(range(n))
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 1
    for hand in dealt:  # each hand stays longest-first (the prefix rule of train_chunk)
        assert hand == sorted(hand)
    if n % (2 * hands) == 0:  # whole back-and-forth rounds: every hand gets the same rank sum
        assert len({sum(hand) for hand in dealt}) == 1  # (in turn, hand 0 would get the longest)
