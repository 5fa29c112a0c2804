"""The vllm client: request fields, recorded vLLM responses, errors, and a real model-server."""

import copy
import json
import socket
from pathlib import Path

import httpx
import pytest
import trio

from daemon.llm.base import BackendRejected, BackendUnavailable, BadResponse, SamplingParams
from daemon.llm.vllm import VLLMBackend

from .conftest import open_model_server

DATA = Path(__file__).parent / "data"


def recorded(name):
    return json.loads((DATA / name).read_text())


def mock_backend(responses, seen=None, model="Qwen/Qwen2.5-0.5B-Instruct"):
    def handler(request: httpx.Request):
        if seen is not None:
            seen.append(request)
        key = (request.method, request.url.path)
        status, body = responses[key]
        return httpx.Response(status, json=body)
    return VLLMBackend("http://vllm.test:8000/", model, transport=httpx.MockTransport(handler))


STOP = recorded("vllm_0_11_completion_stop.json")
PROMPT = STOP["choices"][0]["prompt_token_ids"]


async def test_request_sends_every_field():
    seen = []
    b = mock_backend({("POST", "/v1/completions"): (200, STOP)}, seen)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=3, stop_token_ids=[151645])
    await b.complete(PROMPT, params, max_tokens=77)
    body = json.loads(seen[0].content)
    assert body == {
        "model": "Qwen/Qwen2.5-0.5B-Instruct", "prompt": PROMPT, "max_tokens": 77, "n": 1, "stream": False,
        "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 3,
        "stop_token_ids": [151645], "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "include_stop_str_in_output": True,
    }
    assert "seed" not in json.loads(await _body_of(SamplingParams()))
    await b.aclose()


async def _body_of(params):
    seen = []
    b = mock_backend({("POST", "/v1/completions"): (200, STOP)}, seen)
    await b.complete(PROMPT, params, max_tokens=1)
    await b.aclose()
    return seen[0].content


async def test_recorded_responses_parse_exactly():
    b = mock_backend({("POST", "/v1/completions"): (200, STOP)})
    c = await b.complete(PROMPT, SamplingParams(), max_tokens=16)
    ch = STOP["choices"][0]
    assert c.token_ids == ch["token_ids"] and c.logprobs == ch["logprobs"]["token_logprobs"]
    assert c.finish_reason == "stop" and c.extra["stop_reason"] == 151645 and c.cached_tokens == 0
    length = recorded("vllm_0_11_completion_length.json")
    b2 = mock_backend({("POST", "/v1/completions"): (200, length)})
    c2 = await b2.complete(length["choices"][0]["prompt_token_ids"], SamplingParams(), max_tokens=3)
    assert c2.finish_reason == "length" and c2.cached_tokens == 32
    assert c2.logprobs[1] == -9999.0  # vLLM's clamp passes through untouched
    await b.aclose()
    await b2.aclose()


@pytest.mark.parametrize("mutate, match", [
    (lambda ch: ch.pop("token_ids"), "token_ids is missing"),
    (lambda ch: ch["logprobs"]["token_logprobs"].pop(), "9 token ids but 8 logprobs"),
    (lambda ch: ch["logprobs"]["tokens"].__setitem__(0, "token_id:1"), "other ids"),
    (lambda ch: ch["logprobs"]["token_logprobs"].__setitem__(2, None), "null or NaN"),
    (lambda ch: ch.__setitem__("prompt_token_ids", [1, 2]), "prompt_token_ids differ"),
    (lambda ch: ch.__setitem__("finish_reason", "weird"), "finish_reason"),
    (lambda ch: ch.pop("logprobs"), "token_logprobs is missing"),
])
async def test_untrustworthy_responses_are_rejected(mutate, match):
    bad = copy.deepcopy(STOP)
    mutate(bad["choices"][0])
    b = mock_backend({("POST", "/v1/completions"): (200, bad)})
    with pytest.raises(BadResponse, match=match):
        await b.complete(PROMPT, SamplingParams(), max_tokens=16)
    await b.aclose()


async def test_old_vllm_without_token_ids_is_rejected():
    b = mock_backend({("POST", "/v1/completions"): (200, recorded("vllm_0_10_1_no_token_ids.json"))})
    with pytest.raises(BadResponse, match="0.10.2"):
        await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    await b.aclose()


async def test_errors_map_to_the_llm_tree():
    err = {"object": "error", "message": "This model's maximum context length is 32768 tokens", "type": "BadRequestError", "code": 400}
    b = mock_backend({("POST", "/v1/completions"): (400, err)})
    with pytest.raises(BackendRejected, match="maximum context length"):
        await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    b = mock_backend({("POST", "/v1/completions"): (503, {"error": "engine dead"})})
    with pytest.raises(BackendUnavailable):
        await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = VLLMBackend(f"http://127.0.0.1:{port}", "m")
    with pytest.raises(BackendUnavailable):
        await dead.complete(PROMPT, SamplingParams(), max_tokens=1)
    assert await dead.health() is False
    await dead.aclose()


async def test_model_discovery():
    b = mock_backend({("GET", "/v1/models"): (200, recorded("vllm_models.json")),
                      ("POST", "/v1/completions"): (200, STOP)}, model=None)
    await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    assert b.model == "Qwen/Qwen2.5-0.5B-Instruct" and b.max_model_len == 32768
    await b.aclose()


async def test_against_a_scripted_model_server_process(renderer):
    async with open_model_server("--backend", "scripted", "--reply", "hello there", "--latency-s", "1") as srv:
        b = VLLMBackend(srv.url, kind="model-server")
        assert await b.health()
        prompt = renderer.render_prompt([{"role": "user", "content": "hi"}])
        c = await b.complete(prompt, SamplingParams(stop_token_ids=[2]), max_tokens=32)
        assert c.token_ids == [*renderer.encode_text("hello there"), renderer.end_id] and c.finish_reason == "stop"
        assert b.model == "scripted-test-double"
        c = await b.complete(prompt, SamplingParams(), max_tokens=2)
        assert c.finish_reason == "length" and len(c.token_ids) == 2
        # cancelling the client aborts the request on the server
        with trio.move_on_after(0.3):
            await b.complete(prompt, SamplingParams(), max_tokens=8)
        async with httpx.AsyncClient(base_url=srv.url) as client:
            with trio.fail_after(5):
                while 'outcome="aborted"} 1.0' not in (text := (await client.get("/metrics")).text):
                    await trio.sleep(0.1)
            assert "rolloutd_model_server_generation_tokens_total 5.0" in text
            r = await client.post("/v1/completions", json={"prompt": "text prompt", "max_tokens": 1})
            assert r.status_code == 400
            r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "n": 2})
            assert r.status_code == 400
            assert (await client.get("/nope")).status_code == 404
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == "scripted-test-double"
        await b.aclose()
