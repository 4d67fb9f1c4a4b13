"""One example of each extension point (`dpfleet.extensions`), all four in one run.

    python examples/extensions.py [RUN_DIR]

* client update: `LocalAdam`, a few local epochs of Adam instead of one epoch of SGD;
* clipping rule: `PerLayerClip`, each parameter tensor clipped to its share of the bound;
* noise mechanism: `DenseStrategy`, matrix-factorization noise from a strategy matrix you give
  (here a two-band Toeplitz C), with its sensitivity declared (an upper bound);
* participation policy: `CyclicPolicy`, users in fixed groups (by their user key) that take
  turns (the cyclic participation of the matrix-factorization papers).

The model and the users are `examples/custom_model.py`'s (a GRU over Shakespeare's speakers).
The docs page docs/extending.md shows the four classes from this file; tests/test_extensions.py
runs it.
"""

from __future__ import annotations

import math
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import dpfleet
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.errors import DpfleetError
from dpfleet.extensions import Eligible, Mechanism, clip_l2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import custom_model  # noqa: E402

# custom_model.py's data and tokenizer; plain aggregation (a custom mechanism adds float noise to
# the sum, not in secure aggregation's ring), cyclic groups of 4 under the guard's MinS 3
# a two-band Toeplitz strategy over the run's 8 rounds: C = I + 0.5 (subdiagonal)
STRATEGY = np.eye(8) + 0.5 * np.eye(8, k=-1)
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
class DenseStrategy(Mechanism):
    """`Mechanism`: matrix-factorization noise from a strategy C you give as a dense matrix.

    Round t's sum gets (C^-1 z)_t, z_t ~ N(0, (z C_clip)^2 I) drawn from the run's secret key, so
    the released prefix sums carry B z with A = B C (any lower-triangular C with a nonzero
    diagonal). Sensitivity (zero-out, a device in k rounds): ||C u|| <= the sum of the k largest
    column norms of C (triangle inequality over the device's columns, whatever the separation):
    an upper bound, so the run is accounted soundly if looser than the built-ins' exact ones.
    A resume replays the stream from the key (the base class's default)."""

    name = "dense"

    def __init__(self, matrix: np.ndarray):
        self.c = np.asarray(matrix, dtype=np.float64)
        n = self.c.shape[0]
        if self.c.shape != (n, n) or not np.allclose(self.c, np.tril(self.c)) or np.any(np.diag(self.c) == 0):
            raise DpfleetError("a dense strategy is a square lower-triangular matrix with a nonzero diagonal")
        self.norms = np.sort(np.linalg.norm(self.c, axis=0))[::-1]

    def identity(self) -> dict:
        return {"matrix": self.c.tolist()}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        if rounds > len(self.c):
            raise DpfleetError(f"the dense strategy covers {len(self.c)} rounds, not {rounds}")
        return (1 + len(restarts)) * float(self.norms[:max_participation].sum()) ** 2

    def stream(self, dim, std, key, segment=0, purpose="model"):
        z = GaussianNodes(key, std, dim, domain=b"dense-" + purpose.encode())  # its own keystream
        c = self.c

        class Stream:  # forward substitution: y_t = (z_t - sum_{j<t} C[t, j] y_j) / C[t, t]
            def __init__(self):
                self.tree_id, self.t, self.past = segment, 0, []

            def next_residual(self):
                row = c[self.t]
                y = z(segment, 0, self.t + 1).astype(np.float64)
                for j, prev in enumerate(self.past):
                    y -= row[j] * prev
                y /= row[self.t]
                self.past.append(y)
                self.t += 1
                return y.astype(np.float32)

            def state_dict(self):
                return {"tree_id": self.tree_id, "t": self.t}  # position only: resume replays

        return Stream()
# --8<-- [end:noise]


# --8<-- [start:participation]
class CyclicPolicy:
    """`ParticipationPolicy`: each user belongs to group crc32(user key) mod `groups`, by the key
    given in `users` (not by position, so a user keeps their group when others join); round r
    draws from group r mod `groups` only, so a device takes part at most once every `groups`
    rounds."""

    def __init__(self, groups: int, seed: int = 0):
        self.groups, self.seed = groups, seed

    def select(self, round_idx: int, eligible: Eligible, count: int) -> np.ndarray:
        devices = eligible.at(np.arange(eligible.count))
        groups = np.array([zlib.crc32(key.encode()) % self.groups for key in eligible.keys(devices)])
        group = devices[groups == round_idx % self.groups]
        if group.size < count:
            raise DpfleetError(f"group {round_idx % self.groups} has {group.size} eligible devices, "
                               f"the round needs {count}")
        return np.random.default_rng([self.seed, round_idx]).choice(group, count, replace=False)
# --8<-- [end:participation]


def main(run_dir: Path, progress: bool = True, config: dict | None = None) -> dpfleet.Result:
    """`examples/custom_model.py`'s run with the four parts above."""
    return custom_model.main(run_dir, progress, config or CONFIG, lambda model: dict(
        client_update=LocalAdam(), clipping=PerLayerClip(model), noise=DenseStrategy(STRATEGY),
        participation=CyclicPolicy(groups=4)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="dpfleet-ext-")))
