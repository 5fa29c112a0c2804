"""BackendPool routing over scripted backends (TEST DOUBLES), on virtual time."""

import pytest
import trio

from rolloutd.daemon.llm.base import NoBackend, SamplingParams
from rolloutd.daemon.llm.pool import BackendPool, make_backend
from rolloutd.daemon.llm.scripted import LABEL, ScriptedBackend

P = SamplingParams()


def _pool(renderer, n, *, latency_s=1.0, **kw):
    pool = BackendPool(**kw)
    backends = [ScriptedBackend(renderer, ["ok"], latency_s=latency_s) for _ in range(n)]
    ids = [pool.add(b, backend_id=f"b{i}") for i, b in enumerate(backends)]
    return pool, backends, ids


async def test_sticky_per_rollout_and_balanced_new_rollouts(renderer, autojump_clock):
    pool, _, ids = _pool(renderer, 3)
    seen: dict[str, set[str]] = {}
    async with trio.open_nursery() as nursery:
        for r in range(6):
            async def rollout(key=f"r{r}"):
                for _ in range(3):
                    c = await pool.complete([1, 2, 3], P, max_tokens=8, sticky_key=key)
                    seen.setdefault(key, set()).add(c.extra["backend_id"])
                    assert c.backend == LABEL and c.extra["retries"] == 0 and c.extra["switches"] == []
                    await trio.sleep(0.5)  # a tool call between turns
            nursery.start_soon(rollout)
    assert all(len(v) == 1 for v in seen.values())  # every turn on one backend
    per_backend = [sum(1 for v in seen.values() if bid in v) for bid in ids]
    assert per_backend == [2, 2, 2]
    assert all(d["in_flight"] == 0 for d in pool.describe())  # counted down again
    stats = pool.statistics()
    assert stats["sticky_hits"] == 12 and stats["new_assignments"] == 6


async def test_group_members_share_a_backend(renderer, autojump_clock):
    pool, _, _ = _pool(renderer, 4)
    used = set()
    async with trio.open_nursery() as nursery:
        for r in range(4):
            async def rollout(key=f"g-r{r}"):
                c = await pool.complete([1], P, max_tokens=4, sticky_key=key, group_key="g")
                used.add(c.extra["backend_id"])
            nursery.start_soon(rollout)
    assert len(used) == 1
    for r in range(4):
        pool.forget(f"g-r{r}")
    assert pool.statistics()["groups"] == 0 and pool.statistics()["sticky_sessions"] == 0
    assert all(d["sessions"] == 0 for d in pool.describe())


async def test_least_loaded_counts_in_flight(renderer, autojump_clock):
    pool, backends, _ = _pool(renderer, 2, latency_s=10.0)
    backends[1].latency_s = 1.0
    # one long request on each backend; b1 finishes first, so new rollouts go to b1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: pool.complete([1], P, max_tokens=4, sticky_key="x"))
        nursery.start_soon(lambda: pool.complete([1], P, max_tokens=4, sticky_key="y"))
        await trio.sleep(2.0)
        assert [d["in_flight"] for d in pool.describe()] == [1, 0]
        pool.forget("y")
        c = await pool.complete([1], P, max_tokens=4, sticky_key="z")
        assert c.extra["backend_id"] == "b1"


