"""One example of each extension point (`dpfleet.extensions`), all four in one run.

    python examples/extensions.py [RUN_DIR]

* client update: `LocalAdam`, a few local epochs of Adam instead of one epoch of SGD;
* clipping rule: `PerLayerClip`, each parameter tensor clipped to its share of the bound;
* noise mechanism: `IndependentGaussian`, fresh Gaussian noise on every round's sum (DP-SGD's
  noise, no tree), with its zCDP declared;
* participation policy: `CyclicPolicy`, devices in fixed groups that take turns (the cyclic
  participation of the matrix-factorization papers).

The model and the users are `examples/custom_model.py`'s (a GRU over Shakespeare's speakers).
The docs page docs/extending.md shows the four classes from this file; tests/test_extensions.py
runs it.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import dpfleet
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.errors import DpfleetError
from dpfleet.extensions import Eligible, clip_l2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import custom_model  # noqa: E402

# custom_model.py's data and tokenizer; plain aggregation (a custom mechanism adds float noise to
# the sum, not in secure aggregation's ring), cyclic groups of 4 under the guard's MinS 3
CONFIG = {**{k: v for k, v in custom_model.CONFIG.items() if k != "aggregation"}, "rounds": 8,
          "eval_every": 4, "client": {"lr": 0.5, "batch_size": 16},
          "dp": {"noise_multiplier": 0.5, "clip_norm": 0.5, "report_goal": 10, "momentum": 0.9},
          "participation": {"mode": "uniform", "min_separation": 3}}


# --8<-- [start:client_update]
class LocalAdam:
    """`LocalUpdate`: `epochs` local epochs of Adam at its own learning rate."""

    def __init__(self, lr: float = 0.01, epochs: int = 2):
        self.lr, self.epochs = lr, epochs

    def __call__(self, model: nn.Module, rows: torch.Tensor, *, lr: float, batch_size: int,
                 seed: int) -> float:
        opt = torch.optim.Adam(model.parameters(), lr=self.lr)  # the config's client.lr is SGD's
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(self.epochs):
            order = torch.randperm(len(rows), generator=gen)
            for start in range(0, len(rows), batch_size):
                batch = rows[order[start:start + batch_size]]
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), ignore_index=0)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return float(np.mean(losses))
# --8<-- [end:client_update]


# --8<-- [start:clipping]
class PerLayerClip:
    """`ClippingRule`: each parameter tensor's part of the delta clipped to bound / sqrt(L), so the
    whole delta's L2 norm is at most the bound (L tensors)."""

    def __init__(self, model: nn.Module):
        sizes = [p.numel() for p in model.parameters()]  # the flat delta's layout
        self.cuts = np.cumsum(sizes)[:-1]

    def __call__(self, delta: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
        parts = np.split(delta, self.cuts)
        share = bound / math.sqrt(len(parts)) * (1 - 1e-6)  # headroom for float rounding
        clipped = [clip_l2(part, share)[0] for part in parts]
        norm = float(np.linalg.norm(delta.astype(np.float64)))
        return np.concatenate(clipped).astype(np.float32), norm
# --8<-- [end:clipping]


# --8<-- [start:noise]
class IndependentGaussian:
    """`NoiseMechanism`: fresh N(0, std^2) noise on every round's sum, from the run's secret key.

    Accounting: each participation is one Gaussian mechanism of sensitivity C and noise z C,
    rho = 1 / (2 z^2); rounds compose, so a device seen at most MaxP times has rho = MaxP / (2 z^2),
    whatever the separation."""

    name = "independent Gaussian"

    def stream(self, dim: int, std: float, key: bytes):
        nodes = GaussianNodes(key, std, dim, domain=b"independent")  # its own keystream domain

        class Stream:
            t = 0

            def next_residual(self) -> np.ndarray:
                self.t += 1
                return nodes(0, 0, self.t)

        return Stream()

    def zcdp(self, noise_multiplier: float, rounds: int, min_separation: int | None,
             max_participation: int) -> float | None:
        return max_participation / (2 * noise_multiplier**2)
# --8<-- [end:noise]


# --8<-- [start:participation]
class CyclicPolicy:
    """`ParticipationPolicy`: device i belongs to group i mod `groups`; round r draws from group
    r mod `groups` only, so a device can take part at most once every `groups` rounds."""

    def __init__(self, groups: int, seed: int = 0):
        self.groups, self.seed = groups, seed

    def select(self, round_idx: int, eligible: Eligible, count: int) -> np.ndarray:
        devices = eligible.at(np.arange(eligible.count))
        group = devices[devices % self.groups == round_idx % self.groups]
        if group.size < count:
            raise DpfleetError(f"group {round_idx % self.groups} has {group.size} eligible devices, "
                               f"the round needs {count}")
        return np.random.default_rng([self.seed, round_idx]).choice(group, count, replace=False)
# --8<-- [end:participation]


def main(run_dir: Path, progress: bool = True, config: dict | None = None) -> dpfleet.Result:
    """`examples/custom_model.py`'s run with the four parts above."""
    return custom_model.main(run_dir, progress, config or CONFIG, lambda model: dict(
        client_update=LocalAdam(), clipping=PerLayerClip(model), noise=IndependentGaussian(),
        participation=CyclicPolicy(groups=4)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="dpfleet-ext-")))
