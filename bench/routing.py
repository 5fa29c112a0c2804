"""Routing benchmark: prefix-cache reuse and throughput of sticky, least-loaded and round-robin.

Simulation (virtual time, trio's MockClock with autojump): 4 backends, each with an LRU
prefix cache of 16-token blocks (vLLM's scheme: a block is reusable only if every block before
it is cached too) and a cost model: prefill per uncached prompt token, decode per generated
token (decodes overlap, as in continuous batching; prefills run one at a time per backend). 64 concurrent multi-turn rollouts
(16 GRPO groups x 4 samples sharing a system prompt and their group's task prompt); each turn
samples 32-160 tokens, then a tool runs (0.2-2 s) and its 64-512-token observation is appended.

Routers:

- ``sticky``: the real :class:`rolloutd.daemon.llm.pool.BackendPool` (sticky per rollout and group,
  least-loaded for new rollouts);
- ``least_loaded``: the same pool with a fresh key per request (no stickiness);
- ``round_robin``: each request to the next backend;
- ``ideal``: the reuse a single backend with an unbounded cache would get (the upper bound).

Hit rate = cached prompt tokens / prompt tokens. ``sticky_vs_ideal`` = sticky / ideal
(target >= 0.9). Figures are medians over ``SEEDS``. Then the real ``rolloutd model-server``
(embedded SmolLM2 on this machine's CPU) is timed: generated tokens per second, median of 3.

Run: ``.venv/bin/python bench/routing.py`` (``--no-model-server`` skips the real-model part).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence

import trio
import trio.testing

from rolloutd.daemon.llm.base import Completion, SamplingParams
from rolloutd.daemon.llm.pool import BackendPool

N_BACKENDS = 4
N_ROLLOUTS = 64
GROUP_SIZE = 4
TURNS = 8
BLOCK = 16
CACHE_BLOCKS = 8192  # per backend (131k tokens): holds its share of sticky rollouts, not all
PREFILL_S_PER_TOKEN = 0.0001  # compute-bound: one prefill at a time per backend
DECODE_S_PER_TOKEN = 0.02  # per sequence, batched (decodes overlap)
SYSTEM_TOKENS = 1536  # system prompt + tool schemas, shared by every rollout
TASK_TOKENS = 512  # the task, shared by a group
SEEDS = (1, 2, 3)


class SimBackend:
    """A simulated inference server with an LRU block prefix cache (bench only)."""

    kind = "sim"
    url = None

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill = trio.Lock()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated = 0

    def _block_hashes(self, ids: Sequence[int]) -> list[int]:
        hashes, h = [], 0
        for b in range(len(ids) // BLOCK):
            h = hash((h, tuple(ids[b * BLOCK : (b + 1) * BLOCK])))
            hashes.append(h)
        return hashes

    def _lookup_and_insert(self, ids: Sequence[int]) -> int:
        hashes = self._block_hashes(ids)
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        for h in hashes:  # touch / insert every full block (prompt and, later, output)
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)
        return hit * BLOCK

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int) -> Completion:
        async with self.prefill:
            cached = min(self._lookup_and_insert(prompt_ids), len(prompt_ids) - 1)
            await trio.sleep(PREFILL_S_PER_TOKEN * (len(prompt_ids) - cached))
        n_out = self.rng.randint(32, 160)
        out = [self.rng.randrange(1000, 50000) for _ in range(n_out)]
        await trio.sleep(DECODE_S_PER_TOKEN * n_out)
        self._lookup_and_insert([*prompt_ids, *out])
        self.prompt_tokens += len(prompt_ids)
        self.cached_tokens += cached
        self.generated += n_out
        return Completion(out, [-1.0] * n_out, "stop", self.name, cached_tokens=cached)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


class RoundRobin:
    def __init__(self, backends: list[SimBackend]) -> None:
        self.backends = backends
        self.i = 0

    async def complete(self, prompt_ids, params, *, max_tokens, sticky_key, group_key=None):  # type: ignore[no-untyped-def]
        b = self.backends[self.i % len(self.backends)]
        self.i += 1
        return await b.complete(prompt_ids, params, max_tokens=max_tokens)

    def forget(self, key: str) -> None:
        pass


class PerRequest:
    """The real pool, but every request is a new 'rollout' (least-loaded, no stickiness)."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.n = 0

    async def complete(self, prompt_ids, params, *, max_tokens, sticky_key, group_key=None):  # type: ignore[no-untyped-def]
        self.n += 1
        key = f"{sticky_key}#{self.n}"
        try:
            return await self.pool.complete(prompt_ids, params, max_tokens=max_tokens, sticky_key=key)
        finally:
            self.pool.forget(key)

    def forget(self, key: str) -> None:
        pass


def ideal_hit_rate(requests: list[tuple[list[int], list[int]]]) -> float:
    """One backend, unbounded cache, every request's blocks (prompt and output) inserted."""
    seen: set[int] = set()
    sim = SimBackend("ideal", random.Random(0))
    hit = total = 0
    for p, out in requests:
        hashes = sim._block_hashes(p)
        k = 0
        for h in hashes:
            if h not in seen:
                break
            k += 1
        hit += min(k * BLOCK, len(p) - 1)
        total += len(p)
        seen.update(sim._block_hashes([*p, *out]))
    return hit / total