async def test_failover_retries_elsewhere_and_records_the_switch(renderer, autojump_clock):
    pool, backends, _ = _pool(renderer, 2, health_interval_s=5.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        first = await pool.complete([1], P, max_tokens=4, sticky_key="r")
        home = first.extra["backend_id"]
        dead = backends[int(home[1])]

        async def kill_soon():
            await trio.sleep(0.5)
            dead.set_down(True)  # dies while serving the next turn

        nursery.start_soon(kill_soon)
        c = await pool.complete([1], P, max_tokens=4, sticky_key="r")
        other = "b1" if home == "b0" else "b0"
        assert c.extra["backend_id"] == other
        assert c.extra["retries"] == 1 and c.extra["switches"] == [other]
        d = {x["id"]: x for x in pool.describe()}
        assert not d[home]["healthy"] and d[home]["failures"] == 1
        # later turns stay on the new backend even after the old one recovers
        dead.set_down(False)
        await trio.sleep(6.0)  # a health probe brings it back
        assert {x["id"]: x for x in pool.describe()}[home]["healthy"]
        c = await pool.complete([1], P, max_tokens=4, sticky_key="r")
        assert c.extra["backend_id"] == other and c.extra["switches"] == []
        nursery.cancel_scope.cancel()


async def test_no_backend(renderer, autojump_clock):
    pool, backends, _ = _pool(renderer, 2)
    for b in backends:
        b.set_down(True)
    with pytest.raises(NoBackend):
        await pool.complete([1], P, max_tokens=4, sticky_key="r")
    with pytest.raises(NoBackend):
        await BackendPool().complete([1], P, max_tokens=4, sticky_key="r")


async def test_a_turn_waits_for_an_expected_backend(renderer, autojump_clock):
    """A supervised server still starting: the turn waits for it instead of failing."""
    pool = BackendPool(backend_wait_s=100.0)
    with pool.expect("srv"):
        async with trio.open_nursery() as nursery:
            async def register_later():
                await trio.sleep(30.0)
                pool.add(ScriptedBackend(renderer, ["ok"]), backend_id="srv")

            nursery.start_soon(register_later)
            t0 = trio.current_time()
            c = await pool.complete([1], P, max_tokens=4, sticky_key="r")
            assert c.extra["backend_id"] == "srv" and trio.current_time() - t0 == pytest.approx(30.0)
    # expected but never coming: NoBackend after backend_wait_s, saying so
    pool2 = BackendPool(backend_wait_s=100.0)
    with pool2.expect("srv"):
        t0 = trio.current_time()
        with pytest.raises(NoBackend, match="no healthy backend within 100 s"):
            await pool2.complete([1], P, max_tokens=4, sticky_key="r")
        assert trio.current_time() - t0 == pytest.approx(100.0)
    # nothing registered or expected: at once, whatever the wait (and not saying it waited)
    t0 = trio.current_time()
    with pytest.raises(NoBackend) as err:
        await BackendPool(backend_wait_s=100.0).complete([1], P, max_tokens=4, sticky_key="r")
    assert trio.current_time() == t0 and "within" not in str(err.value)


async def test_a_restarting_only_backend_is_retried_once_healthy(renderer, autojump_clock):
    """The only backend dies mid-turn while its supervisor restarts it: the turn waits and is
    retried on it once a health probe finds it back, counted as a retry. Without a supervisor
    expecting it back, the same death fails the turn at once."""
    pool, backends, _ = _pool(renderer, 1, health_interval_s=5.0, backend_wait_s=120.0)

    async def die_and_come_back():
        await trio.sleep(0.5)
        backends[0].set_down(True)
        await trio.sleep(20.0)
        backends[0].set_down(False)

    with pool.expect("b0"):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            nursery.start_soon(die_and_come_back)
            c = await pool.complete([1], P, max_tokens=4, sticky_key="r")
            assert c.extra["backend_id"] == "b0" and c.extra["retries"] >= 1
            assert trio.current_time() >= 20.5
            nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        nursery.start_soon(die_and_come_back)
        t0 = trio.current_time()
        with pytest.raises(NoBackend):
            await pool.complete([1], P, max_tokens=4, sticky_key="r")
        assert trio.current_time() - t0 < 2.0
        nursery.cancel_scope.cancel()


async def test_pause_waits_for_in_flight_and_resume_stamps_the_new_version(renderer, autojump_clock):
    pool, _, _ = _pool(renderer, 1, latency_s=3.0)
    results = {}
    async with trio.open_nursery() as nursery:
        async def turn(key):
            results[key] = await pool.complete([1], P, max_tokens=4, sticky_key=key)
        nursery.start_soon(turn, "a")
        await trio.sleep(1.0)
        t0 = trio.current_time()
        await pool.pause()  # returns once "a" is done
        assert trio.current_time() - t0 == pytest.approx(2.0)
        nursery.start_soon(turn, "b")  # waits while paused
        await trio.sleep(5.0)
        assert "b" not in results and pool.describe()[0]["paused"]
        pool.set_policy_version(7)
        pool.resume()
    assert results["a"].extra["policy_version_start"] == 0
    assert results["b"].extra["policy_version_start"] == 7 == results["b"].extra["policy_version_end"]


async def test_remove_moves_sticky_rollouts(renderer, autojump_clock):
    pool, _, _ = _pool(renderer, 2)
    c = await pool.complete([1], P, max_tokens=4, sticky_key="r")
    await pool.remove(c.extra["backend_id"])
    c2 = await pool.complete([1], P, max_tokens=4, sticky_key="r")
    assert c2.extra["switches"] == [c2.extra["backend_id"]] != [c.extra["backend_id"]]
    assert len(pool.describe()) == 1
    with pytest.raises(KeyError):
        await pool.remove("nope")


def test_make_backend_specs(renderer):
    from rolloutd.daemon.llm.base import BackendSpecError
    from rolloutd.daemon.llm.vllm import VLLMBackend

    b = make_backend({"kind": "vllm", "url": "http://127.0.0.1:1/", "model": "m"})
    assert isinstance(b, VLLMBackend) and b.url == "http://127.0.0.1:1" and b.kind == "vllm"
    assert make_backend({"kind": "model-server", "url": "http://h:2"}).kind == "model-server"
    assert make_backend({"kind": "transformers"}).kind == "transformers"
    s = make_backend({"kind": "scripted", "replies": ["hi"]}, renderer=renderer)
    assert s.name == LABEL
    with pytest.raises(BackendSpecError, match="url"):
        make_backend({"kind": "vllm"})
    with pytest.raises(BackendSpecError):
        make_backend({"kind": "gpt5", "url": "x"})
    with pytest.raises(BackendSpecError):
        make_backend({"kind": "vllm", "url": "x", "bogus": 1})
