"""Interruptions at known points, for the resume tests: they stand in for a killed process or a
Ctrl-C, which a test cannot deliver at an exact round."""

from collections.abc import Callable


class Crash(Exception):
    """Stands in for a killed process."""


def failing_on_call(func: Callable, n: int, exc: type[BaseException] = Crash) -> Callable:
    """`func`, except that its n-th call raises `exc`."""
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc
        return func(*args, **kwargs)

    return wrapper


def failing_on_round(monkeypatch, n: int, exc: type[BaseException] = Crash) -> None:
    """Makes the n-th round's client training raise `exc`, whichever trainer (sequential or
    cohort, coordinator/engine/backends.py) the simulation picks; rounds count across runs."""
    import dpfleet.coordinator.engine.simulation as simulation

    real_make = simulation.make_trainer
    tick = failing_on_call(lambda: None, n, exc)

    def make_trainer(*args, **kwargs):
        trainer = real_make(*args, **kwargs)
        train_round = trainer.train_round

        def counted(*a, **kw):
            tick()
            return train_round(*a, **kw)

        trainer.train_round = counted
        return trainer

    monkeypatch.setattr(simulation, "make_trainer", make_trainer)
