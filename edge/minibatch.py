"""Minibatch order and fixed-shape batches of one local epoch, in numpy only.

Every runtime (eager, ExecuTorch, ONNX Runtime) and the torch-free reference device client
(`edge/device_client.py`) draw their minibatches here, so a phone following the bundle's manifest
visits the examples in exactly the simulator's order.
"""

from __future__ import annotations

import numpy as np

from dpfleet.edge.tokenizer import PAD
from dpfleet.errors import DpfleetError


def batches(n: int, batch_size: int, seed: int) -> list[np.ndarray]:
    """The shuffled minibatch index lists of one epoch; shared by all runtimes for parity."""
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def check_examples(examples: np.ndarray, vocab_size: int, seq_len: int) -> np.ndarray:
    """Validate token rows for a fixed-shape program; returns them as int64.

    Exported programs index embeddings natively, so an out-of-range id must be caught here, on the
    host, rather than read out of bounds inside the runtime.
    """
    if examples.ndim != 2 or examples.shape[1] < 2:
        raise DpfleetError(f"examples must be [n, L+1] token rows, got {examples.shape}")
    if examples.shape[1] - 1 > seq_len:
        raise DpfleetError(
            f"examples have {examples.shape[1] - 1} input tokens; the program takes at most {seq_len}"
        )
    rows = examples.astype(np.int64, copy=False)
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        raise DpfleetError(f"token ids must lie in [0, {vocab_size}), got {rows.min()}..{rows.max()}")
    return rows


def fixed_shape_batches(
    rows: np.ndarray, batch_size: int, seed: int, seq_len: int, pad_rows: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The minibatches of `batches()` as (inputs, targets) [b, seq_len] int64 arrays.

    Columns are PAD-extended to the program's length, and with `pad_rows` the last partial
    minibatch is PAD-filled to `batch_size` rows. Both are exact: the loss masks PAD targets,
    and neither a recurrent nor a causal model lets later positions change earlier outputs.
    """
    out = []
    for idx in batches(len(rows), batch_size, seed):
        b = batch_size if pad_rows else len(idx)
        block = np.full((b, seq_len + 1), PAD, dtype=np.int64)
        block[: len(idx), : rows.shape[1]] = rows[idx]
        out.append((np.ascontiguousarray(block[:, :-1]), np.ascontiguousarray(block[:, 1:])))
    return out
