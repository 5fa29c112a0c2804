"""Replay (daemon/replay.py), token text and span start times against a real ``rolloutd serve``.

The original rollouts' policy is the scripted backend, a labelled TEST DOUBLE (run the task's
``run.sh``, then finish); a replay must not use it: its turns are the recorded sampled tokens
(``backend`` names the replay, and the scripted backend's ``calls`` never see it). Sandboxes
are the ``local`` backend (a fresh workspace per rollout is all a replay needs here).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rolloutd.daemon.cli import main
from tests.hostile._daemon import GOOD, RUN_SCRIPT, Daemon, code_task

pytestmark = pytest.mark.slow

#: Writes a file and echoes it (and the solution, so that the reward is 1).
WRITES_AND_ECHOES = f"echo 'héllo 日本' > out.txt; cat out.txt; {GOOD}"
RANDOM = "head -c 12 /dev/urandom | od -An -tx1"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("replay") / "state", sandbox_backend="local",
               log_level="warning", backends=[{"kind": "scripted", "replies": RUN_SCRIPT}])
    d.start_sync()
    try:
        yield d
    finally:
        d.stop_sync()


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, headers=daemon.headers, timeout=60) as h:
        yield h


def run(h: httpx.Client, task: dict[str, Any]) -> dict[str, Any]:
    r = h.post("/v1/rollouts", json={"task": task, "wait": True})
    assert r.status_code == 200, r.text
    (traj,) = r.json()["rollouts"]
    assert traj["status"] == "completed", traj
    return dict(traj)


def finished(h: httpx.Client, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        traj = h.get(f"/v1/rollouts/{rid}").json()
        if traj["status"] not in ("queued", "init", "run", "eval"):
            return dict(traj)
        time.sleep(0.1)
    raise AssertionError(f"{rid} did not finish")


def tool_outputs(traj: dict[str, Any]) -> list[str]:
    return [m["content"] for m in traj["messages"] if m["role"] == "tool"]


def test_replay_runs_the_recorded_turns_again_with_equal_tool_outputs(http: httpx.Client) -> None:
    orig = run(http, code_task(WRITES_AND_ECHOES))
    assert "héllo 日本\nwrote" in tool_outputs(orig)[0]
    r = http.post(f"/v1/rollouts/{orig['id']}/replay")
    assert r.status_code == 202, r.text
    assert r.json()["replay_of"] == orig["id"]
    rep = finished(http, r.json()["id"])
    assert rep["status"] == "completed" and rep["id"] != orig["id"]
    assert rep["replay"] == {"of": orig["id"], "turns": 2, "tool_calls": 2, "tool_outputs_equal": True,
                             "first_difference": None}
    assert "replay" in rep["labels"] and f"replay-of:{orig['id']}" in rep["labels"]
    # The recorded sampled tokens, not the scripted backend: same ids, logprobs, replay backend.
    for t_orig, t_rep in zip(orig["turns"], rep["turns"], strict=True):
        assert rep["token_ids"][t_rep["start"]:t_rep["end"]] == orig["token_ids"][t_orig["start"]:t_orig["end"]]
        assert rep["logprobs"][t_rep["start"]:t_rep["end"]] == orig["logprobs"][t_orig["start"]:t_orig["end"]]
        assert t_rep["backend"] == f"replay of {orig['id']}"
        assert [c["output_equal"] for c in t_rep["tool_calls"]] == [True] * len(t_rep["tool_calls"])
    assert tool_outputs(rep) == tool_outputs(orig)
    assert rep["token_ids"] == orig["token_ids"] and rep["reward"] == orig["reward"] == 1.0


def test_a_replay_whose_environment_differs_names_the_first_difference(
        http: httpx.Client, daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    orig = run(http, code_task(RANDOM))
    code = main(["replay", orig["id"], "--wait", "--url", daemon.url])
    out = json.loads(capsys.readouterr().out)
    assert code == 1, out  # the outputs differ
    rep = out["replay"]
    assert (rep["of"], rep["tool_outputs_equal"]) == (orig["id"], False)
    first = rep["first_difference"]
    assert (first["turn"], first["call"], first["tool"]) == (0, 0, "bash")
    assert first["recorded"] == tool_outputs(orig)[0] and first["replayed"] != first["recorded"]
    traj = http.get(f"/v1/rollouts/{out['id']}").json()
    assert [c["output_equal"] for t in traj["turns"] for c in t["tool_calls"]] == [False, True]
    # Without --wait: the new id at once.
    assert main(["replay", orig["id"], "--url", daemon.url]) == 0
    started = json.loads(capsys.readouterr().out)
    assert started["replay_of"] == orig["id"]
    finished(http, started["id"])


def test_replay_refuses_unknown_unfinished_and_turnless_rollouts(http: httpx.Client) -> None:
    r = http.post("/v1/rollouts/r-doesnotexist/replay")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found")
    r = http.post("/v1/rollouts", json={"task": code_task("sleep 20")})
    (slow,) = r.json()["ids"]
    r = http.post(f"/v1/rollouts/{slow}/replay")
    assert (r.status_code, r.json()["error"]["type"]) == (409, "not_replayable"), r.text
    assert "not finished" in r.json()["error"]["message"]
    http.delete(f"/v1/rollouts/{slow}")
    r = http.post("/v1/rollouts", json={"task": {"kind": "sleep"}, "wait": True})
    (turnless,) = r.json()["rollouts"]
    r = http.post(f"/v1/rollouts/{turnless['id']}/replay")
    assert (r.status_code, r.json()["error"]["type"]) == (409, "not_replayable")
    assert "no LLM turns" in r.json()["error"]["message"]


def test_token_text_and_span_start_times(http: httpx.Client) -> None:
    traj = run(http, code_task(WRITES_AND_ECHOES))
    r = http.get(f"/v1/rollouts/{traj['id']}/tokens")
    assert r.status_code == 200, r.text
    pieces = r.json()["pieces"]
    assert len(pieces) == len(traj["token_ids"])
    text = "".join(pieces)
    assert "\ufffd" not in text and "héllo 日本" in text and "sh run.sh" in text
    assert "".join("".join(pieces[t["start"]:t["end"]]) for t in traj["turns"]).count("<tool_call>") == 2
    assert http.get("/v1/rollouts/r-doesnotexist/tokens").status_code == 404
    timing = traj["timing"]
    assert 0 <= timing["init_start_s"] <= timing["run_start_s"] <= timing["eval_start_s"]
    t0, t1 = traj["turns"]
    (call0,) = t0["tool_calls"]
    assert timing["run_start_s"] <= t0["start_s"] <= t0["start_s"] + t0["llm_s"] <= call0["start_s"]
    assert call0["start_s"] + call0["latency_s"] <= t1["start_s"] + 1e-3
    assert t1["start_s"] + t1["llm_s"] <= timing["eval_start_s"] + 1e-3
