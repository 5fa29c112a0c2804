"""verl, SkyRL and NeMo-Gym adapters against the real packages (the dev extra installs them;
the Makefile adds the three that pip cannot resolve here with --no-deps, and says why).

- verl 0.9.1: the loop is built as verl builds it (``hydra.utils.instantiate`` of its
  ``_target_``, with verl's config wrappers), ``run()`` returns verl's ``AgentLoopOutput``, and
  verl's own ``AgentLoopWorker`` post-processing pads each output and assembles the batch
  (``DataProto``) its trainer receives; verl's GRPO advantage is computed on that batch. The
  actor update itself needs verl's Ray/FSDP workers and a rollout server (GPU), not run here.
- SkyRL: skyrl-train 0.3.1 (the ``skyrl`` package, SkyRL >= 0.3, does not import on Python
  3.11: pydantic rejects its ``typing.TypedDict`` fields below 3.12). The generator is a real
  ``GeneratorInterface``; its output passes SkyRL's ``validate_generator_output``, the
  trainer's ``postprocess_generator_output`` (per-token rewards, metrics) and
  ``convert_prompts_responses_to_batch_tensors`` (the training batch), then SkyRL's GRPO
  advantage. The policy update needs SkyRL's Ray workers (GPU), not run here.
- NeMo-Gym 0.7.0: the ``/run`` request parses as ``BaseRunRequest``, the answer as
  ``BaseVerifyResponse`` (its ``response`` a ``NeMoGymResponse``) and passes NeMo-Gym's
  ``assert_prefix_contiguity``. NeMo-RL (which consumes the answer) is not installed: its
  stitching rule is re-implemented from ``_postprocess_nemo_gym_to_nemo_rl_result``.

The trajectories are real ones from a ``rolloutd serve`` child (conftest: scripted LLM test
double, real tokenizer and calculator tool).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import hydra
import numpy as np
import pytest
import torch
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.failure_kinds import is_namespaced
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.token_id_capture.builder import assert_prefix_contiguity
from omegaconf import OmegaConf
from skyrl_train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl_train.generators.base import (
    BatchMetadata,
    GeneratorInput,
    GeneratorInterface,
    GeneratorOutput,
    TrajectoryID,
)
from skyrl_train.trainer import RayPPOTrainer
from skyrl_train.utils.ppo_utils import compute_grpo_outcome_advantage as skyrl_grpo
from skyrl_train.utils.trainer_utils import validate_generator_output
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
)
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage as verl_grpo
from verl.utils.dataset.rl_dataset import RLHFDataset

from rolloutd.daemon.client import Client
from rolloutd.daemon.llm._embedded import load_tokenizer
from rolloutd.trainers.nemo_gym import RunApp
from rolloutd.trainers.skyrl import RolloutdGenerator
from rolloutd.trainers.verl import RolloutdAgentLoop

from .conftest import calc

FAIL = {"kind": "sleep", "fail_stage": "init"}  # fails every time: resubmitted, then masked


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = load_tokenizer()  # the daemon's tokenizer: the ids below are its ids
    if tok.pad_token_id is None:  # as verl's hf_tokenizer and SkyRL's get_tokenizer do
        tok.pad_token = tok.eos_token
    return tok


# -- verl ------------------------------------------------------------------------------------


# hydra-core 1.4 warns when instantiate() resolves a _target_ without an execution whitelist,
# as verl 0.9.1's AgentLoopWorker calls it (hydra 1.3, which verl expects, has no whitelist).
@pytest.mark.filterwarnings("ignore:hydra.utils.instantiate\\(\\) resolved _target_:UserWarning")
async def test_verl_agent_loop_through_verl_postprocessing(daemon_url, tokenizer):
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 96}},
                               "data": {}})
    # verl's AgentLoopBase.__init__ takes the running asyncio loop (verl runs loops on asyncio).
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        agent = hydra.utils.instantiate(  # as AgentLoopWorker._run_agent_loop builds a loop
            {"_target_": "rolloutd.trainers.verl.RolloutdAgentLoop", "rolloutd_url": daemon_url},
            trainer_config=DictConfigWrap(config=config), server_manager=None, tokenizer=tokenizer,
            processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data), tools=ToolListWrap([]))
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert isinstance(agent, RolloutdAgentLoop) and isinstance(agent, AgentLoopBase)

    # One GRPO group (uid "u"): a right answer, a wrong one, and a sample that stays unusable.
    tasks = [calc("4821 * 392"), calc("12 * 34"), FAIL]
    rows = [{"raw_prompt": [{"role": "user", "content": "?"}], "index": i, "global_steps": 1,
             "extra_info": {"rolloutd_task": task}} for i, task in enumerate(tasks)]
    outputs = [await agent.run({"temperature": 1.0, "top_p": 1.0}, **row) for row in rows]
    assert all(type(o) is AgentLoopOutput for o in outputs)
    good, wrong, masked = outputs
    assert (good.reward_score, wrong.reward_score, masked.reward_score) == (1.0, 0.0, 0.0)
    assert good.num_turns == 4 and good.metrics.tool_calls >= 0.0  # user, call, tool, answer
    assert len(good.response_ids) == len(good.response_mask) == len(good.response_logprobs) <= 96
    assert set(good.response_mask) == {0, 1} and set(masked.response_mask) == {0}
    assert good.extra_fields["usable"] and masked.extra_fields["usable"] is False
    with Client(daemon_url) as c:
        traj = c.get(good.extra_fields["rolloutd_id"])
    assert good.prompt_ids + good.response_ids == traj.token_ids[: len(good.prompt_ids) + len(good.response_ids)]

    # verl's per-sample post-processing (padding, masks, positions) and batch assembly.
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # its __init__ starts Ray actors and servers
    worker.rollout_config, worker.tokenizer, worker.processor = config.actor_rollout_ref.rollout, tokenizer, None
    worker.reward_loop_worker_handles, worker.mm_processor_kwargs, worker.distillation_enabled = None, {}, False
    padded = [await worker._agent_loop_postprocess(o, False, **row) for o, row in zip(outputs, rows)]
    batch = worker._postprocess(padded)
    assert isinstance(batch, DataProto) and len(batch) == 3
    b = batch.batch
    assert b["prompts"].shape == (3, 1024) and b["responses"].shape == (3, 96)
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == (3, 1120)
    n = len(good.prompt_ids) + len(good.response_ids)
    assert b["input_ids"][0][b["attention_mask"][0].bool()].tolist() == traj.token_ids[:n]
    assert b["response_mask"][0, : len(good.response_mask)].tolist() == good.response_mask
    assert b["response_mask"][2].sum() == 0 and b["rollout_log_probs"].shape == (3, 96)
    # rm_scores: the reward on each sample's last response token.
    last = b["attention_mask"][:, 1024:].sum(dim=1) - 1
    assert b["rm_scores"][torch.arange(3), last].tolist() == [1.0, 0.0, 0.0] and b["rm_scores"].sum() == 1.0
    assert list(batch.non_tensor_batch["segments_left_out"]) == [0, 0, 0]

    # verl's GRPO advantage on that batch: the right answer up, the others down, masked tokens 0.
    adv, _ = verl_grpo(b["rm_scores"], b["response_mask"], np.array(["u"] * 3, dtype=object))
    per_sample = [adv[i][b["response_mask"][i].bool()] for i in range(3)]
    assert (per_sample[0] > 0).all() and (per_sample[1] < 0).all() and per_sample[2].numel() == 0
    assert (adv[b["response_mask"] == 0] == 0).all()

    with pytest.raises(ValueError, match="rolloutd task"):
        await agent.run({}, index=9)


# -- SkyRL (skyrl-train) ---------------------------------------------------------------------

# Fields of the current SkyRL's GeneratorOutput (the `skyrl` package) that skyrl-train 0.3.1's
# TypedDict predates; the adapter fills them for the current trainer.
NEWER_SKYRL_FIELDS = {"trajectory_generation_times", "trajectory_time_splits"}


async def test_skyrl_generator_through_skyrl_training_input(daemon_url, tokenizer):
    gen = RolloutdGenerator(daemon_url, limits={"max_turns": 3})
    assert isinstance(gen, GeneratorInterface)
    tids = [TrajectoryID("a", 0), TrajectoryID("b", 0), TrajectoryID("a", 1), TrajectoryID("b", 1)]
    extras = [{"rolloutd_task": calc("4821 * 392")}, {"rolloutd_task": calc("12 * 34")}] * 2
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": "?"}]] * 4, "env_classes": ["calc"] * 4,
        "env_extras": extras, "sampling_params": {"temperature": 1.0}, "trajectory_ids": tids,
        "batch_metadata": BatchMetadata(global_step=3, training_phase="train"),
    }
    out: GeneratorOutput = await gen.generate(batch)
    assert set(GeneratorOutput.__annotations__) - {"is_last_step"} <= set(out)
    assert set(out) - set(GeneratorOutput.__annotations__) <= NEWER_SKYRL_FIELDS
    assert out["trajectory_ids"] == tids and out["rewards"] == [1.0, 0.0, 1.0, 0.0]  # input order
    assert out["stop_reasons"] == ["stop"] * 4
    assert all(isinstance(x, int) for row in out["prompt_token_ids"] + out["response_ids"] for x in row)
    assert all(isinstance(x, float) for row in out["rollout_logprobs"] for x in row)
    validate_generator_output(len(batch["prompts"]), out)  # SkyRL's own check

    # The trainer's post-processing (per-token rewards, pass@n) and training batch.
    uids = [t.instance_id for t in tids]
    cfg = OmegaConf.create({"generator": {"step_wise_trajectories": False, "n_samples_per_prompt": 2},
                            "trainer": {"algorithm": {"zero_variance_filter": False}}})
    trainer = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, all_metrics={})  # its __init__ needs Ray
    post = RayPPOTrainer.postprocess_generator_output(trainer, out, uids)
    assert [sum(r) for r in post["rewards"]] == [1.0, 0.0, 1.0, 0.0]
    assert trainer.all_metrics["reward/avg_pass_at_2"] == 0.5  # instance "a" solved, "b" not
    seqs, attention, response_mask, rewards, loss_mask, logprobs = convert_prompts_responses_to_batch_tensors(
        tokenizer, post["prompt_token_ids"], post["response_ids"], post["rewards"], post["loss_masks"],
        post["rollout_logprobs"])
    width = max(map(len, out["response_ids"]))
    assert loss_mask.shape == rewards.shape == logprobs.shape == response_mask.shape == (4, width)
    for i in range(4):  # the exact ids: prompt + response, under the attention mask
        assert seqs[i][attention[i].bool()].tolist() == out["prompt_token_ids"][i] + out["response_ids"][i]
        assert loss_mask[i, : len(out["loss_masks"][i])].tolist() == out["loss_masks"][i]
    # SkyRL's GRPO advantage: group "a" (both right) and "b" (both wrong) have no variance.
    adv, _ = skyrl_grpo(rewards, loss_mask, np.array(uids, dtype=object))
    assert torch.count_nonzero(adv) == 0
    mixed, _ = skyrl_grpo(rewards, loss_mask, np.array(["g"] * 4, dtype=object))
    assert (mixed[0][loss_mask[0].bool()] > 0).all() and (mixed[1][loss_mask[1].bool()] < 0).all()

    # An unusable sample keeps its row, masked; per-token rewards match the loss mask.
    per_token = await RolloutdGenerator(daemon_url, per_token_rewards=True).generate(
        {"prompts": ["?", "?"], "env_classes": None, "sampling_params": None, "batch_metadata": None,
         "env_extras": [{"rolloutd_task": calc()}, {"rolloutd_task": FAIL}], "trajectory_ids": None})
    validate_generator_output(2, per_token)
    assert set(per_token["loss_masks"][1]) == {0} and sum(per_token["rewards"][1]) == 0.0
    assert per_token["rollout_metrics"]["rolloutd/masked"] == 1


# -- NeMo-Gym --------------------------------------------------------------------------------


def nemo_rl_message_log(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NeMo-RL's stitching (not installed here; re-implemented from
    ``_postprocess_nemo_gym_to_nemo_rl_result``): each item with generation ids extends all
    ids seen before it."""
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


