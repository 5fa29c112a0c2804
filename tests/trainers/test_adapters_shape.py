"""NeMo-Gym ``/run``, verl ``AgentLoop`` and SkyRL ``Generator`` adapters, by shape.

None of the three projects installs here, so each output is checked against a copy of the
project's published structure (field names and types from their sources, as recorded in
shared/research/trainers.md), and NeMo-RL's contiguity rule is re-implemented from its
``_postprocess_nemo_gym_to_nemo_rl_result``. The trajectories are real ones from a
``rolloutd serve`` child (scripted LLM test double, real tokenizer and calculator tool).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from rolloutd.daemon.client import Client
from rolloutd.trainers.nemo_gym import RunApp
from rolloutd.trainers.skyrl import RolloutdGenerator
from rolloutd.trainers.verl import RolloutdAgentLoop

from .conftest import calc

# -- published structures -------------------------------------------------------------------


class AgentLoopMetrics(BaseModel):  # verl/experimental/agent_loop/agent_loop.py
    model_config = ConfigDict(extra="forbid")
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):  # verl/experimental/agent_loop/agent_loop.py
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}


SKYRL_OUTPUT_FIELDS = {  # skyrl/train/generators/base.py GeneratorOutput
    "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
    "rollout_logprobs", "trajectory_ids", "trajectory_generation_times", "trajectory_time_splits",
    "rollout_expert_indices", "is_last_step", "env_metrics", "pixel_values", "image_grid_thw",
}
SKYRL_REQUIRED = {"prompt_token_ids", "response_ids", "rewards", "loss_masks"}


class VerifyResponse(BaseModel):  # nemo_gym/base_resources_server.py BaseVerifyResponse
    model_config = ConfigDict(extra="forbid")
    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    reward: float
    mask_sample: bool = False
    failure_kind: str | None = None
    failure_reason: str | None = None


def nemo_rl_message_log(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NeMo-RL's post-processing: items with generation ids, each extending all seen ids."""
    seen: list[int] = []
    log: list[dict[str, Any]] = []
    for item in output:
        gen = item.get("generation_token_ids") or []
        if not gen:
            continue
        prompt = item["prompt_token_ids"]
        assert prompt[: len(seen)] == seen, "Non-contiguous messages found!"
        log.append({"role": "user", "token_ids": prompt[len(seen):]})
        log.append({"role": "assistant", "token_ids": gen, "generation_logprobs": item["generation_log_probs"]})
        assert len(gen) == len(item["generation_log_probs"])
        seen = prompt + gen
    return log


# -- tests -----------------------------------------------------------------------------------


async def test_nemo_gym_run_route(daemon_url):
    app = RunApp(daemon_url, limits={"max_turns": 3})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gym") as http:
        body = {"responses_create_params": {"input": [{"role": "user", "content": "4821 * 392?"}],
                                            "temperature": 1.0, "max_output_tokens": 64},
                **calc(), "_ng_rollout_id": "r1"}
        r = await http.post("/run", json=body)
        assert r.status_code == 200, r.text
        v = VerifyResponse.model_validate(r.json())
        assert v.reward == 1.0 and not v.mask_sample and v.response["status"] == "completed"
        types = [i["type"] for i in v.response["output"]]
        assert types == ["function_call", "function_call_output", "message"]
        call, result, answer = v.response["output"]
        assert call["name"] == "calculator" and result["call_id"] == call["call_id"]
        assert result["output"] == "1889832" and answer["content"][0]["text"].strip() == "1889832"
        log = nemo_rl_message_log(v.response["output"])
        assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
        # The stitched ids are exactly the trajectory's, up to the last sampled token.
        with Client(daemon_url) as c:
            traj = c.get(call["id"].split("_")[1])
        stitched = [i for m in log for i in m["token_ids"]]
        assert stitched == traj.token_ids[: traj.turns[-1].end]

        failed = await http.post("/run", json={"responses_create_params": {},
                                               "task": {"kind": "sleep", "fail_stage": "run"}})
        v = VerifyResponse.model_validate(failed.json())
        assert v.mask_sample and v.reward == 0.0 and v.failure_kind and "run" in v.failure_reason
        assert (await http.post("/run", json={"responses_create_params": {}})).status_code == 422
        assert (await http.get("/run")).status_code == 404


async def test_verl_agent_loop_output(daemon_url):
    loop = RolloutdAgentLoop(rolloutd_url=daemon_url)
    out = await loop.run({"temperature": 1.0, "top_p": 1.0, "logprobs": True},
                         index=3, global_steps=7, raw_prompt=[], extra_info={"rolloutd_task": calc()})
    parsed = AgentLoopOutput.model_validate(out)
    assert parsed.reward_score == 1.0 and parsed.num_turns == 4  # user, call, tool, answer
    assert len(parsed.response_ids) == len(parsed.response_mask) == len(parsed.response_logprobs)
    assert parsed.extra_fields["param_version_start"] == 0 and parsed.extra_fields["usable"]
    assert set(parsed.response_mask) == {0, 1}
    # Cut to rollout.response_length, all three the same way.
    loop.config = type("C", (), {"actor_rollout_ref": type("A", (), {"rollout": type("R", (), {"response_length": 5})})})()
    cut = AgentLoopOutput.model_validate(await loop.run({}, index=4, extra_info={"rolloutd_task": calc()}))
    assert len(cut.response_ids) == len(cut.response_mask) == len(cut.response_logprobs) == 5
    # An unusable sample keeps its row, fully masked.
    masked = AgentLoopOutput.model_validate(
        await loop.run({}, index=5, extra_info={"rolloutd_task": {"kind": "sleep", "fail_stage": "init"}}))
    assert set(masked.response_mask) == {0} and masked.reward_score == 0.0
    assert masked.extra_fields["usable"] is False
    with pytest.raises(ValueError, match="rolloutd task"):
        await loop.run({}, index=6)


async def test_skyrl_generator_output(daemon_url):
    class TID:
        def __init__(self, instance_id: str, repetition_id: int) -> None:
            self.instance_id, self.repetition_id = instance_id, repetition_id

    tids = [TID("a", 0), TID("b", 0), TID("a", 1), TID("b", 1)]
    extras = [{"rolloutd_task": calc("4821 * 392")}, {"rolloutd_task": calc("12 * 34")}] * 2
    gen = RolloutdGenerator(daemon_url, limits={"max_turns": 3})
    out = await gen.generate({"prompts": [[{"role": "user", "content": "?"}]] * 4, "env_classes": ["calc"] * 4,
                              "env_extras": extras, "sampling_params": {"temperature": 1.0},
                              "trajectory_ids": tids, "batch_metadata": None})
    assert set(out) <= SKYRL_OUTPUT_FIELDS and SKYRL_REQUIRED <= set(out)
    assert out["rewards"] == [1.0, 0.0, 1.0, 0.0]  # input order, group by instance
    assert out["trajectory_ids"] == tids
    for ids, mask, lps in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"]):
        assert len(ids) == len(mask) == len(lps) and set(mask) == {0, 1}
    assert out["stop_reasons"] == ["stop"] * 4
    assert len(out["trajectory_time_splits"]["llm"]) == 4
    per_token = await RolloutdGenerator(daemon_url, per_token_rewards=True).generate(
        {"prompts": ["?"], "env_extras": [{"rolloutd_task": calc()}], "trajectory_ids": None})
    (rewards,), (mask,) = per_token["rewards"], per_token["loss_masks"]
    assert len(rewards) == len(mask) and sum(rewards) == 1.0
    assert rewards.index(1.0) == max(i for i, m in enumerate(mask) if m)
