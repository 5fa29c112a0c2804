"""daemon/node.py: the collector is off while the daemon starts, then the heap is frozen."""

from __future__ import annotations

import gc
import weakref

from rolloutd.daemon.node import freeze_start_heap


class Knot:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_garbage_goes_the_rest_is_frozen_and_the_collector_is_back_on():
    gc.disable()
    kept = Knot()
    dropped = weakref.ref(Knot())
    assert dropped() is not None  # the collector is off: the cycle lives on
    try:
        freeze_start_heap()
        assert gc.isenabled()
        assert dropped() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # frozen: never walked again
    finally:
        gc.unfreeze()
        gc.enable()
    assert any(obj is kept for obj in gc.get_objects())