async def test_nemo_gym_run_contract(daemon_url):
    app = RunApp(daemon_url, limits={"max_turns": 3})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gym") as http:
        body = {"responses_create_params": {"input": [{"role": "user", "content": "4821 * 392?"}],
                                            "temperature": 1.0, "max_output_tokens": 64},
                **calc(), "_ng_rollout_id": "r1"}
        request = BaseRunRequest.model_validate(body)  # what NeMo-Gym's own agents accept
        assert request.capture_rollout_id == "r1" and request.responses_create_params.max_output_tokens == 64
        r = await http.post("/run", json=body)
        assert r.status_code == 200, r.text
        v = BaseVerifyResponse.model_validate(r.json())
        assert isinstance(v.response, NeMoGymResponse)
        assert v.reward == 1.0 and not v.mask_sample and v.response.status == "completed"
        assert v.response.metadata == {"rolloutd_segments": "1", "rolloutd_segments_left_out": "0"}
        assert [i.type for i in v.response.output] == ["function_call", "function_call_output", "message"]
        call, result, answer = v.response.output
        assert call.name == "calculator" and result.call_id == call.call_id
        assert result.output == "1889832" and answer.content[0].text.strip() == "1889832"
        raw = r.json()["response"]
        assert_prefix_contiguity(raw)  # NeMo-Gym's own rule for trainable token ids
        log = nemo_rl_message_log(raw["output"])
        assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
        with Client(daemon_url) as c:  # the stitched ids are the trajectory's, to the last sampled token
            traj = c.get(call.id.split("_")[1])
        assert [i for m in log for i in m["token_ids"]] == traj.token_ids[: traj.turns[-1].end]

        failed = await http.post("/run", json={"responses_create_params": {"input": "x"},
                                               "task": {"kind": "sleep", "fail_stage": "run"}})
        v = BaseVerifyResponse.model_validate(failed.json())
        assert v.mask_sample and v.reward == 0.0 and "run" in v.failure_reason
        assert is_namespaced(v.failure_kind) and v.failure_kind.startswith("rolloutd:")
        assert (await http.post("/run", json={"responses_create_params": {}})).status_code == 422
        assert (await http.get("/run")).status_code == 404
