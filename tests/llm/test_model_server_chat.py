"""``POST /v1/chat/completions`` on ``rolloutd model-server``: the shapes the rollout endpoint
answers (daemon/llm/openai_api.py), vLLM's ``return_token_ids`` and ``prompt_logprobs``, tool
calls, streaming, and the official ``openai`` client against a real server process."""

import json

import httpx
import openai
import pytest
import trio

from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.model_server import ModelServerApp
from rolloutd.daemon.llm.openai_api import template_knows_tools, template_messages
from rolloutd.daemon.llm.scripted import ScriptedBackend

from .conftest import open_model_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ms", timeout=120)


def _scripted(renderer, *replies):
    backend = ScriptedBackend(renderer, list(replies))
    return ModelServerApp(backend, renderer, model_name="scripted-test-double",
                          max_model_len=renderer.context_length)


def _events(text):
    """The JSON payloads of an SSE body, and whether it ended with ``[DONE]``."""
    datas = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    return [json.loads(d) for d in datas if d != "[DONE]"], datas[-1] == "[DONE]"


async def test_chat_returns_token_ids_and_logprobs(renderer):
    app = _scripted(renderer, "Five.")
    async with _client(app) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "scripted-test-double", "messages": MESSAGES, "max_tokens": 32,
            "logprobs": True, "return_token_ids": True, "temperature": 0.7, "seed": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = renderer.render_prompt(MESSAGES)
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and out["model"] == "scripted-test-double"
    assert out["prompt_token_ids"] == prompt
    assert choice["token_ids"] == [*renderer.encode_text("Five."), renderer.end_id]
    assert choice["message"] == {"role": "assistant", "content": "Five."}
    assert choice["finish_reason"] == "stop"
    pieces = [x["token"] for x in choice["logprobs"]["content"]]
    assert len(pieces) == len(choice["token_ids"]) and "".join(pieces).startswith("Five.")
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert "prompt_logprobs" not in out


async def test_chat_parses_hermes_tool_calls(renderer):
    app = _scripted(renderer, f"Let me add.\n{CALL}")
    async with _client(app) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "max_completion_tokens": 64, "return_token_ids": True})
        out = r.json()
        choice = out["choices"][0]
        assert r.status_code == 200, r.text
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        assert choice["message"]["content"] == "Let me add."
        # the tools are in the prompt, rendered as the rollout endpoint renders them
        msgs = template_messages(MESSAGES, knows_tools=template_knows_tools(renderer))
        assert out["prompt_token_ids"] == renderer.render_prompt(msgs, TOOLS)
        # a follow-up with the call and its result renders (the hermes blocks in the history)
        history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        r = await client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS,
                                                            "tool_choice": "none"})
        assert r.status_code == 200, r.text
        assert "tool_calls" not in r.json()["choices"][0]["message"]  # tool_choice none: no parsing


async def test_chat_stream_with_token_ids(renderer):
    app = _scripted(renderer, "Five.")
    async with _client(app) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "stream": True, "return_token_ids": True, "logprobs": True,
            "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, done = _events(r.text)
    assert done and all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["prompt_token_ids"] == renderer.render_prompt(MESSAGES)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    delta = events[1]["choices"][0]
    assert delta["delta"]["content"] == "Five."
    assert delta["token_ids"] == [*renderer.encode_text("Five."), renderer.end_id]
    assert len(delta["logprobs"]["content"]) == len(delta["token_ids"])
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert events[3]["choices"] == [] and events[3]["usage"]["completion_tokens"] == len(delta["token_ids"])


