"""The demo's code path end to end, with scripted replies (a TEST DOUBLE) instead of the model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from rolloutd.daemon import demo

from .conftest import tool_call

pytestmark = pytest.mark.slow


def test_demo_runs_a_mixed_batch(tmp_path: Path):
    out = tmp_path / "trajectories.jsonl"
    buf = io.StringIO()
    policy = [tool_call("bash", command="ls"), "The answer is \\boxed{42}."]
    # demo.main runs its own trio loop (like `rolloutd demo`), so this test is synchronous
    rc = demo.main(out=out, policy=policy, console=Console(file=buf, width=140))
    text = buf.getvalue()
    assert rc == 0, text
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    n = len(demo.MATH_TASKS) + len(demo.CODE_TASKS) + 1
    assert len(lines) == n
    assert {t["status"] for t in lines} == {"completed"}
    by_id = {t["task_id"]: t for t in lines}
    # math gets one turn: the scripted tool call, which is no answer
    assert by_id["math-add"]["reward"] == 0.0 and by_id["math-add"]["reward_info"]["gold"] == "42"
    # code gets two: the tool call, then a text answer with no solution in it
    assert by_id["code-sum-two"]["reward_info"]["reason"] == "no_solution"
    swe = by_id[demo.SWE_INSTANCE]
    assert swe["reward_info"]["reason"] == "empty_patch"
    assert swe["turns"][0]["tool_calls"][0]["name"] == "bash"
    assert "results (seconds per stage)" in text and "scripted replies (TEST DOUBLE" in text
    for t in lines:
        assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) > 0
