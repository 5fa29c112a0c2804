"""The real tiny model (SmolLM2-135M-Instruct on CPU): token-in/token-out end to end."""

import pytest
import trio

from rolloutd.daemon.agent import AgentLimits, run_agent
from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.chat import check_extends
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.transformers import process_logits
from rolloutd.daemon.llm.vllm import ModelServerBackend
from rolloutd.daemon.tasks.base import Prompt
from rolloutd.daemon.trajectory import Trajectory

from .conftest import open_model_server
from .test_agent import FakeToolbox

pytestmark = pytest.mark.model

PARAMS = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=None)
QUESTIONS = ["What is 2+2?", "Name a colour.", "List one prime.", "Say hi.", "What is the capital of France?"]


class Recorder:
    """Wraps a real backend and records every (prompt, completion) exactly as returned."""

    def __init__(self, inner):
        self.inner = inner
        self.kind, self.url, self.name = inner.kind, inner.url, inner.name
        self.log = []

    async def complete(self, prompt_ids, params, *, max_tokens):
        c = await self.inner.complete(prompt_ids, params, max_tokens=max_tokens)
        self.log.append((list(prompt_ids), list(c.token_ids), list(c.logprobs), c.finish_reason))
        return c

    async def health(self):
        return await self.inner.health()

    async def aclose(self):
        pass


async def _rollouts(backend, renderer, n, *, concurrency=2, max_turns=2, max_tokens=5):
    rec = Recorder(backend)
    pool = BackendPool()
    pool.add(rec)
    limits = AgentLimits(max_turns=max_turns, max_tokens_per_turn=max_tokens, require_tool_call=True)
    trs = [Trajectory(id=f"r{i}") for i in range(n)]
    limiter = trio.CapacityLimiter(concurrency)

    async def one(tr, i):
        async with limiter:
            prompt = Prompt(messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            await run_agent(trajectory=tr, prompt=prompt, pool=pool, renderer=renderer, toolbox=FakeToolbox(),
                            params=PARAMS, limits=limits, sticky_key=tr.id, group_key=f"g{i % 5}")
            pool.forget(tr.id)

    async with trio.open_nursery() as nursery:
        for i, tr in enumerate(trs):
            nursery.start_soon(one, tr, i)
    return trs, rec.log


def _verify(trs, log, renderer):
    """Every sampled id and logprob is what the backend returned; prompts only grow; mask exact."""
    returned = {}
    for prompt, ids, lps, finish in log:
        returned.setdefault((tuple(prompt), tuple(ids)), []).append((lps, finish))
    multi = 0
    for tr in trs:
        n = len(tr.token_ids)
        assert len(tr.loss_mask) == n == len(tr.logprobs)
        assert {i for i, m in enumerate(tr.loss_mask) if m} == {i for t in tr.turns for i in range(t.start, t.end)}
        prev = None
        for t in tr.turns:
            context = tr.token_ids[: t.start]
            sampled = tr.token_ids[t.start: t.end]
            # this exact prompt was sent and these exact ids came back (verbatim) ...
            candidates = returned[(tuple(context), tuple(sampled))]
            # ... with these exact logprobs (bit for bit) and finish reason
            assert (tr.logprobs[t.start: t.end], t.finish_reason) in candidates
            if prev is not None:
                check_extends(prev, context)
            prev = context + sampled
        assert tr.prompt_length == t_prompt(tr)
        multi += len(tr.turns) > 1
    return multi


def t_prompt(tr):
    return tr.turns[0].start


async def test_twenty_multi_turn_rollouts_in_process(model_backend, renderer):
    """Twenty (fifty until the suite ran over 30 minutes): bench/drift.py runs 1,000 through
    the daemon, and tests/llm/test_vllm_engine.py does the same checks on the vLLM engine."""
    trs, log = await _rollouts(model_backend, renderer, 20)
    assert _verify(trs, log, renderer) == 20
    assert sum(len(tr.turns) for tr in trs) == 40
    # how often did the model sample a non-canonical tokenization (decode->encode would drift)?
    drift = sum(renderer.encode_text(renderer.decode(ids)) != ids for _, ids, _, _ in log)
    print(f"\nturns whose decode->encode differs from the sampled ids: {drift}/{len(log)}")


async def test_returned_logprobs_are_those_of_the_sampled_distribution(model_backend, renderer):
    """Recompute each step with a fresh full forward pass (no KV cache) and the same processing."""
    import torch

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=11)
    prompt = renderer.render_prompt([{"role": "user", "content": "Tell me a fact about cats."}])
    c = await model_backend.complete(prompt, params, max_tokens=8)
    model = model_backend._gen.model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + c.token_ids])).logits[0]
    for k, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        pos = len(prompt) + k - 1
        seen = torch.tensor(prompt + c.token_ids[:k])
        ref = torch.log_softmax(process_logits(logits[pos], params, seen), -1)
        assert torch.isfinite(ref[tid]), "a token outside the top-k/top-p set was sampled"
        assert abs(float(ref[tid]) - lp) < 1e-3
    # top_k=1 is a point mass: logprob 0 whatever the temperature
    c1 = await model_backend.complete(prompt, SamplingParams(temperature=1.5, top_k=1), max_tokens=3)
    assert c1.logprobs == [0.0] * len(c1.token_ids)


async def test_cancel_stops_generation_promptly(model_backend, renderer):
    prompt = renderer.render_prompt([{"role": "user", "content": "Write a long story."}])
    with trio.move_on_after(0.5):
        await model_backend.complete(prompt, SamplingParams(), max_tokens=2000)
    t0 = trio.current_time()
    c = await model_backend.complete(prompt, SamplingParams(), max_tokens=2)
    assert len(c.token_ids) <= 2
    assert trio.current_time() - t0 < 5.0  # did not wait for 2000 tokens


async def test_real_model_through_model_server(renderer):
    async with open_model_server("--backend", "transformers") as srv:
        backend = ModelServerBackend(srv.url)
        trs, log = await _rollouts(backend, renderer, 4)
        assert _verify(trs, log, renderer) == 4
        await backend.aclose()
