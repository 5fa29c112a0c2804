"""ChildProcess, the host-side processes of a sandbox (launcher, wrapper, local helper)."""

from __future__ import annotations

import os

import trio
import trio.testing

from rolloutd.sandbox._child import ChildProcess


async def test_several_tasks_wait_for_one_child():
    """A request that found the helper gone waits for its exit status while the teardown
    waits for the same process: both get it (Trio lets one task at a time wait on the
    pidfd itself)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        child = ChildProcess.spawn(["/bin/sh", "-c", "read line; exit 7"], env={}, stderr=null)
    finally:
        os.close(null)
    assert child.stdin is not None and child.stdout is not None
    codes = []

    async def wait() -> None:
        codes.append(await child.wait())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await child.stdin.aclose()  # EOF: the child exits
    await child.stdout.aclose()
    assert codes == [7, 7]
