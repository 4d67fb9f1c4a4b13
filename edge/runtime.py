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

from dpfleet.edge.minibatch import (  # noqa: F401  (re-exported: runtimes and trainers import them here)
    batches,
    check_examples,
    fixed_shape_batches,
)
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

    def __init__(self, cfg: ModelConfig, threads: int | None = None, model: torch.nn.Module | None = None):
        """`model`: train this module instead of the zoo's `cfg` model (`dpfleet.simulate`'s own)."""
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model = build_model(cfg) if model is None else model

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
