"""The runtime interface a device trains through.

A phone runs an exported training program (ExecuTorch `.pte` or ONNX); research sweeps run eager
torch. All runtimes expose the same four operations over the flat weight layout of
`dpfleet.export.params`, so the client update and the coordinator never know which one ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dpfleet.edge.tokenizer import PAD
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model, next_token_loss
from dpfleet.export.params import ParamLayout, get_flat, set_flat


@dataclass
class EpochResult:
    mean_loss: float
    steps: int


class TrainingRuntime(Protocol):
    name: str

    def set_weights(self, flat: np.ndarray) -> None:
        """Load a float32 weight vector (the round's model) into the program."""

    def get_weights(self) -> np.ndarray:
        """Read the current weights as a float32 vector."""

    def train_epoch(
        self, examples: np.ndarray, lr: float, batch_size: int, seed: int
    ) -> EpochResult:
        """One local epoch of plain SGD over `examples` (int rows [n, L+1], PAD-padded)."""


def batches(n: int, batch_size: int, seed: int) -> list[np.ndarray]:
    """The shuffled minibatch index lists of one epoch; shared by all runtimes for parity."""
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


class HostWeights:
    """Weights held on the host as one flat float32 vector (exported-program runtimes).

    The program reads them at the start of each epoch and they are updated in place, so
    swapping a round's model in costs one copy.
    """

    def __init__(self, cfg: ModelConfig):
        model = build_model(cfg)
        self.layout = ParamLayout.of(model)
        self._flat = get_flat(model)

    def set_weights(self, flat: np.ndarray) -> None:
        self.layout.split(flat)  # shape check
        self._flat = np.array(flat, dtype=np.float32)

    def get_weights(self) -> np.ndarray:
        return self._flat.copy()


class EagerRuntime:
    """The reference runtime: eager PyTorch on CPU."""

    name = "eager"

    def __init__(self, cfg: ModelConfig, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model = build_model(cfg)

    def set_weights(self, flat: np.ndarray) -> None:
        set_flat(self.model, flat)

    def get_weights(self) -> np.ndarray:
        return get_flat(self.model)

    def train_epoch(
        self, examples: np.ndarray, lr: float, batch_size: int, seed: int
    ) -> EpochResult:
        if examples.ndim != 2 or examples.shape[1] < 2:
            raise DpfleetError(f"examples must be [n, L+1] token rows, got {examples.shape}")
        data = torch.from_numpy(examples.astype(np.int64))
        opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.model.train()
        losses = []
        for idx in batches(len(data), batch_size, seed):
            rows = data[idx]
            loss = next_token_loss(self.model(rows[:, :-1]), rows[:, 1:], PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return EpochResult(float(np.mean(losses)) if losses else float("nan"), len(losses))


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
