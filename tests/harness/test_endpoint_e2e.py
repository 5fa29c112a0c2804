"""Harness-driven rollouts end to end: a harness in a real sandbox calls the rollout's endpoint
with the official ``openai`` and ``anthropic`` clients; the scripted backend (TEST DOUBLE,
recording what it answers) is the policy, so every call's recorded
ids and logprobs can be checked against what the backend returned."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

import pytest

from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.trajectory import Status, Trajectory
from tests.tasks.conftest import Harness, renderer, tool_call


async def policy(h: Harness, replies: Any, **kw: Any) -> ScriptedBackend:
    """The scripted backend (TEST DOUBLE) as the policy, keeping every answer in ``log``."""
    if h._backend_id is not None:
        await h.pool.remove(h._backend_id)
    backend = ScriptedBackend(renderer(), replies, record=True, **kw)
    h._backend_id = h.pool.add(backend, backend_id="scripted")
    return backend


def task(script: str, **agent: Any) -> dict[str, Any]:
    return {"kind": "math", "question": "What is 1+1?", "answer": "2",
            "agent": {"command": [sys.executable, "-c", textwrap.dedent(script)], **agent}}


def check_exact(t: Trajectory, backend: ScriptedBackend) -> None:
    """Call by call: the segment holds the prompt the backend got, then exactly its ids and
    logprobs (loss mask 1); the top-level sequence is the last segment."""
    assert backend.log is not None and len(t.turns) == len(backend.log)
    for turn, (prompt, c) in zip(t.turns, backend.log, strict=True):
        assert turn.segment is not None
        seg = t.segments[turn.segment]
        assert seg.token_ids[: turn.start] == prompt
        assert seg.token_ids[turn.start:turn.end] == c.token_ids
        assert seg.logprobs[turn.start:turn.end] == c.logprobs
        assert seg.loss_mask[turn.start:turn.end] == [1] * len(c.token_ids)
    for seg in t.segments:
        n = len(seg.token_ids)
        assert len(seg.loss_mask) == n == len(seg.logprobs)
        assert all((m == 1) == (lp is not None) for m, lp in zip(seg.loss_mask, seg.logprobs, strict=True))
        assert seg.loss_mask[: seg.prompt_length] == [0] * seg.prompt_length
    last = t.segments[-1]
    assert (t.token_ids, t.loss_mask, t.logprobs) == (last.token_ids, last.loss_mask, last.logprobs)


OPENAI_TWO_CALLS = """
    import os, openai
    client = openai.OpenAI()
    task = open(os.environ["ROLLOUTD_TASK_FILE"]).read()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task}]
    r = client.chat.completions.create(model="m", messages=msgs)
    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    msgs.append({"role": "user", "content": "Are you sure?"})
    r = client.chat.completions.create(model="m", messages=msgs, logprobs=True,
                                       extra_body={"return_token_ids": True})
    lp = [x.logprob for x in r.choices[0].logprobs.content]
    print("LOGPROBS", len(lp), len(r.model_extra["prompt_token_ids"]))
    print("USAGE", r.usage.prompt_tokens, r.usage.completion_tokens)
    print("ANSWER", r.choices[0].message.content)
