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

from dpfleet.edge.minibatch import batches
from dpfleet.edge.model_output import logits_of
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


class LocalSGD:
    """The built-in local training (`dpfleet.extensions.LocalUpdate`): one epoch of plain SGD over
    the user's rows in seeded shuffled minibatches, mean next-token loss with PAD targets unscored.
    The cohort trainer and the exported phone programs are batched / compiled forms of exactly
    this loop (their deltas are tested against it)."""

    def __call__(self, model: torch.nn.Module, rows: torch.Tensor, *, lr: float, batch_size: int,
                 seed: int) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = []
        for idx in batches(len(rows), batch_size, seed):
            batch = rows[idx]
            loss = next_token_loss(logits_of(model(batch[:, :-1])), batch[:, 1:], PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return float(np.mean(losses)) if losses else float("nan")


class EagerRuntime:
    """The reference runtime: eager PyTorch on CPU."""

    name = "eager"

    def __init__(self, cfg: ModelConfig, threads: int | None = None, model: torch.nn.Module | None = None,
                 local_update=None):
        """`model`: train this module instead of the zoo's `cfg` model (`dpfleet.simulate`'s own);
        `local_update`: a `dpfleet.extensions.LocalUpdate` instead of the built-in `LocalSGD`."""
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model = build_model(cfg) if model is None else model
        self.local_update = LocalSGD() if local_update is None else local_update

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
        self.model.train()
        loss = self.local_update(self.model, data, lr=lr, batch_size=batch_size, seed=seed)
        return EpochResult(float(loss), -(-len(data) // batch_size))
