"""Token exactness at scale: do trajectories hold exactly what the engine sampled?

In one run, nothing simulated: the embedded SmolLM2-135M-Instruct on vLLM's CPU build, started
exactly as the daemon starts it (``cpu_engine.embedded_server`` + ``spawn.supervise_server``: a
supervised server on a Unix socket, ``--dtype float32``, the RL flags), the real tokenizer and
renderer, and an in-process daemon (``Node.run``: the HTTP API, the INIT/RUN/EVAL pipeline, the
agent loop, the ``calculator`` tool). ROLLOUTS ``calc`` rollouts (3-digit x 2-digit products,
three worked tool-call examples in the prompt, temperature 1 without a seed as RL samples, at
most MAX_TURNS turns of MAX_TOKENS tokens, IN_FLIGHT rollouts at a time) are submitted over
``POST /v1/rollouts`` and read back over the NDJSON stream: the JSON a trainer gets.
(``--seeded`` gives each rollout a seed instead, and checks that each call carries its own
``call_seed``. vLLM 0.32's CPU engine died on seeded requests whose prefill was split over
steps, ``RuntimeError: CPU Generator does not use offset``; the embedded engine now runs
without chunked prefill, see ``cpu_engine.server_argv``.)

A recording proxy sits between the daemon's ``VLLMBackend`` and the vLLM server: it listens
on its own Unix socket, forwards every request to the engine's socket and keeps each
``/v1/completions`` request body and response body as raw bytes. Afterwards the engine's
calls are put together into conversations from those bytes alone (a call whose prompt starts
with an earlier conversation's first prompt continues it; every task is a different product,
so every first prompt is different), each rollout is matched with the conversation that starts
with its prompt, and checked against it:

1. each turn's sampled ids in the trajectory are the ids the engine returned for that request,
   and its logprobs equal the engine's exactly (float equality, both after JSON);
2. each turn's prompt (as sent to the engine) is the trajectory up to the turn, and starts with
   the previous request's prompt + sampled ids (no re-tokenization);
3. the final ``token_ids`` equal the last prompt + its sampled ids; ``loss_mask`` is 1 exactly
   on the engine's sampled tokens, 0 on prompt and tool tokens; ``turns[k].start/end`` locate
   the sampled spans; ``prompt_length`` is the first prompt's length;
4. every sampled token has a finite logprob, every other token a null one;

and the engine requests themselves carry the rollout's sampling fields; no request is left
over. A rollout with any violation counts once in ``drift_mismatches``. A rollout that did not
complete (a failure of ours) is reported apart, and counts as a mismatch only if what it
recorded is inconsistent.

Informative, no target: RESCORE trajectories are scored again by the engine with
``prompt_logprobs`` (teacher forcing the stored ``token_ids`` in one prefill); the table shows
the largest and mean absolute difference from the stored logprobs on sampled tokens (decode
and prefill batch differently, so float32 rounding differs).

    .venv/bin/python bench/drift.py                 # 1000 rollouts, 27 minutes on 2 shared cores
    .venv/bin/python bench/drift.py --rollouts 20   # a quick run

Target (issue 21): 0 mismatches.
Ends with: RESULT rollouts=N drift_mismatches=N
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.daemon.client import AsyncClient  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.daemon.llm.base import call_seed  # noqa: E402
from rolloutd.daemon.llm.cpu_engine import EMBEDDED_ID, embedded_server, vllm_missing  # noqa: E402
from rolloutd.daemon.llm.pool import BackendPool  # noqa: E402
from rolloutd.daemon.llm.spawn import ServerSpec, supervise_server  # noqa: E402
from rolloutd.daemon.llm.vllm import http_backend  # noqa: E402
from rolloutd.daemon.node import Node  # noqa: E402
from rolloutd.daemon.pipeline import Services  # noqa: E402
from rolloutd.daemon.trajectory import Status, Trajectory  # noqa: E402

MAX_TURNS = 3
MAX_TOKENS = 40  # per turn: a calculator call is about 30 tokens
EXAMPLES = 3  # worked tool-call conversations in the prompt (how a 135M model learns the format)
IN_FLIGHT = 32  # the daemon's RUN workers: concurrent rollouts, so the engine batches
SEED0 = 1_000_000
RESCORE = 20  # a 600-token prefill with prompt_logprobs takes about 5 s here
WAIT_CHUNK = 50  # rollout ids per NDJSON stream
SHOW = 5  # mismatches printed in detail


# ---- the recording proxy ------------------------------------------------------------------


@dataclass
class Exchange:
    """One ``/v1/completions`` request through the proxy, as bytes on the wire."""

    seq: int
    request: bytes
    status: int = 0
    response: bytes = b""
    error: str | None = None


@dataclass
class Recorder:
    """An ASGI app forwarding everything to the engine's Unix socket, recording completions."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    _client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        record = None
        if scope["path"] == "/v1/completions":
            record = Exchange(len(self.exchanges), body)
            self.exchanges.append(record)
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url="http://localhost", transport=httpx.AsyncHTTPTransport(uds=self.upstream),
                timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() in (b"content-type", b"accept")]
        url = scope["path"] + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        try:
            resp = await self._client.request(scope["method"], url, content=body, headers=headers)
        except httpx.TransportError as exc:
            if record is not None:
                record.error = f"{type(exc).__name__}: {exc}"
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"proxy: engine unreachable"})
            return
        if record is not None:
            record.status, record.response = resp.status_code, resp.content
        out_headers = [(b"content-type", resp.headers.get("content-type", "application/json").encode())]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
        await send({"type": "http.response.body", "body": resp.content})

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def serve_proxy(recorder: Recorder, uds: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    config = HyperConfig()
    config.bind = [f"unix:{uds}"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 600.0
    try:
        await serve(recorder, config, task_status=task_status)  # type: ignore[arg-type]
    finally:
        with trio.CancelScope(shield=True):
            await recorder.aclose()


# ---- the run -------------------------------------------------------------------------------


def make_tasks(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` different products (so each rollout's first prompt is its own)."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(11, 100)], n)
    return [{"kind": "calc", "id": f"drift-{i}", "expression": f"{a} * {b}", "examples": EXAMPLES}
            for i, (a, b) in enumerate(pairs)]


@dataclass
class Run:
    trajectories: list[Trajectory]
    seeds: dict[str, int | None]  # rollout id -> the seed it was submitted with
    exchanges: list[Exchange]
    rescored: list[tuple[Trajectory, list[float | None]]]
    ready_s: float
    rollouts_s: float
    rescore_s: float
    leftover_processes: int


async def rescore(spec: ServerSpec, model: str, trajs: list[Trajectory]) -> list[tuple[Trajectory, list[float | None]]]:
    """The engine's logprob of every token of each trajectory given the tokens before it
    (``prompt_logprobs``, one prefill), straight to the engine's socket."""
    out = []
    async with spec.client(timeout=httpx.Timeout(600.0)) as client:
        for t in trajs:
            body = {"model": model, "prompt": t.token_ids, "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                    "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "prompt_logprobs": 0, "seed": 0,
                    "skip_special_tokens": False}
            resp = await client.post("/v1/completions", json=body)
            resp.raise_for_status()
            plp = resp.json()["choices"][0]["prompt_logprobs"]
            scores: list[float | None] = []
            for tid, entry in zip(t.token_ids, plp, strict=True):
                if entry is None:
                    scores.append(None)
                    continue
                hit = entry.get(str(tid)) or entry.get(f"token_id:{tid}")
                scores.append(None if hit is None else float(hit["logprob"]))
            out.append((t, scores))
    return out


def engine_processes(marker: str) -> int:
    """Live processes whose command line names ``marker`` (the engine's private socket dir)."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    count += marker.encode() in f.read()
            except OSError:
                pass
    return count


async def run(n: int, n_rescore: int, seed: int, in_flight: int, seeded: bool, work: Path) -> Run:
    sock_dir = Path(tempfile.mkdtemp(prefix="rolloutd-drift-"))  # mode 0700, a short path
    engine_pool = BackendPool()  # the supervisor registers the engine here (we talk to it directly)
    proxy_uds = str(sock_dir / "proxy.sock")
    settings = Settings(state_dir=work / "state", port=0, host="127.0.0.1", n_init=8, n_run=in_flight,
                        n_eval=8, queue_size=max(4096, n), log_level="warning", sandbox_backend="local",
                        default_timeout_s=3600.0)
    pool = BackendPool(health_interval_s=settings.health_interval_s,
                       request_timeout_s=settings.llm_request_timeout_s,
                       backend_wait_s=settings.llm_backend_wait_s)
    node = Node(settings, services=Services(pool=pool))
    tasks = make_tasks(n, seed)
    trajs: list[Trajectory] = []
    seeds: dict[str, int | None] = {}
    try:
        spec = await trio.to_thread.run_sync(lambda: embedded_server(sock_dir, log_path=work / "vllm.log"))
        recorder = Recorder(upstream=str(spec.uds))
        async with trio.open_nursery() as nursery:
            await nursery.start(engine_pool.run)
            t0 = time.monotonic()
            await nursery.start(supervise_server, spec, engine_pool)
            ready = time.monotonic() - t0
            await nursery.start(serve_proxy, recorder, proxy_uds)
            await nursery.start(pool.run)
            # the daemon's client of the engine: the same VLLMBackend the supervisor builds,
            # pointed at the proxy's socket
            pool.add(http_backend(spec.url, kind=spec.kind, name=spec.name, uds=proxy_uds,
                                  checkpoint=spec.checkpoint), backend_id=EMBEDDED_ID)

            async def expect_engine() -> None:  # as the supervisor does in the daemon: turns wait
                with pool.expect(EMBEDDED_ID):  # for a restarting engine instead of failing
                    await trio.sleep_forever()

            nursery.start_soon(expect_engine)
            node_done = trio.Event()

            async def run_node(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await node.run(task_status=task_status)
                finally:
                    node_done.set()

            await nursery.start(run_node)
            async with AsyncClient(node.urls[0], token=node.token) as client:
                await client.run(make_tasks(1, seed - 1)[0], sampling={"temperature": 1.0},
                                 limits={"max_turns": 1, "max_tokens_per_turn": 4})  # warm up
                recorder.exchanges.clear()
                t1 = time.monotonic()
                ids: list[str] = []
                for i, task in enumerate(tasks):
                    sampling: dict[str, Any] = {"temperature": 1.0, "seed": SEED0 + i if seeded else None}
                    sub = await client.submit(
                        task, sampling=sampling,
                        limits={"max_turns": MAX_TURNS, "max_tokens_per_turn": MAX_TOKENS,
                                "max_total_tokens": MAX_TURNS * MAX_TOKENS})
                    ids += sub.ids
                    seeds[sub.ids[0]] = sampling["seed"]
                done: dict[str, Trajectory] = {}

                async def wait(chunk: list[str]) -> None:
                    for t in await client.wait(chunk):
                        done[t.id] = t
                    print(f"  {len(done)}/{n} rollouts done ({time.monotonic() - t1:.0f} s)", flush=True)

                async with trio.open_nursery() as waiters:
                    for k in range(0, len(ids), WAIT_CHUNK):
                        waiters.start_soon(wait, ids[k:k + WAIT_CHUNK])
                rollouts_s = time.monotonic() - t1
                trajs = [done[i] for i in ids]
            # rescoring: the sampled ones first of the multi-turn rollouts
            ok = [t for t in trajs if t.status is Status.completed and t.turns]
            multi = [t for t in ok if len(t.turns) > 1]
            pick = random.Random(seed).sample(multi, min(n_rescore, len(multi)))
            pick += random.Random(seed).sample([t for t in ok if len(t.turns) == 1],
                                               min(n_rescore - len(pick), len(ok) - len(multi)))
            model = json.loads(recorder.exchanges[0].request)["model"] if recorder.exchanges else ""
            t2 = time.monotonic()
            rescored = await rescore(spec, model, pick) if model else []
            rescore_s = time.monotonic() - t2
            node.request_stop()  # the daemon drains and stops, then the proxy and the engine
            with trio.move_on_after(60):
                await node_done.wait()
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    await trio.sleep(0.5)
    return Run(trajs, seeds, recorder.exchanges, rescored, ready, rollouts_s, rescore_s,
               engine_processes(str(sock_dir)))


# ---- the checks ------------------------------------------------------------------------------


@dataclass
class Call:
    """One engine request and its answer, read from the proxy's bytes."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[Any]
    body: dict[str, Any]
    answer: dict[str, Any]


def parse_calls(exchanges: list[Exchange]) -> tuple[dict[tuple[int, ...], list[list[Call]]], list[str]]:
    """The engine's successful calls as conversations, from the proxy's bytes alone: a call
    whose prompt starts with an earlier conversation's first prompt joins it (in arrival order),
    any other call starts one. Keyed by the first prompt (a list: a prompt seen twice gives two
    conversations). Also the calls not answered 200."""
    convs: dict[tuple[int, ...], list[list[Call]]] = defaultdict(list)
    lengths: set[int] = set()
    problems = []
    for ex in exchanges:
        body = json.loads(ex.request)
        if ex.status != 200:
            problems.append(f"request {ex.seq}: HTTP {ex.status} {ex.error or ''} {ex.response[:200]!r}")
            continue
        answer = json.loads(ex.response)
        choice = answer["choices"][0]
        call = Call(prompt=list(body["prompt"]), ids=list(choice.get("token_ids") or []),
                    logprobs=list((choice.get("logprobs") or {}).get("token_logprobs") or []), body=body,
                    answer=answer)
        # the longest first prompt that this prompt extends (a later turn), else a new conversation
        root = next((key for n in sorted(lengths, reverse=True) if n < len(call.prompt)
                     and (key := tuple(call.prompt[:n])) in convs), None)
        if root is None:
            key = tuple(call.prompt)
            convs[key].append([call])
            lengths.add(len(key))
        else:
            convs[root][-1].append(call)
    return convs, problems


def check(t: Trajectory, seed: int | None, convs: list[list[Call]]) -> list[str]:
    """Every way ``t`` differs from what the engine saw and sampled (empty: exact).
    ``convs``: the engine's conversations that start with ``t``'s prompt."""
    bad: list[str] = []
    n = len(t.token_ids)
    if not (len(t.loss_mask) == len(t.logprobs) == n):
        bad.append(f"lengths differ: token_ids {n}, loss_mask {len(t.loss_mask)}, logprobs {len(t.logprobs)}")
        return bad
    if len(convs) > 1:
        bad.append(f"the engine saw this rollout's first prompt start {len(convs)} conversations")
        return bad
    calls = convs[0] if convs else []
    if t.status is not Status.completed and len(calls) == len(t.turns) + 1:
        calls = calls[:-1]  # a rollout cut (deadline, cancel) while its last request was in flight
    if len(calls) != len(t.turns):
        bad.append(f"{len(t.turns)} turns recorded, the engine answered {len(calls)} requests of this conversation")
        return bad
    mask = [0] * n
    lps: list[Any] = [None] * n
    prev: list[int] | None = None
    for k, (turn, c) in enumerate(zip(t.turns, calls, strict=True)):
        b = c.body
        want_seed = None if seed is None else call_seed(seed, t.sample_index, k)  # the call's own
        if (b.get("temperature"), b.get("top_p"), b.get("top_k"), b.get("seed")) != (1.0, 1.0, -1, want_seed):
            bad.append(f"turn {k}: the request's sampling fields are {b.get('temperature'), b.get('top_p'), b.get('top_k'), b.get('seed')}")
        if b.get("logprobs") != 0 or b.get("n") != 1:
            bad.append(f"turn {k}: the request asked for logprobs={b.get('logprobs')} n={b.get('n')}")
        choice = c.answer["choices"][0]
        named = (choice.get("logprobs") or {}).get("tokens")
        if isinstance(named, list) and [int(str(s).removeprefix("token_id:")) for s in named] != c.ids:
            bad.append(f"turn {k}: the engine's token_id:N strings name other ids than its token_ids")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != c.prompt:
            bad.append(f"turn {k}: the engine echoed another prompt than it was sent")
        if len(c.logprobs) != len(c.ids) or any(not isinstance(x, int | float) or not math.isfinite(x)
                                                for x in c.logprobs):
            bad.append(f"turn {k}: the engine's logprobs are missing or not finite ({len(c.logprobs)} for {len(c.ids)} ids)")
        start, end = len(c.prompt), len(c.prompt) + len(c.ids)
        if (turn.start, turn.end) != (start, end):
            bad.append(f"turn {k}: span [{turn.start}, {turn.end}) but the engine's prompt + sample is [{start}, {end})")
        if t.token_ids[:start] != c.prompt:
            pos = next((i for i, (a, b2) in enumerate(zip(t.token_ids, c.prompt, strict=False)) if a != b2),
                       min(n, start))
            bad.append(f"turn {k}: the prompt sent differs from token_ids[:{start}] at {pos}")
        if t.token_ids[start:end] != c.ids:
            bad.append(f"turn {k}: sampled ids differ: trajectory {t.token_ids[start:end][:12]}..., "
                       f"engine {c.ids[:12]}...")
        if t.logprobs[start:end] != c.logprobs:
            diffs = [(i, a, b2) for i, (a, b2) in enumerate(zip(t.logprobs[start:end], c.logprobs, strict=False))
                     if a != b2]
            bad.append(f"turn {k}: logprobs differ at {len(diffs)} tokens, first {diffs[:2]}")
        if prev is not None and c.prompt[: len(prev)] != prev:
            pos = next((i for i, (a, b2) in enumerate(zip(prev, c.prompt, strict=False)) if a != b2), len(c.prompt))
            bad.append(f"turn {k}: the prompt does not extend the previous prompt + sample (diverges at {pos})")
        if k == 0 and t.prompt_length != start:
            bad.append(f"prompt_length {t.prompt_length}, the first request's prompt has {start} tokens")
        for i in range(start, min(end, n)):
            mask[i] = 1
        lps[start:min(end, n)] = c.logprobs[: max(0, min(end, n) - start)]
        prev = [*c.prompt, *c.ids]
    if prev is not None and t.token_ids != prev:
        bad.append(f"token_ids ({n}) are not the last prompt + sample ({len(prev)})")
    if t.loss_mask != mask:
        wrong = [i for i, (a, b2) in enumerate(zip(t.loss_mask, mask, strict=True)) if a != b2]
        bad.append(f"loss_mask is wrong at {len(wrong)} positions, first {wrong[:5]}")
    sampled_null = sum(1 for m, x in zip(t.loss_mask, t.logprobs, strict=True)
                       if m == 1 and (x is None or not math.isfinite(x)))
    if sampled_null:
        bad.append(f"{sampled_null} sampled tokens have no finite logprob")
    if any(m == 0 and x is not None for m, x in zip(t.loss_mask, t.logprobs, strict=True)):
        bad.append("a prompt/tool token carries a logprob")
    if t.logprobs != lps and not any("logprobs differ" in b for b in bad):
        bad.append("logprobs are not null off the sampled spans / the engine's on them")
    return bad


# ---- the report --------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--rescore", type=int, default=RESCORE, help="trajectories scored again (prompt_logprobs)")
    ap.add_argument("--seed", type=int, default=0, help="of the task list")
    ap.add_argument("--seeded", action="store_true",
                    help="a sampling seed per rollout (vLLM 0.32's CPU engine crashes when a seeded "
                         "prompt is prefilled in chunks: see docs/llm.md)")
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="concurrent rollouts (the daemon's n_run)")
    args = ap.parse_args()
    missing = vllm_missing()
    if missing:
        raise SystemExit(f"bench/drift.py needs the vLLM CPU engine: {missing}")
    work = Path(tempfile.mkdtemp(prefix="rolloutd-bench-drift-"))
    t_start = time.monotonic()
    try:
        r = trio.run(run, args.rollouts, args.rescore, args.seed, args.in_flight, args.seeded, work)
    except BaseException:
        log = work / "vllm.log"
        if log.exists():
            print(log.read_text()[-3000:])
        raise
    else:
        convs, problems = parse_calls(r.exchanges)
        if problems:
            text = (work / "vllm.log").read_text(errors="replace")
            at = min((i for i in (text.find("Traceback"), text.find(" ERROR ")) if i >= 0), default=len(text) - 3000)
            print(f"the engine answered {len(problems)} requests with an error; its log, from the first error:")
            print(text[max(0, at - 500): at + 5000])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - t_start

    mismatched: list[tuple[Trajectory, list[str]]] = []
    failed = [t for t in r.trajectories if t.status is not Status.completed]
    for t in r.trajectories:
        bad = check(t, r.seeds[t.id], convs.get(tuple(t.token_ids[: t.prompt_length]), []))
        if bad:
            mismatched.append((t, bad))
    known = {tuple(t.token_ids[: t.prompt_length]) for t in r.trajectories}
    orphans = sum(len(c) for key, cs in convs.items() if key not in known for c in cs)
    all_calls = [c for cs in convs.values() for conv in cs for c in conv]

    ok = [t for t in r.trajectories if t.status is Status.completed]
    turns = Counter(len(t.turns) for t in r.trajectories)
    calls = [c for t in r.trajectories for turn in t.turns for c in turn.tool_calls]
    calc_calls = [c for c in calls if c.name == "calculator"]
    multi = sum(1 for t in r.trajectories if len(t.turns) > 1)
    finish = Counter(t.finish_reason for t in r.trajectories)
    sampled = sum(sum(t.loss_mask) for t in r.trajectories)
    cached = [int((c.answer.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens") or 0)
              for c in all_calls]
    prompt_tokens = sum(len(c.prompt) for c in all_calls)
    diffs = [abs(s - lp) for t, scores in r.rescored
             for m, lp, s in zip(t.loss_mask, t.logprobs, scores, strict=True)
             if m == 1 and lp is not None and s is not None]

    table = Table(title=f"token exactness: {args.rollouts} calc rollouts through the daemon, vLLM CPU engine "
                        f"(SmolLM2-135M, float32, temperature 1{', seeded' if args.seeded else ''}, "
                        f"<= {MAX_TURNS} turns x {MAX_TOKENS} tokens, {args.in_flight} in flight)")
    table.add_column("", justify="left")
    table.add_column("value", justify="right")
    rows = [
        ("rollouts submitted / completed", f"{len(r.trajectories)} / {len(ok)}"),
        ("failed (not usable: status != completed)", str(len(failed))),
        ("turns per rollout: 1 / 2 / 3", " / ".join(str(turns.get(k, 0)) for k in (1, 2, 3))),
        ("rollouts with > 1 turn", f"{multi} ({multi / max(1, len(r.trajectories)):.0%})"),
        ("tool calls: calculator (ok) / malformed", f"{len(calc_calls)} ({sum(c.ok for c in calc_calls)}) / "
                                                    f"{sum(1 for c in calls if c.name == '<malformed>')}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in finish.most_common())),
        ("mean reward", f"{sum(t.reward or 0.0 for t in ok) / max(1, len(ok)):.3f}"),
        ("engine requests recorded (not 200 / orphans)", f"{len(r.exchanges)} ({len(problems)} / {orphans})"),
        ("sampled tokens checked", str(sampled)),
        ("prompt tokens sent / served from prefix cache", f"{prompt_tokens} / {sum(cached)}"),
        ("token-exact rollouts", str(len(r.trajectories) - len(mismatched))),
        ("drift mismatches", str(len(mismatched))),
        (f"re-scored ({len(r.rescored)} trajectories, {len(diffs)} sampled tokens): max / mean |dlogprob|",
         f"{max(diffs, default=0.0):.2e} / {sum(diffs) / max(1, len(diffs)):.2e}"),
        ("engine ready / rollouts / re-score / total wall s",
         f"{r.ready_s:.0f} / {r.rollouts_s:.0f} / {r.rescore_s:.0f} / {wall:.0f}"),
        ("rollouts/s", f"{len(r.trajectories) / max(r.rollouts_s, 1e-9):.2f}"),
        ("engine processes left after teardown", str(r.leftover_processes)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(width=150).print(table)
    if failed:
        first = failed[0]
        err = f"{first.error.stage}/{first.error.type}: {first.error.message}" if first.error else "no error recorded"
        print(f"{len(failed)} rollouts FAILED (statuses {dict(Counter(t.status.value for t in failed))}); "
              f"first: {first.id}: {err}")
    for p in problems[:SHOW]:
        print(f"engine request not answered 200: {p}")
    for t, bad in mismatched[:SHOW]:
        print(f"MISMATCH {t.id} (seed {r.seeds[t.id]}, status {t.status.value}, {len(t.turns)} turns):")
        for b in bad:
            print(f"    {b}")
    if orphans:
        print(f"{orphans} engine calls belong to no rollout's conversation")
    print(f"target drift_mismatches == 0: {'met' if not mismatched and not orphans else 'MISSED'}")
    print(f"RESULT rollouts={len(r.trajectories)} drift_mismatches={len(mismatched)}")


if __name__ == "__main__":
    main()