"""


async def test_openai_client_two_calls_one_exact_segment(harness: Harness) -> None:
    backend = await policy(harness, ["I think 3.", "The answer is 2."])
    t = await harness.run(task(OPENAI_TWO_CALLS))
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.harness is not None and t.harness.exit_code == 0, t.harness
    assert "ANSWER The answer is 2." in t.harness.output_tail
    prompt, c = backend.log[1]
    assert f"LOGPROBS {len(c.token_ids)} {len(prompt)}" in t.harness.output_tail
    assert f"USAGE {len(prompt)} {len(c.token_ids)}" in t.harness.output_tail
    assert t.reward == 1.0 and t.usable
    assert len(t.segments) == 1 and t.harness.calls == 2 and t.harness.merged_calls == 1
    assert [turn.merged for turn in t.turns] == [False, True]
    check_exact(t, backend)
    assert t.finish_reason == "agent_exit"
    assert t.messages[-1]["content"] == "The answer is 2."


OPENAI_TOOLS_STREAM = """
    import json, openai
    client = openai.OpenAI()
    tools = [{"type": "function", "function": {"name": "bash", "description": "run a command",
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What is 1+1? Use bash."}]
    for step in range(3):
        stream = client.chat.completions.create(model="m", messages=msgs, tools=tools, stream=True,
                                                stream_options={"include_usage": True})
        content, calls, usage, finish = "", {}, None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                "function": {"name": tc.function.name, "arguments": ""}})
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
        print("STEP", step, finish, usage.completion_tokens, len(calls))
        msgs.append({"role": "assistant", "content": content or None,
                     **({"tool_calls": list(calls.values())} if calls else {})})
        if not calls:
            break
        for call in calls.values():
            cmd = json.loads(call["function"]["arguments"])["command"]
            import subprocess
            out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": out})
    print("ANSWER", content)
"""


async def test_openai_streaming_tool_calls_merge(harness: Harness) -> None:
    backend = await policy(harness, [tool_call("bash", command="echo $((1+1))"), "The answer is 2."])
    t = await harness.run(task(OPENAI_TOOLS_STREAM))
    assert t.status is Status.completed, (t.error, t.harness)
    out = t.harness.output_tail if t.harness else ""
    assert "STEP 0 tool_calls" in out and "STEP 1 stop" in out, out
    assert t.reward == 1.0
    assert len(t.segments) == 1 and [x.merged for x in t.turns] == [False, True]
    check_exact(t, backend)
    # the tool's output went in as the template's observation turn (loss mask 0)
    seg = t.segments[0]
    between = seg.token_ids[t.turns[0].end:t.turns[1].start]
    assert "2\n" in renderer().decode(between)


ANTHROPIC_TOOLS = """
    import anthropic
    client = anthropic.Anthropic()
    tools = [{"name": "calc", "description": "add", "input_schema": {"type": "object",
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    r = client.messages.create(model="m", max_tokens=64, system="Be brief.", messages=msgs, tools=tools)
    print("STOP", r.stop_reason, [b.type for b in r.content], r.usage.input_tokens, r.usage.output_tokens)
    use = next(b for b in r.content if b.type == "tool_use")
    msgs.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                 "content": str(use.input["a"] + use.input["b"])}]})
    with client.messages.stream(model="m", max_tokens=64, system="Be brief.", messages=msgs,
                                tools=tools) as stream:
        final = stream.get_final_message()
    print("STOP", final.stop_reason, final.content[0].text)
"""


async def test_anthropic_client_tool_use_and_stream(harness: Harness) -> None:
    backend = await policy(harness, [tool_call("calc", a=1, b=1), "The answer is 2."])
    t = await harness.run(task(ANTHROPIC_TOOLS))
    assert t.status is Status.completed, (t.error, t.harness)
    out = t.harness.output_tail if t.harness else ""
    assert "STOP tool_use ['tool_use']" in out and "STOP end_turn The answer is 2." in out, out
    assert t.reward == 1.0
    assert len(t.segments) == 1 and t.harness and t.harness.merged_calls == 1
    check_exact(t, backend)


REWRITE = """
    import openai
    client = openai.OpenAI()
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think."}])
    # the harness drops the reply and starts over with a summary: a new segment
    msgs = [{"role": "system", "content": "Summary: you thought."},
            {"role": "user", "content": "What is 1+1?"}]
    r = client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Final answer?"}]
    r = client.chat.completions.create(model="m", messages=msgs)
    print("ANSWER", r.choices[0].message.content)
