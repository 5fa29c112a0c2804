"""The agent loop over scripted backends (TEST DOUBLES) and a toolbox test double."""

from dataclasses import dataclass, replace

import pytest
import trio

from rolloutd.daemon.agent import AgentLimits, run_agent
from rolloutd.daemon.llm.base import Completion, PrefixMismatch, SamplingParams
from rolloutd.daemon.llm.chat import FAMILIES, ChatRenderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.scripted import ScriptedBackend, fake_logprob
from rolloutd.daemon.tasks.base import Prompt
from rolloutd.daemon.trajectory import Trajectory

P = SamplingParams(temperature=1.0)
PROMPT = Prompt(messages=[{"role": "user", "content": "What is 6*7?"}], tools=["bash", "finish"])


@dataclass
class _Result:
    output: str
    ok: bool = True
    exit_code: int | None = 0
    timed_out: bool = False
    finished: bool = False
    answer: str | None = None
    latency_s: float = 0.0


class FakeToolbox:
    """TEST DOUBLE of tools.Toolbox: bash echoes, finish finishes, anything else is unknown."""

    def __init__(self, delay_s: float = 0.0):
        self.calls = []
        self.delay_s = delay_s

    def schemas(self):
        return [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
                for n in ("bash", "finish")]

    async def call(self, name, arguments, *, timeout_s):
        self.calls.append((name, arguments))
        await trio.sleep(self.delay_s)
        if name == "bash":
            return _Result(output=f"ran {arguments.get('cmd')}", latency_s=self.delay_s)
        if name == "finish":
            return _Result(output="done", finished=True, answer=str(arguments.get("answer")))
        return _Result(output=f"unknown tool {name!r}", ok=False, exit_code=None)


def call(name, **args):
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


async def _run(renderer, replies, *, limits=AgentLimits(), toolbox=None, backend=None):
    pool = BackendPool()
    pool.add(backend or ScriptedBackend(renderer, replies))
    tr = Trajectory(id="t1")
    answer = await run_agent(trajectory=tr, prompt=PROMPT, pool=pool, renderer=renderer,
                             toolbox=toolbox if toolbox is not None else FakeToolbox(),
                             params=P, limits=limits, sticky_key="t1", group_key=None)
    return tr, answer


def _check_invariants(tr, renderer):
    n = len(tr.token_ids)
    assert len(tr.loss_mask) == n == len(tr.logprobs)
    sampled = {i for t in tr.turns for i in range(t.start, t.end)}
    assert {i for i, m in enumerate(tr.loss_mask) if m} == sampled
    for i, (m, lp) in enumerate(zip(tr.loss_mask, tr.logprobs)):
        assert (lp is not None) == bool(m)
        if m:
            assert lp == fake_logprob(tr.token_ids[i], i)  # exactly the backend's value
    assert tr.token_ids[: tr.prompt_length] == renderer.render_prompt(PROMPT.messages, FakeToolbox().schemas())


