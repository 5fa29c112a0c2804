"""A node's throughput while it is full: what federation placement weighs its share by."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

__all__ = ["Throughput"]


class Throughput:
    """Rollouts this node finishes per second while it is *full* (it holds at least as many
    rollouts as it has workers, so every finish is paced by its own speed, not by how much
    work it was given), over its last ``window`` intervals between two such finishes.

    Only intervals inside one full spell count: the ramp at a spell's start (the first
    rollouts still at work), the tail of a burst and idle time between bursts would
    otherwise read as a slow node. ``rate`` is 0.0 (not measured) until ``minimum``
    intervals are known.

    The pipeline calls ``held`` after every change in what it holds and ``finished`` when a
    rollout it ran ends (before it stops counting it). Uses ``clock`` (trio's by default),
    so an autojump clock drives it in tests.
    """

    def __init__(self, *, window: int = 32, minimum: int = 8,
                 clock: Callable[[], float] = trio.current_time) -> None:
        if not 0 < minimum <= window:
            raise ValueError(f"need 0 < minimum <= window, got {minimum} and {window}")
        self._intervals: deque[float] = deque(maxlen=window)
        self._minimum = minimum
        self._clock = clock
        self._full = False
        self._last: float | None = None  # the previous finish of the current full spell

    def held(self, count: int, slots: int) -> None:
        """The node now holds ``count`` rollouts and has ``slots`` workers."""
        full = slots > 0 and count >= slots
        if full != self._full:
            self._full = full
            self._last = None  # a spell begins or ends: no interval spans its edge

    def finished(self) -> None:
        """A rollout that ran here ended (call it while it still counts as held)."""
        if not self._full:
            return
        now = self._clock()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    @property
    def rate(self) -> float:
        """Finishes per second while full; 0.0 before ``minimum`` intervals."""
        total = sum(self._intervals)
        if len(self._intervals) < self._minimum or total <= 0:
            return 0.0
        return len(self._intervals) / total
