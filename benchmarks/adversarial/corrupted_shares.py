"""Earlier attack kept in the table: dishonest devices send corrupted Shamir shares of a
neighbour's self-mask seed at unmasking, hoping for a wrong sum. Robust reconstruction routes
around them while t good shares remain. Runs the real in-process round of
`tests/test_secagg_adversarial.py`, which checks the sum against the survivors' inputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_secagg_adversarial import _corrupt_shares_of, _round  # noqa: E402  (the real round)


def run() -> list[dict]:
    owner, liars = 6, {0, 3}
    try:
        report = _round(_corrupt_shares_of(owner, liars))
        wrong, survivors, reported = False, len(report.survivors), report.inconsistent.get(owner, [])
    except AssertionError:  # the round's sum differs from the survivors' inputs
        wrong, survivors, reported = True, None, []
    return [{
        "name": "corrupted_unmask_shares",
        "succeeded_on_old_main": False,  # robust reconstruction predates this table
        "succeeds_now": wrong,
        "value": {"sum_wrong": wrong, "survivors": survivors, "liars": sorted(liars),
                  "liars_reported": sorted(reported)},
    }]