async def test_tool_turns_then_finish(renderer):
    tb = FakeToolbox()
    tr, answer = await _run(renderer, ["Let me check. " + call("bash", cmd="echo 42"), call("finish", answer="42")], toolbox=tb)
    assert answer == "42" and tr.finish_reason == "finish_tool"
    assert tb.calls == [("bash", {"cmd": "echo 42"}), ("finish", {"answer": "42"})]
    assert len(tr.turns) == 2 and tr.turns[0].tool_calls[0].name == "bash"
    assert tr.turns[0].backend.startswith("scripted") and tr.turns[0].finish_reason == "stop"
    _check_invariants(tr, renderer)
    # the observation sits between the two turns, loss mask 0, rendered as a tool turn
    between = tr.token_ids[tr.turns[0].end: tr.turns[1].start]
    assert renderer.decode(between) == "\n<|im_start|>tool\nran echo 42<|im_end|>\n<|im_start|>assistant\n"
    assert [m["role"] for m in tr.messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert tr.messages[1]["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"cmd": "echo 42"}}


async def test_plain_answer_ends_the_rollout(renderer):
    tr, answer = await _run(renderer, ["It is 42."])
    assert answer == "It is 42." and tr.finish_reason == "stop" and len(tr.turns) == 1
    assert tr.token_ids[-1] == renderer.end_id and tr.loss_mask[-1] == 1
    _check_invariants(tr, renderer)


async def test_malformed_tool_call_is_answered_with_an_observation(renderer):
    tr, answer = await _run(renderer, ['<tool_call>{"name": "bash", "arguments": {"cmd": }</tool_call>', "Sorry: 42"])
    assert answer == "Sorry: 42" and len(tr.turns) == 2
    rec = tr.turns[0].tool_calls[0]
    assert rec.name == "<malformed>" and not rec.ok and "not valid JSON" in rec.error
    obs = renderer.decode(tr.token_ids[tr.turns[0].end: tr.turns[1].start])
    assert "Error: tool call 1 could not be used: the tool call is not valid JSON" in obs
    assert tr.messages[2]["role"] == "tool" and tr.messages[2]["content"].startswith("Error:")
    _check_invariants(tr, renderer)


async def test_unknown_tool_goes_back_to_the_model(renderer):
    tr, _ = await _run(renderer, [call("rm_rf"), "ok"])
    assert not tr.turns[0].tool_calls[0].ok and "unknown tool" in tr.messages[2]["content"]


async def test_max_turns(renderer):
    tr, answer = await _run(renderer, [call("bash", cmd="ls")], limits=AgentLimits(max_turns=3))
    assert tr.finish_reason == "max_turns" and len(tr.turns) == 3 and answer is None
    assert tr.loss_mask[-1] == 1  # no dangling observation after the last turn
    _check_invariants(tr, renderer)


async def test_max_tokens_per_turn_closes_the_cut_turn(renderer):
    long_call = call("bash", cmd="x" * 200)
    tr, _ = await _run(renderer, [long_call, "fine"], limits=AgentLimits(max_tokens_per_turn=10))
    t0 = tr.turns[0]
    assert t0.end - t0.start == 10 and t0.finish_reason == "length"
    # unclosed <tool_call> -> an error observation; the turn was closed with <|im_end|> (mask 0)
    assert tr.token_ids[t0.end] == renderer.end_id and tr.loss_mask[t0.end] == 0
    assert "not closed" in tr.turns[0].tool_calls[0].error
    _check_invariants(tr, renderer)
    tr, _ = await _run(renderer, ["a plain answer that is long " * 5], limits=AgentLimits(max_tokens_per_turn=5))
    assert tr.finish_reason == "max_tokens"


async def test_total_token_budget_and_context_length(renderer):
    tr, _ = await _run(renderer, [call("bash", cmd="ls")], limits=AgentLimits(max_tokens_per_turn=100, max_total_tokens=40))
    assert sum(t.end - t.start for t in tr.turns) <= 40 and tr.finish_reason == "max_total_tokens"
    small = ChatRenderer.for_tokenizer(renderer.tokenizer, context_length=len(renderer.render_prompt(PROMPT.messages, FakeToolbox().schemas())) + 60)
    tr, _ = await _run(small, [call("bash", cmd="ls")])
    assert tr.finish_reason == "context_full" and len(tr.token_ids) <= small.context_length
    _check_invariants(tr, small)


async def test_cancel_mid_turn_leaves_a_consistent_trajectory(renderer, autojump_clock):
    slow = ScriptedBackend(renderer, [call("bash", cmd="ls")], latency_s=10.0)
    pool = BackendPool()
    pool.add(slow)
    tr = Trajectory(id="t")
    with trio.move_on_after(25.0):  # the caller's deadline: two turns done, the third cut
        await run_agent(trajectory=tr, prompt=PROMPT, pool=pool, renderer=renderer, toolbox=FakeToolbox(delay_s=1.0),
                        params=P, limits=AgentLimits(), sticky_key="t", group_key=None)
    assert len(tr.turns) == 2 and tr.finish_reason is None
    assert len(tr.token_ids) == len(tr.loss_mask) == len(tr.logprobs)
    assert tr.timing.llm_s == pytest.approx(25.0 - 2.0) and tr.timing.tool_s == pytest.approx(2.0)
    assert pool.describe()[0]["in_flight"] == 0


class NonCanonicalBackend:
    """TEST DOUBLE: samples a valid but non-canonical tokenization ("hel" + "lo")."""

    kind = "scripted"
    url = None
    name = "non-canonical (test double)"

    def __init__(self, renderer):
        self.r = renderer

    async def complete(self, prompt_ids, params, *, max_tokens):
        ids = [*self.r.encode_text("hel"), *self.r.encode_text("lo"), self.r.end_id]
        return Completion(ids, [-0.5] * len(ids), "stop", self.name)

    async def health(self):
        return True

    async def aclose(self):
        pass


async def test_sampled_ids_are_kept_verbatim_never_re_encoded(renderer):
    tr, answer = await _run(renderer, None, backend=NonCanonicalBackend(renderer))
    sampled = tr.token_ids[tr.turns[0].start: tr.turns[0].end]
    assert sampled == [*renderer.encode_text("hel"), *renderer.encode_text("lo"), renderer.end_id]
    assert answer == "hello" and renderer.encode_text(answer) != sampled[:-1]


async def test_reasoning_drop_keeps_the_record_and_shortens_the_context(renderer):
    fam = replace(FAMILIES["chatml"], name="chatml-think", think=("<filename>", "<gh_stars>"), reasoning="drop")
    r = ChatRenderer(renderer.tokenizer, fam)
    seen_prompts = []

    class Thinker(NonCanonicalBackend):  # TEST DOUBLE: think span as special ids, then a reply
        async def complete(self, prompt_ids, params, *, max_tokens):
            seen_prompts.append(list(prompt_ids))
            turn = len(seen_prompts) - 1
            o, c = r.think_ids
            rest = call("bash", cmd="ls") if turn == 0 else "42"
            ids = [o, *r.encode_text(f"thinking {turn}"), c, *r.encode_text(rest), r.end_id]
            return Completion(ids, [-0.5] * len(ids), "stop", self.name)

    backend = Thinker(r)
    tr, answer = await _run(r, None, backend=backend)
    assert answer.endswith("42") and "reasoning-dropped" in tr.labels
    assert "thinking 0" in r.decode(tr.token_ids)  # the record keeps every sampled token
    assert "thinking 0" not in r.decode(seen_prompts[1])  # the model's context does not
    assert seen_prompts[1][: len(seen_prompts[0])] == seen_prompts[0]  # and only grows


async def test_prefix_violation_is_an_error(renderer, monkeypatch):
    def bad_observation(outputs):
        return [renderer.end_id]  # a renderer bug

    tr = Trajectory(id="t")
    pool = BackendPool()
    pool.add(ScriptedBackend(renderer, [call("bash", cmd="ls"), "x"]))
    monkeypatch.setattr(renderer, "context_of_turn", lambda sampled: list(sampled)[:-1])
    with pytest.raises(PrefixMismatch):
        await run_agent(trajectory=tr, prompt=PROMPT, pool=pool, renderer=renderer, toolbox=FakeToolbox(),
                        params=P, limits=AgentLimits(), sticky_key="t", group_key=None)
    assert tr.finish_reason == "error" and tr.turns[0].error
    assert len(tr.token_ids) == len(tr.loss_mask) == len(tr.logprobs)


async def test_require_tool_call_nudges_instead_of_ending(renderer):
    tr, answer = await _run(renderer, ["I think 42", call("finish", answer="42")],
                            limits=AgentLimits(require_tool_call=True))
    assert answer == "42" and len(tr.turns) == 2 and tr.finish_reason == "finish_tool"
    between = renderer.decode(tr.token_ids[tr.turns[0].end: tr.turns[1].start])
    assert between.startswith("\n<|im_start|>user\nYou did not call a tool.")
    assert tr.messages[2] == {"role": "user", "content": "You did not call a tool. Call one of the tools, or call finish with your final answer."}
    _check_invariants(tr, renderer)
    tr, answer = await _run(renderer, ["just text"], limits=AgentLimits(require_tool_call=True, max_turns=3))
    assert tr.finish_reason == "max_turns" and len(tr.turns) == 3 and answer == "just text"


def test_limits_are_one_checked_model():
    """``AgentLimits`` is also the API's ``limits`` (one definition): bounds and unknown keys
    are refused here as they are over HTTP (tests/daemon/test_openapi.py)."""
    from pydantic import ValidationError

    assert AgentLimits.model_validate({"require_tool_call": True}).require_tool_call
    for bad in ({"max_turns": 0}, {"tool_timeout_s": float("nan")}, {"bogus": 1}):
        with pytest.raises(ValidationError):
            AgentLimits.model_validate(bad)


def test_call_seeds_are_per_sample_and_per_call():
    from rolloutd.daemon.llm.base import call_seed

    p = SamplingParams(seed=7)
    assert SamplingParams().for_call(3, 1) == SamplingParams()  # no seed: unchanged
    seeds = {p.for_call(s, c).seed for s in range(8) for c in range(4)}
    assert len(seeds) == 32 and all(0 <= x < 2**31 for x in seeds)
    assert p.for_call(2, 1).seed == call_seed(7, 2, 1) == SamplingParams(seed=7).for_call(2, 1).seed
    assert p.for_call(0, 0).seed != SamplingParams(seed=8).for_call(0, 0).seed


class SeedRecorder(ScriptedBackend):
    """TEST DOUBLE: a scripted backend that also records the seed of every request."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seeds = []

    async def complete(self, prompt_ids, params, *, max_tokens):
        self.seeds.append(params.seed)
        return await super().complete(prompt_ids, params, max_tokens=max_tokens)


async def test_each_turn_of_each_sample_gets_its_own_seed(renderer):
    from rolloutd.daemon.llm.base import call_seed

    seen = []
    for sample in (0, 1):
        backend = SeedRecorder(renderer, [call("bash", cmd="ls"), call("finish", answer="42")])
        pool = BackendPool()
        pool.add(backend)
        tr = Trajectory(id=f"t{sample}", sample_index=sample)
        await run_agent(trajectory=tr, prompt=PROMPT, pool=pool, renderer=renderer,
                        toolbox=FakeToolbox(), params=SamplingParams(seed=11),
                        limits=AgentLimits(), sticky_key=tr.id, group_key=None)
        assert backend.seeds == [call_seed(11, sample, 0), call_seed(11, sample, 1)]
        seen += backend.seeds
    assert len(set(seen)) == 4
