"""Who trains a round's clients: one after another through a runtime, or as one cohort.

`run_simulation` only calls `trainer.train_round(theta, examples, seeds, ...)` and gets the
per-client clipped updates back in the order it asked for them, so the rest of the round (secure
aggregation, DP-FTRL, adaptive clipping, accounting) does not know which trainer ran.

* `sequential`: `client_update` per client through the configured runtime; the reference, and
  the only path for exported ExecuTorch / ONNX programs.
* `cohort`: `edge.cohort.CohortTrainer`, all clients of a chunk at once (eager torch only).
* `auto` (default): cohort when the runtime is eager (every zoo model supports it), else sequential.
* `[backend] kind = "ray"`: the cohort trainer sharded over Ray workers (`ray_backend.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dpfleet.coordinator.config import BackendSection
from dpfleet.edge.client_update import ClientUpdate, Clip, client_update
from dpfleet.edge.runtime import TrainingRuntime
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig

TRAINERS = ("auto", "sequential", "cohort")


class RoundTrainer(Protocol):
    name: str

    def train_round(self, theta0: np.ndarray, examples: Sequence[np.ndarray], seeds: Sequence[int],
                    *, lr: float, batch_size: int, clip_norm: float) -> list[ClientUpdate]:
        """Each client's clipped update from the round's model `theta0`, in input order."""


class SequentialTrainer:
    """One client after another through a `TrainingRuntime` (the reference path)."""

    name = "sequential"

    def __init__(self, runtime: TrainingRuntime, clip: Clip | None = None):
        """`clip`: a `dpfleet.extensions.ClippingRule` (default the L2 clip)."""
        self.runtime, self.clip = runtime, clip

    def train_round(self, theta0: np.ndarray, examples: Sequence[np.ndarray], seeds: Sequence[int],
                    *, lr: float, batch_size: int, clip_norm: float) -> list[ClientUpdate]:
        return [
            client_update(self.runtime, theta0, x, lr=lr, batch_size=batch_size, clip_norm=clip_norm,
                          seed=s, clip=self.clip)
            for x, s in zip(examples, seeds, strict=True)
        ]


def make_trainer(kind: str, runtime: TrainingRuntime, model_cfg: ModelConfig, *, seq_len: int,
                 batch_size: int, device: str = "auto", memory_mb: int = 160,
                 backend: BackendSection | None = None, precision: str = "float32") -> RoundTrainer:
    """The trainer named by `client.trainer` ("auto" picks the fastest correct one). `precision`
    (`client.precision`) is the cohort trainer's, local or on Ray workers (resolved on their
    CPUs: `ray_backend.cluster_precision`); the sequential trainer runs float32."""
    if kind not in TRAINERS:
        raise DpfleetError(f"client.trainer must be one of {TRAINERS}, not {kind!r}")
    eager = runtime.name == "eager"
    if backend is not None and backend.kind == "ray":
        if not eager or kind == "sequential":
            raise DpfleetError("backend.kind = 'ray' runs the cohort trainer: it needs runtime = "
                               "'eager' and client.trainer = 'auto' or 'cohort'")
        from dpfleet.coordinator.engine.ray_backend import RayTrainer

        ray_device = "cpu" if device == "auto" else device
        return RayTrainer(model_cfg, seq_len=seq_len, batch_size=batch_size, workers=backend.workers,
                          address=backend.address, memory_mb=memory_mb, device=ray_device,
                          precision=precision)
    if kind == "cohort" and not eager:
        raise DpfleetError(
            f"client.trainer = 'cohort' trains eager torch; runtime {runtime.name!r} needs 'sequential'"
        )
    if kind == "sequential" or not eager:
        return SequentialTrainer(runtime)
    from dpfleet.edge.cohort import CohortTrainer

    return CohortTrainer(model_cfg, seq_len=seq_len, batch_size=batch_size, device=device,
                         memory_mb=memory_mb, precision=precision)


def trainer_precision(trainer: object) -> dict:
    """summary.json's `precision`: what a trainer's GEMMs ran at and why, and at bfloat16 its
    `elementwise` kernels (`CohortTrainer.elementwise`; a Ray trainer's are its workers'). A
    trainer without a `precision` (sequential, a caller's client update) runs float32."""
    precision = getattr(trainer, "precision", None)
    if precision is None:
        return {"used": "float32", "reason": f"the {getattr(trainer, 'name', 'custom')} trainer runs float32"}
    return {"used": precision.name, "reason": precision.reason, **getattr(trainer, "elementwise", {})}
