"""The real thing: mini-swe-agent (from its wheel, unmodified) runs inside a bwrap sandbox
against the embedded SmolLM2 model through the rollout's own endpoint, on a code task; every
call's ids and logprobs in the trajectory equal what the model sampled.

The model is tiny, so the agent rarely solves the task: this checks the path and the
recording, not the policy. :class:`Recording` only wraps the real backend to keep what it
returned (it changes nothing)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from rolloutd.daemon.llm.base import Completion, SamplingParams
from rolloutd.daemon.llm.transformers import TransformersBackend
from rolloutd.daemon.trajectory import Status
from tests.tasks.conftest import Harness

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "mini"

pytestmark = [pytest.mark.slow]


class Recording:
    """Wraps the real embedded backend and keeps every (prompt, completion) it returned."""

    kind = "transformers"
    url = None

    def __init__(self, inner: TransformersBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.log: list[tuple[list[int], Completion]] = []

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                       max_tokens: int) -> Completion:
        c = await self.inner.complete(prompt_ids, params, max_tokens=max_tokens)
        self.log.append((list(prompt_ids), c))
        return c

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


def mini_agent(steps: int) -> dict[str, Any]:
    agent = json.loads((RECIPE / "agent.json").read_text())
    command = list(agent["command"])
    command[-1] = command[-1].replace(" -l 0 ", f" -l 0 -c agent.step_limit={steps} ")
    # the config comes with the task's files (a checkout under /tmp is hidden in the sandbox)
    env = {**agent["env"], "MSWEA_CONFIG_DIR": ".rolloutd-mini",
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    return {"command": command, "env": env, "timeout_s": 240}


async def test_mini_swe_agent_on_the_embedded_model_is_recorded_exactly(harness: Harness) -> None:
    inner = TransformersBackend(threads=2)
    await inner.load()
    backend = Recording(inner)
    harness._backend_id = harness.pool.add(backend, backend_id="embedded")
    task = {"kind": "code", "prompt": "Write solution.py with a function add(a, b) returning a + b.",
            "pytest": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n",
            "files": {".rolloutd-mini/mini.yaml": (RECIPE / "mini.yaml").read_text()},
            "memory_mb": 3072, "pids_max": 512, "timeout_s": 60, "agent": mini_agent(steps=3)}
    with trio.fail_after(500):
        t = await harness.run(task, timeout_s=400, max_tokens_per_turn=48, max_turns=3)
    assert t.harness is not None, t
    assert t.status is Status.completed, (t.error, t.harness.output_tail[-3000:])
    assert t.harness.ended == "exited", t.harness
    assert t.harness.calls == len(backend.log) >= 1, t.harness.output_tail[-3000:]
    assert t.reward is not None and "error" not in t.reward_info
    for turn, (prompt, c) in zip(t.turns, backend.log, strict=True):  # call by call
        seg = t.segments[turn.segment or 0]
        assert seg.token_ids[: turn.start] == prompt
        assert seg.token_ids[turn.start:turn.end] == c.token_ids
        assert seg.logprobs[turn.start:turn.end] == c.logprobs
        assert seg.loss_mask[turn.start:turn.end] == [1] * len(c.token_ids)
    # a reply mini-swe-agent rejects (format error) is dropped from its history: new segment
    assert len(t.segments) == t.harness.calls - t.harness.merged_calls
    assert sum(s.calls for s in t.segments) == t.harness.calls
