"""The per-rollout agent endpoint: what it adds per LLM call, and one harness-driven rollout.

A real Node pipeline with real bwrap sandboxes (local where bwrap is missing) and the
scripted backend (a labelled TEST DOUBLE: it answers at once, so the figures are the proxy's
and the HTTP path's, not a model's):

1. **Proxy overhead.** One client script (stdlib ``http.client``, one keep-alive connection,
   ``--calls`` chat calls, each resending the history with one more user turn, as harnesses
   do) runs twice on the same scripted policy:
   - *through the endpoint*: inside the rollout's sandbox, via the helper's loopback relay,
     the endpoint's HTTP server, rendering, sampling on the pool, recording;
   - *calling an inference server directly*, for context: on the host, against ``rolloutd
     model-server --backend scripted`` serving the same ``/v1/chat/completions`` (what a
     harness talks to without rolloutd).
   What the endpoint adds (the RESULT) is, per call, the client's latency through the
   endpoint minus the time the daemon spent inside ``BackendPool.complete`` for that call
   (``Turn.llm_s``): everything but the sampling, the client's own HTTP and JSON included, so
   it is an upper bound. Call ``i`` of the two runs sees the same history, so the table also
   shows the per-call difference from calling model-server directly. Target: p50 <= 2 ms.
2. **A harness-driven rollout end to end.** The ``openai`` client rewrites its history once
   (a new segment), resends it unchanged otherwise (merged calls), and the rollout is
   evaluated. Every call's recorded ids and logprobs are compared with what the backend
   returned.

    .venv/bin/python bench/agent_proxy.py            # about 30 s on 2 cores

Ends with: RESULT proxy_overhead_p50_ms=F segments_exact=0|1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import trio

from rolloutd.daemon.config import Settings
from rolloutd.daemon.llm.base import Completion
from rolloutd.daemon.llm.chat import embedded_renderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from rolloutd.daemon.service import RolloutRequest
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.sandbox import SandboxSupervisor

BACKEND = "bwrap" if shutil.which("bwrap") else "local"

CLIENT = """
    import http.client, json, os, sys, time
    from urllib.parse import urlsplit
    url = urlsplit(os.environ["OPENAI_BASE_URL"])
    conn = http.client.HTTPConnection(url.hostname, url.port)  # one keep-alive connection
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
               "Content-Type": "application/json"}
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    def call():
        body = {"model": os.environ.get("MODEL", "m"), "messages": msgs}
        conn.request("POST", url.path + "/chat/completions", json.dumps(body), headers)
        reply = json.loads(conn.getresponse().read())["choices"][0]["message"]
        msgs.extend([reply, {"role": "user", "content": "Again."}])  # a harness resends its history
    call()  # warm
    lat = []
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t)
    print("LAT " + json.dumps(lat), flush=True)
"""

ROLLOUT = """
    import openai
    client = openai.OpenAI()
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think."}])
    msgs = [{"role": "system", "content": "Summary: you thought."},
            {"role": "user", "content": "What is 1+1?"}]
    for question in ("Sure?", "Final answer?", None):
        r = client.chat.completions.create(model="m", messages=msgs)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        if question:
            msgs.append({"role": "user", "content": question})
    print("ANSWER", r.choices[0].message.content)
