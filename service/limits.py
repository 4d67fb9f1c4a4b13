"""Per-device request rate limits: a token bucket per device id (429 with Retry-After beyond).

Why per device and in the coordinator: one misbehaving (or malicious) phone must not starve the
others' check-ins and uploads; body sizes are bounded separately by aiohttp's `client_max_size`
(413) before a body is read into memory.
"""

from __future__ import annotations

import time


class RateLimiter:
    """`rate` requests per second sustained, bursts up to `burst`, per key."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last time)

    def take(self, key: str, now: float | None = None) -> float:
        """0.0 when the request may go ahead, else the seconds until it may."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._buckets.clear()  # bounded memory; a flood of ids only resets everyone's burst
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0
