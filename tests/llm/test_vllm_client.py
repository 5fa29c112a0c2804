"""The vllm client: request fields, vLLM responses (hand-written from vLLM's source, see
data/README.md), errors, and a real model-server."""

import copy
import json
import socket
from pathlib import Path

import httpx
import pytest
import trio

from rolloutd.daemon.llm.base import (
    BackendRejected,
    BackendUnavailable,
    BadResponse,
    SamplingParams,
)
from rolloutd.daemon.llm.model_server import ModelServerApp
from rolloutd.daemon.llm.vllm import ModelServerBackend, VLLMBackend

from .conftest import open_model_server

DATA = Path(__file__).parent / "data"
FIXTURES = sorted(p.name for p in DATA.glob("*.json"))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fixture(name):
    """A response body from data/ (recorded from a real vLLM, or hand-written where labelled so),
    without its ``_source`` label."""
    body = json.loads((DATA / name).read_text())
    body.pop("_source", None)
    return body


def mock_backend(responses, seen=None, model=MODEL):
    def handler(request: httpx.Request):
        if seen is not None:
            seen.append(request)
        key = (request.method, request.url.path)
        status, body = responses[key]
        return httpx.Response(status, json=body)
    return VLLMBackend("http://vllm.test:8000/", model, transport=httpx.MockTransport(handler))


STOP = fixture("vllm_completion_stop.json")  # recorded from vLLM 0.32.0 (CPU build)
PROMPT = STOP["choices"][0]["prompt_token_ids"]