async def workload(router, seed: int, log: list[tuple[list[int], list[int]]]) -> float:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    system = [rng.randrange(1000, 50000) for _ in range(SYSTEM_TOKENS)]
    tasks = [[rng.randrange(1000, 50000) for _ in range(TASK_TOKENS)] for _ in range(N_ROLLOUTS // GROUP_SIZE)]
    params = SamplingParams()
    t0 = trio.current_time()

    async def rollout(i: int) -> None:
        r = random.Random(seed * 1000 + i)
        await trio.sleep(r.uniform(0, 2.0))  # staggered arrivals
        ctx = [*system, *tasks[i // GROUP_SIZE]]
        key = f"r{i}"
        for _ in range(TURNS):
            sent = list(ctx)
            c = await router.complete(ctx, params, max_tokens=512, sticky_key=key, group_key=f"g{i // GROUP_SIZE}")
            log.append((sent, list(c.token_ids)))
            ctx += c.token_ids
            await trio.sleep(r.uniform(0.2, 2.0))  # the tool runs
            ctx += [r.randrange(1000, 50000) for _ in range(r.randint(64, 512))]
        router.forget(key)

    async with trio.open_nursery() as nursery:
        for i in range(N_ROLLOUTS):
            nursery.start_soon(rollout, i)
    return trio.current_time() - t0


def run_policy(policy: str, seed: int) -> tuple[float, float, float, list[tuple[list[int], list[int]]]]:
    """(hit rate, generated tokens per simulated second, makespan, prompts sent)."""
    rng = random.Random(seed + 99)
    backends = [SimBackend(f"sim{i}", rng) for i in range(N_BACKENDS)]
    pool = BackendPool()
    for b in backends:
        pool.add(b, backend_id=b.name)
    router = {"sticky": pool, "least_loaded": PerRequest(pool), "round_robin": RoundRobin(backends)}[policy]
    prompts: list[tuple[list[int], list[int]]] = []
    makespan = trio.run(workload, router, seed, prompts, clock=trio.testing.MockClock(autojump_threshold=0))
    hits = sum(b.cached_tokens for b in backends) / sum(b.prompt_tokens for b in backends)
    gen = sum(b.generated for b in backends)
    return hits, gen / makespan, makespan, prompts


async def model_server_tokens_per_s(repeats: int = 3, max_tokens: int = 64) -> float:
    import httpx

    from rolloutd.daemon.llm.chat import embedded_renderer

    renderer = embedded_renderer()
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "rolloutd.daemon.llm.model_server", "--port", "0"],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        buf = b""
        assert proc.stdout is not None
        while b"\n" not in buf:
            buf += await proc.stdout.receive_some()
        url = buf.split()[1].decode()
        prompt = renderer.render_prompt([{"role": "user", "content": "Write a short story about a robot."}])
        rates = []
        async with httpx.AsyncClient(base_url=url, timeout=None) as client:
            for i in range(repeats + 1):
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
                        "logprobs": 0, "return_token_ids": True, "stop_token_ids": []}
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                dt = time.monotonic() - t0
                n = len(r.json()["choices"][0]["token_ids"])
                if i:  # the first request warms up
                    rates.append(n / dt)
        return statistics.median(rates)
    finally:
        proc.terminate()
        await proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-model-server", action="store_true")
    args = ap.parse_args()
    rows = {}
    ideal = []
    for policy in ("sticky", "least_loaded", "round_robin"):
        runs = [run_policy(policy, s) for s in SEEDS]
        rows[policy] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                        statistics.median(r[2] for r in runs))
        if policy == "sticky":
            ideal = [ideal_hit_rate(r[3]) for r in runs]
    ideal_rate = statistics.median(ideal)
    base_tps = rows["round_robin"][1]
    print(f"{N_ROLLOUTS} rollouts x {TURNS} turns, {N_BACKENDS} backends, LRU {CACHE_BLOCKS} blocks of {BLOCK} "
          f"tokens each; prefill {PREFILL_S_PER_TOKEN * 1e3:.2f} ms/uncached token (serial), decode "
          f"{DECODE_S_PER_TOKEN * 1e3:.0f} ms/token (batched); median of {len(SEEDS)} seeds (simulated time)")
    print(f"{'policy':<14}{'hit rate':>10}{'vs ideal':>10}{'gen tok/s':>12}{'vs round-robin':>16}{'makespan s':>12}")
    for policy, (hit, tps, span) in rows.items():
        print(f"{policy:<14}{hit:>10.3f}{hit / ideal_rate:>10.3f}{tps:>12.1f}{tps / base_tps:>16.2f}{span:>12.1f}")
    print(f"{'ideal':<14}{ideal_rate:>10.3f}{1.0:>10.3f}")
    ms_tps = 0.0
    if not args.no_model_server:
        ms_tps = trio.run(model_server_tokens_per_s)
        print(f"\nrolloutd model-server (SmolLM2-135M, CPU, HTTP): {ms_tps:.1f} generated tokens/s (median of 3, 64-token completions)")
    sticky_vs_ideal = rows["sticky"][0] / ideal_rate
    if sticky_vs_ideal < 0.9:
        print(f"TARGET MISSED: sticky reaches {sticky_vs_ideal:.3f} of ideal reuse (target 0.9)")
    print(
        f"RESULT sticky_hit_rate={rows['sticky'][0]:.4f} least_loaded_hit_rate={rows['least_loaded'][0]:.4f} "
        f"round_robin_hit_rate={rows['round_robin'][0]:.4f} ideal_hit_rate={ideal_rate:.4f} "
        f"sticky_vs_ideal={sticky_vs_ideal:.4f} model_server_tokens_per_s={ms_tps:.2f}"
    )


if __name__ == "__main__":
    main()