"""


async def test_rewritten_history_gives_two_exact_segments(harness: Harness) -> None:
    backend = await policy(harness, ["Hmm.", "Maybe 2.", "The answer is 2."])
    t = await harness.run(task(REWRITE))
    assert t.status is Status.completed, (t.error, t.harness)
    assert len(t.segments) == 2
    assert [x.segment for x in t.turns] == [0, 1, 1]
    assert [x.merged for x in t.turns] == [False, False, True]
    assert [s.calls for s in t.segments] == [1, 2]
    assert t.harness is not None and (t.harness.calls, t.harness.merged_calls) == (3, 1)
    check_exact(t, backend)
    assert t.reward == 1.0


COMPLETIONS = """
    import openai
    client = openai.OpenAI()
    r = client.completions.create(model="m", prompt="Q: 1+1?\\nA:", max_tokens=8, logprobs=0,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    prompt = ch.model_extra["prompt_token_ids"] + ch.model_extra["token_ids"] + [198]
    r2 = client.completions.create(model="m", prompt=prompt, max_tokens=8)
    print("TEXT", repr(ch.text), len(ch.logprobs.token_logprobs), r2.usage.prompt_tokens, len(prompt))
"""


async def test_completions_text_and_token_ids(harness: Harness) -> None:
    backend = await policy(harness, ["2", "The answer is 2."])
    t = await harness.run(task(COMPLETIONS))
    assert t.status is Status.completed, (t.error, t.harness)
    out = t.harness.output_tail if t.harness else ""
    assert "TEXT" in out, out
    assert len(t.segments) == 1 and [x.merged for x in t.turns] == [False, True]  # token-level merge
    check_exact(t, backend)


NEVER_EXITS = """
    import time, openai
    openai.OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    print("CALLED", flush=True)
    while True:
        time.sleep(1)
"""


async def test_harness_that_never_exits_is_cut_at_the_budget(harness: Harness) -> None:
    backend = await policy(harness, ["The answer is 2."])
    t = await harness.run(task(NEVER_EXITS), timeout_s=8)
    assert t.status is Status.timed_out, (t.error, t.harness)
    assert t.usable and t.reward == 0.0
    assert t.harness is not None and t.harness.ended == "cut" and t.harness.exit_code is None
    assert "CALLED" in t.harness.output_tail
    assert len(t.segments) == 1
    check_exact(t, backend)


async def test_agent_timeout_stops_the_harness_and_evaluates(harness: Harness) -> None:
    await policy(harness, ["The answer is 2."])
    t = await harness.run(task(NEVER_EXITS, timeout_s=3))
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.harness is not None and t.harness.ended == "timeout"
    assert t.finish_reason == "agent_timeout"
    assert t.reward == 1.0  # EVAL scored what the harness said


OVER_BUDGET = """
    import openai
    client = openai.OpenAI(max_retries=0)
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    r = client.chat.completions.create(model="m", messages=msgs)
    try:
        client.chat.completions.create(model="m", messages=msgs)
    except openai.BadRequestError as exc:
        print("REFUSED", exc.status_code, exc.code)
    bad = openai.OpenAI(api_key="sk-not-this-rollouts", max_retries=0)
    try:
        bad.chat.completions.create(model="m", messages=msgs)
    except openai.AuthenticationError as exc:
        print("UNAUTHORIZED", exc.status_code)
"""


async def test_calls_over_the_limits_get_an_api_error(harness: Harness) -> None:
    await policy(harness, ["The answer is 2."])
    t = await harness.run(task(OVER_BUDGET), max_turns=1)
    assert t.status is Status.completed, (t.error, t.harness)
    out = t.harness.output_tail if t.harness else ""
    assert "REFUSED 400 rollout_budget_exhausted" in out, out
    assert "UNAUTHORIZED 401" in out, out
    assert t.harness is not None and t.harness.calls == 1 and t.harness.refused_calls == 1


async def test_per_call_max_tokens_is_capped_by_the_limits(harness: Harness) -> None:
    backend = await policy(harness, ["one two three four five six seven eight nine ten"])
    script = """
        import openai
        r = openai.OpenAI().chat.completions.create(model="m", max_tokens=1000,
            messages=[{"role": "user", "content": "count"}])
        print("FINISH", r.choices[0].finish_reason, r.usage.completion_tokens)
    """
    t = await harness.run(task(script), max_tokens_per_turn=4)
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.harness is not None and "FINISH length 4" in t.harness.output_tail
    check_exact(t, backend)


async def test_backend_failure_fails_the_rollout(harness: Harness) -> None:
    backend = await policy(harness, ["The answer is 2."])
    backend.set_down(True)
    script = """
        import openai, time
        try:
            openai.OpenAI(max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            print("STATUS", exc.status_code)
        time.sleep(60)
    """
    t = await harness.run(task(script), timeout_s=60)
    assert t.status is Status.failed, t
    assert t.error is not None and t.error.stage == "run"
    assert t.reward is None  # never disguised as reward 0


@pytest.mark.parametrize("agent", [{"command": []}, {"command": ["x"], "env": {"A": 1}},
                                   {"command": ["x"], "install": {"wheels": "rel", "packages": ["a"]}},
                                   {"command": "x"}])
async def test_bad_agent_is_refused_at_submit(harness: Harness, agent: dict[str, Any]) -> None:
    from rolloutd.daemon.errors import DaemonError
    from rolloutd.daemon.service import RolloutRequest

    with pytest.raises(DaemonError, match="agent"):
        harness.node.submit(RolloutRequest(task={"kind": "math", "question": "q", "answer": "1",
                                                 "agent": agent}))


TINY_AGENT = '''
import json, os, urllib.request

def main():
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "1+1?"}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req))
    print("TINY", reply["choices"][0]["message"]["content"])
'''


@pytest.fixture(scope="module")
def tiny_wheels(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding one wheel: a minimal harness with a console script, built here."""
    import subprocess

    src = tmp_path_factory.mktemp("tinyagent")
    (src / "tinyagent.py").write_text(TINY_AGENT)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tinyagent"\nversion = "0.1"\n'
        '[project.scripts]\ntinyagent = "tinyagent:main"\n'
        '[tool.setuptools]\npy-modules = ["tinyagent"]\n')
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)], check=True, capture_output=True)
    return str(out)


