"""One device's contribution to a round: local training, delta, L2 clip.

delta = theta - theta0 after one local epoch of SGD, clipped to norm C as a whole vector so the
server's sum has user-level sensitivity C (paper 002 Alg. 1). The unclipped norm is kept for
adaptive clipping (quantile estimation needs only the bit `norm <= C`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dpfleet.edge.clipping import clip_l2
from dpfleet.edge.runtime import TrainingRuntime


@dataclass
class ClientUpdate:
    delta: np.ndarray  # float32, clipped
    norm: float  # L2 norm before clipping
    clipped: bool
    loss: float
    num_examples: int


def client_update(
    runtime: TrainingRuntime,
    theta0: np.ndarray,
    examples: np.ndarray,
    *,
    lr: float,
    batch_size: int,
    clip_norm: float,
    seed: int,
    clip: Clip | None = None,
) -> ClientUpdate:
    runtime.set_weights(theta0)
    result = runtime.train_epoch(examples, lr=lr, batch_size=batch_size, seed=seed)
    return finish_update(runtime.get_weights() - theta0, clip_norm, result.mean_loss, len(examples), clip)


Clip = Callable[[np.ndarray, float], tuple[np.ndarray, float]]  # `dpfleet.extensions.ClippingRule`


def finish_update(delta: np.ndarray, clip_norm: float, loss: float, num_examples: int,
                  clip: Clip | None = None) -> ClientUpdate:
    """Clip a trained delta with `clip` (a `dpfleet.extensions.ClippingRule`; default the L2 clip
    `clip_l2`); shared by the sequential and the cohort trainers. The driver checks the result's
    norm against the bound before aggregation (`extensions.check_clipped`).

    A narrower delta (bfloat16 or float16 training) is cast to float32 first: its norm is taken,
    and it is clipped and summed, in float32, so the bound holds for the delta that is summed."""
    if delta.dtype != np.float64:
        delta = np.asarray(delta, dtype=np.float32)
    if not np.isfinite(delta).all():  # diverged local training contributes nothing, not NaN
        return ClientUpdate(np.zeros_like(delta), float("inf"), True, loss, num_examples)
    clipped, norm = (clip_l2 if clip is None else clip)(delta, clip_norm)
    return ClientUpdate(clipped, norm, norm > clip_norm, loss, num_examples)
