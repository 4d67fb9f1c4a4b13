"""Replaying a networked coordinator's log: rounds that over-selected have more contributors
than the report goal, and the coordinator's own MinS guard must still refuse a forged log."""

import pytest

from dpfleet.coordinator.config import ParticipationSection
from dpfleet.coordinator.engine.participation import Participation
from dpfleet.coordinator.engine.restore import replay
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.errors import DpfleetError

USERS = [f"u{i}" for i in range(20)]


def _state(min_separation: int = 0):
    section = ParticipationSection(mode="uniform", min_separation=min_separation)
    return (Participation(section, len(USERS), 3, 10, seed=0),
            RunAccountant(1.0, 1e-6, 0.0))


def test_overselected_rounds_replay_with_all_their_contributors():
    participation, accountant = _state()
    logged = [{"round": 0, "devices": ["u1", "u4", "u7", "u9", "u12"], "restart": False},
              {"round": 1, "devices": ["u2", "u3", "u5", "u8"], "restart": False}]
    replay(participation, accountant, logged, USERS, networked=True)
    assert participation.guard.count.sum() == 9  # every contributor recorded, not 3 per round
    assert participation.guard.count[[1, 4, 7, 9, 12, 2, 3, 5, 8]].tolist() == [1] * 9


def test_a_log_that_breaks_min_separation_is_refused():
    participation, accountant = _state(min_separation=2)
    logged = [{"round": 0, "devices": ["u1", "u4", "u7", "u9"], "restart": False},
              {"round": 1, "devices": ["u1", "u2", "u3"], "restart": False}]  # u1 again at once
    with pytest.raises(DpfleetError, match="does not replay"):
        replay(participation, accountant, logged, USERS, networked=True)


def test_operational_service_settings_may_change_but_overselect_may_not():
    from dpfleet.coordinator.state.resume import differing_keys

    saved = {"rounds": 5, "service": {"report_deadline_s": 30.0, "overselect": 0.0}}
    later = {"rounds": 5, "service": {"report_deadline_s": 90.0, "overselect": 0.0}}
    assert differing_keys(saved, later) == []
    assert differing_keys(saved, {**later, "service": {"report_deadline_s": 30.0,
                                                       "overselect": 0.3}}) == ["service"]
    assert differing_keys(saved, {**later, "rounds": 6}) == ["rounds"]
