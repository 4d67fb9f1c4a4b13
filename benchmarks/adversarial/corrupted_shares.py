"""Earlier attack kept in the table: dishonest devices send corrupted Shamir shares of a
neighbour's self-mask seed at unmasking, hoping for a wrong sum (or an abort). Robust
reconstruction routes around them while t good shares remain; the sum stays exact."""

from __future__ import annotations

import dataclasses

import numpy as np

from dpfleet.secagg import messages as m
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import plan_round

N, LENGTH, BITS, T = 7, 40, 16, 4


def run() -> list[dict]:
    setup, keys, _ = plan_round(N, LENGTH, BITS, graph="complete", threshold=T)
    inputs = np.random.default_rng(1).integers(0, 1 << BITS, (N, LENGTH)).astype(setup.dtype)
    owner, liars = 6, {0, 3}

    def intercept(phase, sender, recipient, data):
        if phase != "unmask" or sender not in liars:
            return [data]
        message = m.decode(data)
        junk = np.random.default_rng(sender).integers(0, 2**31 - 1, 8, dtype=np.uint32)
        shares = tuple((w, junk.astype("<u4").tobytes() if w == owner else s)
                       for w, s in message.self_mask)
        return [m.encode(dataclasses.replace(message, self_mask=shares))]

    report = run_round(setup, inputs.__getitem__, keys, None, intercept)
    expected = inputs[list(report.survivors)].astype(np.int64).sum(axis=0) % (1 << BITS)
    wrong = int(np.count_nonzero(np.asarray(report.total, dtype=np.int64) != expected))
    return [{
        "name": "corrupted_unmask_shares",
        "succeeded_on_old_main": False,  # robust reconstruction predates this table
        "succeeds_now": wrong > 0,
        "value": {"wrong_coordinates_in_sum": wrong, "survivors": len(report.survivors),
                  "liars_reported": sorted(report.inconsistent.get(owner, []))},
    }]