async def test_request_sends_every_field():
    seen = []
    b = mock_backend({("POST", "/v1/completions"): (200, STOP)}, seen)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=3, stop_token_ids=[2])
    await b.complete(PROMPT, params, max_tokens=77)
    body = json.loads(seen[0].content)
    assert body == {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 77, "n": 1, "stream": False,
        "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 3,
        "stop_token_ids": [2], "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
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


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_labelled_and_consistent(name, tokenizer):
    """Every file in data/ says where it comes from (a recording names its vLLM version and
    command; a hand-written file says so) and is consistent
    the way vLLM's serving_completion.py builds a response (see data/README.md)."""
    raw = json.loads((DATA / name).read_text())
    src = raw.get("_source")
    assert isinstance(src, dict), f"{name}: no _source label"
    assert src["origin"] in ("hand-written", "recorded"), src
    assert "vLLM v0." in src["follows"] and "vllm/entrypoints/openai/" in src["follows"]
    if src["origin"] == "recorded":  # a recording names what produced it
        assert src["recording"] is True and src["vllm_version"] and src["command"]
    else:
        assert src["recording"] is False
    if raw["object"] == "list":  # GET /v1/models
        assert [m["id"] for m in raw["data"]] == [MODEL]
        return
    assert raw["model"] == MODEL
    check_completion_shape(raw, src["request"], tokenizer)
    cached = (raw["usage"]["prompt_tokens_details"] or {}).get("cached_tokens")
    assert cached is None or cached % 16 == 0  # vLLM caches whole blocks (null in older versions for 0)


def check_completion_shape(body, request, tokenizer):
    """``body`` is consistent the way vLLM's serving_completion.py builds a response to
    ``request`` (logprobs=0, return_tokens_as_token_ids; see data/README.md)."""
    assert body["object"] == "text_completion"
    usage = body["usage"]
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    tokens = lp["tokens"]
    n = len(tokens)
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert tokens == [f"token_id:{i}" for i in ids]
    if "token_ids" in choice:
        assert choice["token_ids"] == ids
        assert usage["prompt_tokens"] == len(choice["prompt_token_ids"])
    # text_offset: 0, then the running sum of the lengths of the previous entries of `tokens`
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert "".join(tokens)[offsets[-1]:] == tokens[-1]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert lp["top_logprobs"] == [{t: x} for t, x in zip(tokens, lp["token_logprobs"], strict=True)]
    assert all(-9999.0 <= x <= 0.0 for x in lp["token_logprobs"])
    assert usage["completion_tokens"] == n and usage["total_tokens"] == usage["prompt_tokens"] + n
    cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens")
    assert cached is None or 0 <= cached <= usage["prompt_tokens"]
    if choice["finish_reason"] == "length":
        assert n == request["max_tokens"] and choice["stop_reason"] is None
    else:
        assert choice["finish_reason"] == "stop" and n <= request["max_tokens"]
        if ids[-1] == tokenizer.eos_token_id:  # EOS: vLLM leaves stop_reason null
            assert choice["stop_reason"] is None
        else:
            assert choice["stop_reason"] == ids[-1] and ids[-1] in request["stop_token_ids"]


async def test_vllm_responses_parse_exactly():
    b = mock_backend({("POST", "/v1/completions"): (200, STOP)})
    c = await b.complete(PROMPT, SamplingParams(), max_tokens=64)
    ch = STOP["choices"][0]
    assert c.token_ids == ch["token_ids"] and c.logprobs == ch["logprobs"]["token_logprobs"]
    assert c.finish_reason == "stop" and "stop_reason" not in c.extra and c.cached_tokens == 0
    length = fixture("vllm_completion_length.json")
    b2 = mock_backend({("POST", "/v1/completions"): (200, length)})
    c2 = await b2.complete(length["choices"][0]["prompt_token_ids"], SamplingParams(), max_tokens=3)
    assert c2.finish_reason == "length" and c2.cached_tokens == length["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert c2.token_ids == length["choices"][0]["token_ids"] and c2.logprobs == length["choices"][0]["logprobs"]["token_logprobs"]
    clamped = copy.deepcopy(length)  # an edit of the recording: vLLM clamps -inf at -9999.0
    clamped["choices"][0]["logprobs"]["token_logprobs"][1] = -9999.0
    b4 = mock_backend({("POST", "/v1/completions"): (200, clamped)})
    c4 = await b4.complete(length["choices"][0]["prompt_token_ids"], SamplingParams(), max_tokens=3)
    assert c4.logprobs[1] == -9999.0  # the clamp passes through untouched
    stopped = copy.deepcopy(STOP)
    stopped["choices"][0]["stop_reason"] = 2  # a stop_token_ids hit (not EOS) names the token
    b3 = mock_backend({("POST", "/v1/completions"): (200, stopped)})
    assert (await b3.complete(PROMPT, SamplingParams(), max_tokens=64)).extra["stop_reason"] == 2
    for backend in (b, b2, b3, b4):
        await backend.aclose()


@pytest.mark.parametrize("mutate, match", [
    (lambda ch: ch.pop("token_ids"), "token_ids is missing"),
    (lambda ch: ch["logprobs"]["token_logprobs"].pop(),
     f"{len(STOP['choices'][0]['token_ids'])} token ids but {len(STOP['choices'][0]['token_ids']) - 1} logprobs"),
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
    b = mock_backend({("POST", "/v1/completions"): (200, fixture("vllm_0_10_1_no_token_ids.json"))})
    with pytest.raises(BadResponse, match="0.10.2"):
        await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    await b.aclose()


async def test_errors_map_to_the_llm_tree():
    # vLLM >= 0.10.1 nests the error (ErrorResponse.error: ErrorInfo); older vLLM had it flat
    nested = {"error": {"message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}
    b = mock_backend({("POST", "/v1/completions"): (404, nested)})
    with pytest.raises(BackendRejected, match=r"HTTP 404 NotFoundError: The model `other` does not exist\. \(param model\)$"):
        await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    flat = {"object": "error", "message": "This model's maximum context length is 8192 tokens", "type": "BadRequestError", "param": None, "code": 400}
    b = mock_backend({("POST", "/v1/completions"): (400, flat)})
    with pytest.raises(BackendRejected, match="HTTP 400 BadRequestError: This model's maximum context length is 8192 tokens$"):
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
    b = mock_backend({("GET", "/v1/models"): (200, fixture("vllm_models.json")),
                      ("POST", "/v1/completions"): (200, STOP)}, model=None)
    await b.complete(PROMPT, SamplingParams(), max_tokens=1)
    assert b.model == MODEL and b.max_model_len == 8192
    await b.aclose()


async def test_against_a_scripted_model_server_process(renderer):
    async with open_model_server("--backend", "scripted", "--reply", "hello there", "--latency-s", "1") as srv:
        b = ModelServerBackend(srv.url)
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


def _error_body(r, status, param):
    """vLLM's error shape (>= 0.10.1): ``{"error": {"message", "type", "param", "code"}}``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and err["message"]
    return err


async def _check_bad_requests(srv, model, tokenizer):
    """What vLLM refuses, model-server refuses the same way (and never with a 500)."""
    ok = {"prompt": [1, 2, 3], "max_tokens": 1}
    vocab = len(tokenizer)
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        r = await client.post("/v1/completions", json={**ok, "prompt": [1, vocab, 2]})
        err = _error_body(r, 400, "prompt")
        assert err["type"] == "BadRequestError" and err["message"].startswith(f"Token id {vocab} is out of vocabulary")
        r = await client.post("/v1/completions", json={**ok, "prompt": [-1]})
        assert _error_body(r, 400, "prompt")["message"].startswith("Token id -1 is out of vocabulary")
        r = await client.post("/v1/completions", json={**ok, "stop_token_ids": [10**9]})
        _error_body(r, 400, "stop_token_ids")
        r = await client.post("/v1/completions", json={**ok, "model": "not-served"})
        err = _error_body(r, 404, "model")
        assert (err["type"], err["message"]) == ("NotFoundError", "The model `not-served` does not exist.")
        for field, value in [("prompt_logprobs", 0), ("echo", True), ("stop", ["\n"]), ("presence_penalty", 0.5)]:
            r = await client.post("/v1/completions", json={**ok, field: value})
            assert "not supported" in _error_body(r, 400, field)["message"]
        r = await client.post("/v1/completions", json={**ok, "max_tokens": 0})
        _error_body(r, 400, "max_tokens")
        # the "off" values of those fields, and the served model's name, are accepted; the
        # answer passes the checks the hand-written vLLM responses pass
        for extra in ({}, {"model": model, "prompt_logprobs": None, "echo": False, "stop": []}):
            request = {**ok, **extra, "max_tokens": 3, "logprobs": 0, "return_token_ids": True,
                       "return_tokens_as_token_ids": True, "stop_token_ids": [2]}
            r = await client.post("/v1/completions", json=request)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["prompt_token_ids"] == [1, 2, 3]
            check_completion_shape(r.json(), request, tokenizer)
    vllm = ModelServerBackend(srv.url, "not-served")
    with pytest.raises(BackendRejected, match="HTTP 404 NotFoundError: The model `not-served` does not exist"):
        await vllm.complete([1, 2], SamplingParams(), max_tokens=1)
    await vllm.aclose()


async def test_model_server_refuses_like_vllm_scripted(tokenizer):
    async with open_model_server("--backend", "scripted", "--reply", "hi") as srv:
        await _check_bad_requests(srv, "scripted-test-double", tokenizer)


@pytest.mark.model
async def test_model_server_refuses_like_vllm_real_model(tokenizer):
    """The real model: an out-of-vocabulary id used to reach the embedding and answer 500 with
    an empty body."""
    async with open_model_server("--backend", "transformers") as srv:
        await _check_bad_requests(srv, "SmolLM2-135M-Instruct", tokenizer)


class _FailingBackend:
    """TEST DOUBLE: a backend whose every completion raises ``error``."""

    name = "failing (test double)"
    kind = "scripted"

    def __init__(self, error):
        self.error = error

    async def complete(self, prompt_ids, params, *, max_tokens):
        raise self.error

    async def health(self):
        return True

    async def aclose(self):
        pass


@pytest.mark.parametrize("error, status, etype", [
    (BackendRejected("the prompt is too long"), 400, "BadRequestError"),
    (BackendUnavailable("torch failed"), 503, "ServiceUnavailableError"),
    (KeyError("a bug of ours"), 500, "InternalServerError"),
])
async def test_backend_failures_answer_json_errors(renderer, caplog, error, status, etype):
    """A backend's refusal is a 400 and its failure a 503 (they used to reach the client as a
    500 with an empty body: raised inside the disconnect nursery, they came out wrapped in an
    ExceptionGroup); a bug of ours is a JSON 500."""
    app = ModelServerApp(_FailingBackend(error), renderer, model_name="m", max_model_len=64)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ms") as client:
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    err = _error_body(r, status, None)
    assert err["type"] == etype and str(error.args[0]) in err["message"]
    if status == 500:
        assert "KeyError" in err["message"] and "model-server: POST /v1/completions failed" in caplog.text