async def test_harness_installed_from_a_wheel_dir_at_init(harness: Harness, tiny_wheels: str) -> None:
    await policy(harness, ["The answer is 2."])
    agent = {"command": ["tinyagent"],
             "install": {"wheels": tiny_wheels, "packages": ["tinyagent"], "python": sys.executable}}
    t = await harness.run({"kind": "math", "question": "What is 1+1?", "answer": "2", "agent": agent})
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.harness is not None and "TINY The answer is 2." in t.harness.output_tail
    assert t.reward == 1.0


async def test_a_failed_install_fails_the_rollout_in_init(harness: Harness, tmp_path: Any) -> None:
    await policy(harness, ["The answer is 2."])
    agent = {"command": ["tinyagent"],
             "install": {"wheels": str(tmp_path), "packages": ["tinyagent"], "python": sys.executable}}
    t = await harness.run({"kind": "math", "question": "What is 1+1?", "answer": "2", "agent": agent})
    assert t.status is Status.failed and t.error is not None
    assert (t.error.stage, t.error.type) == ("init", "HarnessError"), t.error
    assert "agent install failed" in t.error.message


async def test_replay_feeds_the_recorded_replies_back_to_the_harness(harness: Harness) -> None:
    """The harness runs again; each call gets the recorded reply (not the backend), and its
    prompts (what it made of its world) are compared token for token."""
    backend = await policy(harness, ["Hmm.", "Maybe 2.", "The answer is 2."])
    t = await harness.run(task(REWRITE))
    assert t.status is Status.completed
    calls = len(backend.log)
    req, original = harness.node.service.replay_request(t.id)
    job = harness.node.submit(req, replay_of=original).jobs[0]
    await job.done.wait()
    r = job.trajectory
    assert r.status is Status.completed, (r.error, r.harness)
    assert len(backend.log) == calls  # the policy was not asked again
    assert r.replay is not None and r.replay.tool_outputs_equal is True, r.replay
    assert r.replay.tool_calls == 3
    assert [s.token_ids for s in r.segments] == [s.token_ids for s in t.segments]
    assert r.reward == t.reward


async def test_a_long_history_is_rendered_and_recorded(harness: Harness) -> None:
    """A first call with a long history (rendered off the event loop) is exact too."""
    backend = await policy(harness, ["The answer is 2."])
    script = """
        import openai
        msgs = [{"role": "user", "content": "words " * 6000}]
        r = openai.OpenAI().chat.completions.create(model="m", messages=msgs)
        print("USAGE", r.usage.prompt_tokens)
    """
    t = await harness.run(task(script), max_tokens_per_turn=8)
    assert t.status is Status.completed, (t.error, t.harness)
    assert t.segments[0].prompt_length > 5000, t.harness
    check_exact(t, backend)


async def test_a_prompt_over_the_context_is_refused(harness: Harness) -> None:
    await policy(harness, ["The answer is 2."])
    script = """
        import openai
        try:
            openai.OpenAI(max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 12000}])
        except openai.BadRequestError as exc:
            print("REFUSED", exc.code)
    """
    t = await harness.run(task(script))
    assert t.harness is not None and "REFUSED context_length_exceeded" in t.harness.output_tail
    assert t.harness.calls == 0 and not t.segments
