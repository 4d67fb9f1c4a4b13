"""Which clients take part in each round.

`disjoint` (paper 000 App. C): one seeded permutation, consecutive blocks of `report_goal`, so
each client participates at most once and single-participation accounting applies. `uniform`:
a fresh seeded draw every round (clients may repeat; only the participation-aware accountant of
issue 3 covers it).
"""

from __future__ import annotations

import numpy as np

from dpfleet.errors import DpfleetError


class ClientSampler:
    def __init__(self, num_clients: int, report_goal: int, mode: str, seed: int, rounds: int):
        if report_goal > num_clients:
            raise DpfleetError(
                f"dp.report_goal={report_goal} exceeds the {num_clients} training clients"
            )
        if mode == "disjoint" and rounds * report_goal > num_clients:
            raise DpfleetError(
                f"disjoint sampling needs rounds * report_goal = {rounds * report_goal} clients "
                f"but there are {num_clients}; lower rounds or dp.report_goal, "
                "or set dp.sampling = 'uniform'"
            )
        self.n, self.m, self.mode, self.seed = num_clients, report_goal, mode, seed
        self._order = np.random.default_rng([seed, 0x5A]).permutation(num_clients)

    def select(self, round_idx: int) -> list[int]:
        if self.mode == "disjoint":
            return self._order[round_idx * self.m : (round_idx + 1) * self.m].tolist()
        rng = np.random.default_rng([self.seed, 0x5B, round_idx])
        return sorted(rng.choice(self.n, self.m, replace=False).tolist())
