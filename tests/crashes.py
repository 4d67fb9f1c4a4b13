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
