"""Measurements behind `dpfleet secagg bench` and `benchmarks/secagg_grid.py`.

`bench_round` runs one whole round in-process on random ring vectors and checks the unmasked
sum against the plain one. Two times are reported: `wall_seconds`, everything run one party
after the other in this process, and `round_seconds`, the critical path when clients run in
parallel on their own devices (per phase: the slowest client plus the server), network
excluded. The throughput probes compare mask expansion with the raw AES-128-CTR speed of the
same library on this machine.
"""

from __future__ import annotations

import struct
import time

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpfleet.secagg import crypto
from dpfleet.secagg.inprocess import PHASES, run_round
from dpfleet.secagg.params import plan_round


def random_input(seed: int, client: int, dim: int, bits: int) -> np.ndarray:
    """Client `client`'s pseudorandom vector in Z_(2^bits) (AES-CTR: numpy's generators
    would take longer than the masking being measured)."""
    vector = crypto.prg(struct.pack("<QQ", seed, client), dim, crypto.ring_dtype(bits))
    vector &= vector.dtype.type((1 << bits) - 1)
    return vector


def bench_round(
    clients: int,
    dim: int,
    dropout: float = 0.0,
    graph: str = "harary",
    bits: int = 32,
    signed: bool = False,
    corruption: float = 0.05,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """One round with `dropout` of the clients vanishing after sharing keys (the case that
    makes the server rebuild their pairwise masks); k and t are planned for that dropout."""
    setup, identities, plan = plan_round(clients, dim, bits, graph, None, dropout, corruption,
                                         signed)
    rng = np.random.default_rng([seed, 0xD0])
    dropped = rng.choice(clients, size=round(dropout * clients), replace=False).tolist()
    started = time.perf_counter()
    report = run_round(setup, lambda u: random_input(seed, u, dim, bits), identities,
                       dropouts={"mask": dropped}, progress=progress)
    wall = time.perf_counter() - started

    expected = np.zeros(dim, dtype=setup.dtype)
    for u in report.survivors:
        expected += random_input(seed, u, dim, bits)
    expected &= setup.dtype.type(setup.modulus_mask)

    client = {p: list(report.client_seconds[p].values()) or [0.0] for p in PHASES}
    sent = list(report.bytes_sent.values())
    received = list(report.bytes_received.values())
    return {
        "clients": clients,
        "dim": dim,
        "dropout": dropout,
        "graph": "complete" if setup.k == setup.n - 1 else "harary",
        "k": setup.k,
        "threshold": setup.threshold,
        "threshold_bounded": plan.bounded,
        "bits": bits,
        "signed": signed,
        "survivors": len(report.survivors),
        "client_seconds_mean": {p: float(np.mean(v)) for p, v in client.items()},
        "client_seconds_max": {p: float(np.max(v)) for p, v in client.items()},
        "server_seconds": dict(report.server_seconds),
        "bytes_sent_per_client": {"mean": float(np.mean(sent)), "max": int(np.max(sent))},
        "bytes_received_per_client": {"mean": float(np.mean(received)),
                                      "max": int(np.max(received))},
        # mean over clients; "sent" in phase p is the client's message of p, "received" the
        # server message that prompted it
        "bytes_sent_per_client_by_phase": {
            p: report.phase_bytes_sent[p] / clients for p in PHASES},
        "bytes_received_per_client_by_phase": {
            p: report.phase_bytes_received[p] / clients for p in PHASES},
        "upload_floor_bytes": dim * bits / 8,  # the masked vector itself, d * b / 8
        "round_seconds": sum(max(client[p]) + report.server_seconds[p] for p in PHASES),
        "wall_seconds": wall,
        "rejections": len(report.rejections),
        "sum_exact": bool(np.array_equal(report.total, expected)),
    }


def cipher_throughput(megabytes: int = 256, repeats: int = 3) -> float:
    """Raw AES-128-CTR of `cryptography` on this machine, GB/s (best of `repeats`)."""
    size = megabytes << 20
    zeros, out = bytes(size), bytearray(size + 15)
    cipher = Cipher(algorithms.AES(bytes(16)), modes.CTR(bytes(16))).encryptor()
    return _best(lambda: cipher.update_into(zeros, out), size, repeats)


def expansion_throughput(megabytes: int = 256, streams: int = 1, repeats: int = 3) -> float:
    """GB/s of PRG output folded into a ring vector by `crypto.add_streams` (streams > 1:
    several masks summed into the same accumulator, as a client does)."""
    acc = np.zeros((megabytes << 20) // 4, dtype=np.uint32)
    seeds = [bytes([i]) * crypto.SEED_BYTES for i in range(streams)]
    return _best(lambda: crypto.add_streams(acc, seeds, []), acc.nbytes * streams, repeats)


def _best(work, nbytes: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9
