"""A node's rate while full (``Throughput``): the meter alone, on a hand-driven clock."""

from __future__ import annotations

import pytest

from rolloutd.daemon.throughput import Throughput


class Clock:
    """A hand-set clock (a test double for trio's)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def finish_every(meter: Throughput, clock: Clock, seconds: float, count: int) -> None:
    for _ in range(count):
        clock.now += seconds
        meter.finished()


def test_no_rate_until_enough_intervals_while_full():
    clock = Clock()
    meter = Throughput(window=8, minimum=4, clock=clock)
    meter.held(10, 4)
    finish_every(meter, clock, 2.0, 4)  # the first finish of a spell opens no interval
    assert meter.rate == 0.0
    finish_every(meter, clock, 2.0, 1)
    assert meter.rate == pytest.approx(0.5)


def test_only_time_spent_full_counts():
    """The ramp before a spell's first finish, the tail of a burst (fewer held than
    workers) and idle time between bursts say nothing of the node's speed."""
    clock = Clock()
    meter = Throughput(window=32, minimum=2, clock=clock)
    meter.held(8, 4)
    clock.now += 30.0  # the first rollouts at work
    finish_every(meter, clock, 1.0, 3)
    meter.held(3, 4)  # the tail: not full
    finish_every(meter, clock, 5.0, 3)
    clock.now += 600.0  # idle between bursts
    meter.held(12, 4)
    finish_every(meter, clock, 1.0, 3)
    assert meter.rate == pytest.approx(1.0)  # 4 intervals of 1 s


def test_the_window_keeps_the_latest_intervals():
    clock = Clock()
    meter = Throughput(window=4, minimum=4, clock=clock)
    meter.held(20, 4)
    finish_every(meter, clock, 1.0, 5)
    finish_every(meter, clock, 0.25, 4)  # the node got faster
    assert meter.rate == pytest.approx(4.0)


def test_finishes_at_one_instant_are_no_rate():
    clock = Clock()
    meter = Throughput(window=4, minimum=2, clock=clock)
    meter.held(20, 4)
    finish_every(meter, clock, 0.0, 5)
    assert meter.rate == 0.0


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="minimum"):
        Throughput(window=4, minimum=5)