"""


REPLY = "The answer is 2."


def latencies(output: str, what: str) -> list[float]:
    line = next((x for x in output.splitlines() if x.startswith("LAT ")), None)
    if line is None:
        raise SystemExit(f"the client failed {what}: {output[-2000:]}")
    return [float(x) for x in json.loads(line[4:])]


async def direct_latencies(calls: int) -> list[float]:
    """The same client on the host against ``rolloutd model-server`` (scripted): the anchor."""
    server = await trio.lowlevel.open_process(
        [sys.executable, "-m", "rolloutd.daemon.cli", "model-server", "--backend", "scripted",
         "--reply", REPLY, "--port", "0"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert server.stdout is not None
        buf = b""
        with trio.fail_after(120):
            while b"\n" not in buf:
                chunk = await server.stdout.receive_some(4096)
                if not chunk:
                    raise SystemExit("model-server did not start")
                buf += chunk
        url = buf.split(b"\n")[0].decode().split()[1]
        env = dict(os.environ, OPENAI_BASE_URL=f"{url}/v1", OPENAI_API_KEY="none",
                   MODEL="scripted-test-double")
        res = await trio.run_process([sys.executable, "-c", textwrap.dedent(CLIENT), str(calls)],
                                     env=env, capture_stdout=True, check=True)
        return latencies(res.stdout.decode(), "against model-server")
    finally:
        with trio.CancelScope(shield=True):
            server.kill()
            await server.wait()


def exact(t: Trajectory, log: list[tuple[list[int], Completion]]) -> bool:
    if len(t.turns) != len(log) or not t.segments:
        return False
    for turn, (prompt, c) in zip(t.turns, log, strict=True):
        seg = t.segments[turn.segment or 0]
        if (seg.token_ids[: turn.start] != prompt or seg.token_ids[turn.start:turn.end] != c.token_ids
                or seg.logprobs[turn.start:turn.end] != c.logprobs
                or seg.loss_mask[turn.start:turn.end] != [1] * len(c.token_ids)):
            return False
    return True


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(calls: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rb-"))
    renderer = await trio.to_thread.run_sync(embedded_renderer)
    try:
        async with trio.open_nursery() as nursery:
            settings = Settings(state_dir=tmp / "state", cache_dir=tmp / "cache", port=0, n_init=2,
                                n_run=2, n_eval=2, queue_size=16, sandbox_backend=BACKEND)
            supervisor = SandboxSupervisor(default_backend=BACKEND, state_dir=tmp / "sb", boot_id="bench")
            await nursery.start(supervisor.run)
            pool = BackendPool(health_interval_s=60.0, request_timeout_s=60.0)
            await nursery.start(pool.run)

            async def get_renderer() -> Any:
                return renderer

            node = Node(settings, services=Services(supervisor=supervisor, pool=pool, renderer=get_renderer))
            await nursery.start(node.pipeline.run)
            node.ready = True

            async def run(script: str, replies: list[str], **limits: Any) -> tuple[Trajectory, ScriptedBackend]:
                backend = ScriptedBackend(renderer, replies, record=True)  # TEST DOUBLE
                bid = pool.add(backend, backend_id="scripted")
                task = {"kind": "math", "question": "What is 1+1?", "answer": "2",
                        "agent": {"command": [sys.executable, "-c", textwrap.dedent(script), str(calls)]}}
                job = node.submit(RolloutRequest(task=task, timeout_s=300, limits=limits)).jobs[0]
                await job.done.wait()
                await pool.remove(bid)
                return job.trajectory, backend

            t, _ = await run(CLIENT, [REPLY], max_turns=calls + 5, max_total_tokens=10**6)
            out = t.harness.output_tail if t.harness else ""
            client = latencies(out, f"through the endpoint: {t.status} {t.error}")
            in_pool = [turn.llm_s for turn in t.turns[1:]]  # the first call warmed up
            direct = await direct_latencies(calls)
            # what the endpoint adds over sampling on the pool (the RESULT: the strict anchor,
            # which charges the endpoint with the client's HTTP and JSON as well)
            overhead = [(a - b) * 1000 for a, b in zip(client, in_pool, strict=True)]
            # and over the same client calling an inference server's own chat API (context)
            vs_direct = [(a - b) * 1000 for a, b in zip(client, direct, strict=True)]

            t2, rec = await run(ROLLOUT, ["Hmm.", "Maybe 2.", "I think 2.", "The answer is 2."])
            ok = rec.log is not None and exact(t2, rec.log)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nper-call latency over {calls} chat calls (scripted backend, 1 keep-alive connection)")
    print(f"{'':44}{'p50 ms':>10}{'p95 ms':>10}{'mean ms':>10}")
    for name, xs in ((f"through the endpoint ({BACKEND} sandbox)", [x * 1000 for x in client]),
                     ("model-server directly (same client, host)", [x * 1000 for x in direct]),
                     ("daemon's pool.complete per call (anchor)", [x * 1000 for x in in_pool]),
                     ("endpoint adds over pool.complete (RESULT)", overhead),
                     ("endpoint minus model-server directly", vs_direct)):
        print(f"{name:44}{statistics.median(xs):10.3f}{pct(xs, 0.95):10.3f}{statistics.fmean(xs):10.3f}")
    info = t2.harness
    print(f"\nharness-driven rollout: status={t2.status.value} reward={t2.reward} calls={info.calls if info else 0} "
          f"merged={info.merged_calls if info else 0} segments={len(t2.segments)} "
          f"run_s={t2.timing.run_s:.2f} exact={ok}")
    p50 = statistics.median(overhead)
    print(f"target proxy_overhead_p50_ms <= 2: {'met' if p50 <= 2 else 'MISSED'} ({p50:.3f} ms)")
    print(f"RESULT proxy_overhead_p50_ms={p50:.3f} segments_exact={int(ok)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    trio.run(main, args.calls)