async def test_chat_refusals(renderer):
    app = _scripted(renderer, "hi")
    ok = {"messages": MESSAGES}
    async with _client(app) as client:
        for extra, status, param in [
            ({"prompt_logprobs": 1}, 400, "prompt_logprobs"),  # the scripted double has no model
            ({"model": "not-served"}, 404, "model"),
            ({"messages": []}, 400, "messages"),
            ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
            ({"tools": [{"type": "function"}]}, 400, "tools"),
            ({"tool_choice": "required", "tools": TOOLS}, 400, "tool_choice"),
            ({"n": 2}, 400, "n"),
            ({"stop": ["\n"]}, 400, "stop"),
            ({"top_logprobs": 3, "logprobs": True}, 400, "top_logprobs"),
            ({"max_tokens": 0}, 400, "max_tokens"),
            ({"max_tokens": 10**7}, 400, "max_tokens"),
            ({"stream": "yes"}, 400, "stream"),
        ]:
            r = await client.post("/v1/chat/completions", json={**ok, **extra})
            assert r.status_code == status, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == status and err["message"], (extra, err)
        assert (await client.get("/v1/chat/completions")).status_code == 405


def _openai_calls(url):
    """A tool call, then the streamed answer, with the synchronous client (run in a thread:
    the async client's response streams are not aclosed, which trio reports at GC)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model="scripted-test-double", messages=MESSAGES, tools=TOOLS, max_tokens=64,
        extra_body={"return_token_ids": True})
    history = [*MESSAGES, resp.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": resp.choices[0].message.tool_calls[0].id, "content": "5"}]
    streamed = {"text": "", "token_ids": [], "prompt_ids": None, "finish": None, "usage": None}
    with client.chat.completions.create(
            model="scripted-test-double", messages=history, tools=TOOLS, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}) as stream:
        for chunk in stream:
            extra = chunk.model_extra or {}
            streamed["prompt_ids"] = extra.get("prompt_token_ids", streamed["prompt_ids"])
            streamed["usage"] = chunk.usage or streamed["usage"]
            for c in chunk.choices:
                streamed["text"] += c.delta.content or ""
                streamed["token_ids"] += (c.model_extra or {}).get("token_ids") or []
                streamed["finish"] = c.finish_reason or streamed["finish"]
    client.close()
    return resp, streamed


async def test_openai_client_against_a_model_server_process(renderer):
    async with open_model_server("--backend", "scripted", "--reply", f"Adding.\n{CALL}",
                                 "--reply", "It is 5.") as srv:
        resp, streamed = await trio.to_thread.run_sync(_openai_calls, srv.url)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    assert choice.message.tool_calls[0].function.name == "add"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    assert resp.prompt_token_ids == renderer.render_prompt(
        template_messages(MESSAGES, knows_tools=template_knows_tools(renderer)), TOOLS)
    assert choice.token_ids[-1] == renderer.end_id
    assert streamed["text"] == "It is 5." and streamed["finish"] == "stop"
    assert streamed["token_ids"] == [*renderer.encode_text("It is 5."), renderer.end_id]
    prompt_ids = streamed["prompt_ids"]
    assert prompt_ids[: len(resp.prompt_token_ids)] == resp.prompt_token_ids  # the history extends
    assert streamed["usage"].prompt_tokens == len(prompt_ids)


@pytest.mark.model
async def test_prompt_logprobs_from_the_real_model(model_backend, renderer):
    """vLLM's ``prompt_logprobs``: null, then per position the prompt token (with its rank)
    and the ``k`` most likely; the most likely matches a greedy step of the backend."""
    app = ModelServerApp(model_backend, renderer, model_name="SmolLM2-135M-Instruct",
                         max_model_len=model_backend.max_model_len)
    async with _client(app) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2,
            "return_token_ids": True, "logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    prompt, plp = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for pos, tid in enumerate(prompt[1:], start=1):
        entry = plp[pos]
        assert str(tid) in entry and 2 <= len(entry) <= 3
        mine = entry[str(tid)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1
        assert mine["decoded_token"] == renderer.decode([tid])
        assert sorted(e["rank"] for e in entry.values() if e is not mine)[0] <= 2
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and all(best["logprob"] >= e["logprob"] for e in entry.values())
    k = len(prompt) - 1  # the greedy token after prompt[:k] is the rank-1 entry at position k
    c = await model_backend.complete(prompt[:k], SamplingParams(temperature=0), max_tokens=1)
    top = [(int(t), e) for t, e in plp[k].items() if e["rank"] == 1]
    assert top[0][0] == c.token_ids[0] and abs(top[0][1]["logprob"] - c.logprobs[0]) < 1e-3
