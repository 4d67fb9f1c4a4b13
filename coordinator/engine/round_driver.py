"""One round driver for `simulate` and `serve`: the per-round policy, written once.

Why one: the two ways a run gets its devices' clipped updates differ (in process, through the
cohort trainer; over HTTP, from devices that check in), but what a round does with them must
not. `drive` holds that policy, over a `Collector` that only gets the round's inputs:

    plan = await collector.open(engine)   # select (engine.open_round) and hand out: a RoundPlan,
                                          # a Stop (done / unfillable / budget), None (stopped)
    got = await collector.collect(plan)   # the round's sum (plain, or SecAgg decoded by
                                          # `secagg.round_sum`) and its devices' statistics
    fewer inputs than `inputs_needed`  -> engine.abandon_round, collector.failed: nothing is
                                          released, no noise drawn; the round opens again
    else engine.close_round (the DP step, the release, accounting) -> collector.committed
    -> the resume point when due -> on_round(record)

The rule both drivers follow for a short round: a round commits only with at least the report
goal's inputs in its sum, or with every device its plan closed with when timer participation
closed it with fewer (`participation.min_reports`); otherwise it is abandoned and opened again
under the same number. A device lost during aggregation (a SecAgg dropout) therefore needs
over-selection (`service.overselect`) to be absorbed, in `simulate` as in `serve`.

`simulate`'s collector never waits on anything, so its coroutine runs to its end without an
event loop (`run_to_end`): Ctrl-C lands where it lands, as in any synchronous code.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dpfleet.coordinator.config import SimulationConfig, round_size
from dpfleet.coordinator.engine.round_engine import ClientStats, RoundEngine, RoundPlan, Stop
from dpfleet.secagg.sums import AggregateResult

T = TypeVar("T")


@dataclass(frozen=True)
class Collected:
    """A round's inputs as the engine takes them: the sum and each planned device's statistics
    (`stats[i]` of `plan.devices[i]`; a device whose statistics the coordinator cannot see, as
    under SecAgg, has NaN ones)."""

    aggregate: AggregateResult
    stats: Sequence[ClientStats]


@dataclass(frozen=True)
class Failed:
    """The round could not be summed (too few reports by the deadline, SecAgg aborted)."""

    reason: str


class Collector(Protocol):
    """How a round's clipped updates are gathered: in process or over HTTP (module docstring)."""

    async def open(self, engine: RoundEngine) -> RoundPlan | Stop | None:
        """The next round opened with `engine.open_round` and handed out; None: stopped."""

    async def collect(self, plan: RoundPlan) -> Collected | Failed | None:
        """The open round's sum; None: stopped (the collector abandons the round itself)."""

    def closing(self, plan: RoundPlan) -> None:
        """Called just before the engine's commit of `plan`."""

    def committed(self, plan: RoundPlan, record: dict, seconds: float) -> None:
        """The round was released; `seconds` the engine's commit took."""

    def failed(self, plan: RoundPlan, reason: str) -> None:
        """The round was abandoned (the engine knows already); it opens again."""


def inputs_needed(cfg: SimulationConfig, plan: RoundPlan) -> int:
    """The fewest inputs `plan`'s round commits with (the module docstring's rule)."""
    return min(cfg.dp.report_goal, len(plan.devices))


def survivors_short(cfg: SimulationConfig, plan: RoundPlan, survivors: int) -> str | None:
    """Why a round with `survivors` inputs in its sum cannot commit, or None when it can."""
    need = inputs_needed(cfg, plan)
    if survivors >= need:
        return None
    return f"{survivors} of the round's {len(plan.devices)} devices are in the sum, it needs {need}"


def selection_extra(cfg: SimulationConfig) -> int:
    """Devices a round selects beyond the report goal: `service.overselect`'s (`round_size`), in
    `simulate` as in `serve` (timer participation over-selects with its own key)."""
    return round_size(cfg) - cfg.dp.report_goal


async def drive(engine: RoundEngine, collector: Collector,
                on_round: Callable[[dict], None] | None = None) -> Stop | None:
    """Rounds until the engine stops (its `Stop`, "done" included) or the collector is stopped
    (None). `on_round(record)` gets a copy of each committed round's record after its resume
    point (a callback that raises loses nothing)."""
    while True:
        plan = await collector.open(engine)
        if plan is None or isinstance(plan, Stop):
            return plan
        got = await collector.collect(plan)
        if got is None:
            return None
        if isinstance(got, Collected):
            short = survivors_short(engine.cfg, plan, len(got.aggregate.survivors))
            got = got if short is None else Failed(short)
        if isinstance(got, Failed):
            engine.abandon_round(plan)
            collector.failed(plan, got.reason)
            continue
        collector.closing(plan)
        began = time.monotonic()
        record = engine.close_round(plan, got.aggregate, got.stats)
        collector.committed(plan, record, time.monotonic() - began)
        if engine.resume_point_due():
            engine.save_resume_point()
        if on_round is not None:
            on_round(copy.deepcopy(record))


def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (an in-process collector's `drive`) in this thread,
    without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("an in-process round driver waited on something: it has no event loop")
