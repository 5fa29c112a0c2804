"""Harness-driven rollouts with several segments, through every trainer adapter.

The rule (``rolloutd.trainers._common``): one row per segment where the trainer takes a
variable number of rows per rollout (SkyRL in step-wise mode), else the LAST segment with the
count left out recorded; a built-in-loop rollout is unchanged. The trajectories here are
HAND-BUILT data (token ids, masks and logprobs written out below, not from a model), so each
row can be checked against exact lists.
"""

from __future__ import annotations

from nemo_gym.base_resources_server import BaseVerifyResponse
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from rolloutd.daemon.trajectory import Segment, Status, Trajectory, Turn
from rolloutd.trainers._common import (
    boundary,
    last_sequence,
    masked,
    segment_view,
    sequence_views,
)
from rolloutd.trainers.nemo_gym import verify_response
from rolloutd.trainers.skyrl import generator_output
from rolloutd.trainers.trl_adapter import ROW_KEYS, trl_row
from rolloutd.trainers.verl import agent_loop_output

from .test_adapters_real import nemo_rl_message_log

# Hand-built data: segment 0 is a prompt [1, 2, 3], a call sampling [10, 11], a tool result
# [4, 5] and a call sampling [12]; then the harness summarised its history, so segment 1 is a
# new prompt [1, 2, 6] and one call sampling [13, 14, 15]. The top level repeats segment 1.
SEG0 = Segment(token_ids=[1, 2, 3, 10, 11, 4, 5, 12], loss_mask=[0, 0, 0, 1, 1, 0, 0, 1],
               logprobs=[None, None, None, -0.1, -0.2, None, None, -0.3], prompt_length=3, calls=2)
SEG1 = Segment(token_ids=[1, 2, 6, 13, 14, 15], loss_mask=[0, 0, 0, 1, 1, 1],
               logprobs=[None, None, None, -0.4, -0.5, -0.6], prompt_length=3, calls=1)


def two_segments(reward: float = 1.0) -> Trajectory:
    return Trajectory(
        id="r-seg", group_id="g-seg", status=Status.completed, usable=True, reward=reward,
        token_ids=list(SEG1.token_ids), loss_mask=list(SEG1.loss_mask), logprobs=list(SEG1.logprobs),
        prompt_length=3, segments=[SEG0, SEG1],
        turns=[Turn(start=3, end=5, segment=0, merged=False, policy_version_start=1, policy_version_end=1,
                    finish_reason="tool_calls"),
               Turn(start=7, end=8, segment=0, merged=True, policy_version_start=1, policy_version_end=2,
                    finish_reason="stop"),
               Turn(start=3, end=6, segment=1, merged=False, policy_version_start=3, policy_version_end=3,
                    finish_reason="stop")],
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "summary"}, {"role": "assistant", "content": "final"}],
    )


def builtin() -> Trajectory:
    # Hand-built data: a built-in agent loop's rollout (no segments), prompt [1, 2, 3], then
    # a call [10, 11], a tool result [4] and a call [12].
    return Trajectory(
        id="r-loop", group_id="g-loop", status=Status.completed, usable=True, reward=0.5,
        token_ids=[1, 2, 3, 10, 11, 4, 12], loss_mask=[0, 0, 0, 1, 1, 0, 1],
        logprobs=[None, None, None, -0.1, -0.2, None, -0.3], prompt_length=3,
        turns=[Turn(start=3, end=5, finish_reason="tool_calls"), Turn(start=6, end=7, finish_reason="stop")],
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "tool", "content": "4"}, {"role": "assistant", "content": "b"}],
    )


def test_views_split_each_segment_at_its_prompt_length():
    t = two_segments()
    views = sequence_views(t)
    assert [v.token_ids for v in views] == [SEG0.token_ids, SEG1.token_ids]
    assert [v.loss_mask for v in views] == [SEG0.loss_mask, SEG1.loss_mask]
    assert [v.logprobs for v in views] == [SEG0.logprobs, SEG1.logprobs]
    assert [boundary(v) for v in views] == [3, 3]
    assert [[(x.start, x.end) for x in v.turns] for v in views] == [[(3, 5), (7, 8)], [(3, 6)]]
    assert all(v.reward == 1.0 and v.group_id == "g-seg" and v.id == "r-seg" for v in views)
    last, left_out = last_sequence(t)
    assert last.token_ids == SEG1.token_ids and left_out == 1
    assert segment_view(t, 0).segments == [SEG0]
    # A built-in loop's rollout is its own single view, the very object.
    b = builtin()
    assert sequence_views(b) == [b] and last_sequence(b) == (b, 0) and boundary(b) == 3


def test_skyrl_step_wise_gives_one_row_per_segment():
    out = generator_output([two_segments(), builtin()], ["tid-a", "tid-b"], step_wise=True)
    assert out["prompt_token_ids"] == [[1, 2, 3], [1, 2, 6], [1, 2, 3]]
    assert out["response_ids"] == [[10, 11, 4, 5, 12], [13, 14, 15], [10, 11, 4, 12]]
    assert out["loss_masks"] == [[1, 1, 0, 0, 1], [1, 1, 1], [1, 1, 0, 1]]
    assert out["rollout_logprobs"] == [[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4, -0.5, -0.6], [-0.1, -0.2, 0.0, -0.3]]
    assert out["rewards"] == [1.0, 1.0, 0.5]  # each segment carries its rollout's reward
    assert out["trajectory_ids"] == ["tid-a", "tid-a", "tid-b"]  # adjacent rows, one trajectory
    assert out["is_last_step"] == [False, True, True]
    assert out["stop_reasons"] == ["stop", "stop", "stop"]
    assert len(out["trajectory_generation_times"]) == len(out["trajectory_time_splits"]["llm"]) == 3
    m = out["rollout_metrics"]
    assert m["rolloutd/segments"] == 3 and m["rolloutd/segments_left_out"] == 0
    assert m["rolloutd/reward_mean"] == 0.75  # per trajectory, not per row
    assert m["rolloutd/policy_version_min"] == 0  # the built-in rollout's turns say 0
    per_token = generator_output([two_segments()], ["tid-a"], step_wise=True, per_token_rewards=True)
    assert per_token["rewards"] == [[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]


def test_skyrl_without_step_wise_trains_on_the_last_segment_and_counts_the_rest():
    out = generator_output([two_segments(), builtin()], ["tid-a", "tid-b"])
    assert "is_last_step" not in out
    assert out["prompt_token_ids"] == [[1, 2, 6], [1, 2, 3]]
    assert out["response_ids"] == [[13, 14, 15], [10, 11, 4, 12]]
    assert out["loss_masks"] == [[1, 1, 1], [1, 1, 0, 1]]
    assert out["rollout_logprobs"] == [[-0.4, -0.5, -0.6], [-0.1, -0.2, 0.0, -0.3]]
    assert out["rewards"] == [1.0, 0.5] and out["trajectory_ids"] == ["tid-a", "tid-b"]
    m = out["rollout_metrics"]
    assert m["rolloutd/segments"] == 3 and m["rolloutd/segments_left_out"] == 1


def test_trl_row_is_the_last_segment_with_the_count_left_out():
    row = trl_row(two_segments())
    assert set(row) == set(ROW_KEYS)
    assert row["prompt_ids"] == [1, 2, 6] and row["completion_ids"] == [13, 14, 15]
    assert row["env_mask"] == [1, 1, 1] and row["logprobs"] == [-0.4, -0.5, -0.6]
    assert row["env_reward"] == 1.0 and row["num_turns"] == 1
    assert (row["policy_version_min"], row["policy_version_max"]) == (3, 3)  # that segment's calls
    assert (row["segments"], row["segments_left_out"]) == (2, 1)


def test_verl_output_is_the_last_segment_with_the_count_left_out():
    out = AgentLoopOutput.model_validate(agent_loop_output(two_segments()))  # verl's own model
    assert out.prompt_ids == [1, 2, 6] and out.response_ids == [13, 14, 15]
    assert out.response_mask == [1, 1, 1] and out.response_logprobs == [-0.4, -0.5, -0.6]
    assert out.reward_score == 1.0
    assert (out.extra_fields["param_version_start"], out.extra_fields["param_version_end"]) == (3, 3)
    assert (out.extra_fields["segments"], out.extra_fields["segments_left_out"]) == (2, 1)
    cut = agent_loop_output(two_segments(), response_length=2)
    assert cut["response_ids"] == [13, 14] and cut["response_logprobs"] == [-0.4, -0.5]


def test_nemo_gym_answer_is_the_last_segment_with_the_count_left_out():
    body = verify_response(two_segments(), {"input": "go"})
    v = BaseVerifyResponse.model_validate(body)  # NeMo-Gym's own model
    assert v.reward == 1.0 and not v.mask_sample
    (item,) = body["response"]["output"]  # the last segment's one call, matched to the last message
    assert item["type"] == "message" and item["content"][0]["text"] == "final"
    assert item["prompt_token_ids"] == [1, 2, 6] and item["generation_token_ids"] == [13, 14, 15]
    assert item["generation_log_probs"] == [-0.4, -0.5, -0.6]
    log = nemo_rl_message_log(body["response"]["output"])  # NeMo-RL's contiguity rule holds
    assert [i for m in log for i in m["token_ids"]] == SEG1.token_ids
    assert v.response.metadata == {"rolloutd_segments": "2", "rolloutd_segments_left_out": "1"}
    assert v.response.usage.input_tokens == 3 and v.response.usage.output_tokens == 3


def test_builtin_rollout_is_unchanged():
    b = builtin()
    row = trl_row(b)
    assert row["prompt_ids"] == [1, 2, 3] and row["completion_ids"] == [10, 11, 4, 12]
    assert row["env_mask"] == [1, 1, 0, 1] and row["logprobs"] == [-0.1, -0.2, 0.0, -0.3]
    assert row["num_turns"] == 2 and (row["segments"], row["segments_left_out"]) == (1, 0)
    verl = agent_loop_output(b)
    assert verl["prompt_ids"] == [1, 2, 3] and verl["response_ids"] == [10, 11, 4, 12]
    assert (verl["extra_fields"]["segments"], verl["extra_fields"]["segments_left_out"]) == (1, 0)
    sky = generator_output([b], None)
    assert sky["response_ids"] == [[10, 11, 4, 12]] and "is_last_step" not in sky
    assert sky["trajectory_ids"] is None
    v = verify_response(b, {})
    assert [i["type"] for i in v["response"]["output"]] == ["message", "function_call_output", "message"]
    assert v["response"]["metadata"] == {"rolloutd_segments": "1", "rolloutd_segments_left_out": "0"}
    # A one-segment harness rollout gives the same single row as its top level.
    one = two_segments().model_copy(update={"segments": [SEG1], "turns": [two_segments().turns[2].model_copy(update={"segment": 0})]})
    assert trl_row(one)["completion_ids"] == [13, 14, 15] and trl_row(one)["segments_left_out"] == 0


def test_masked_rollout_masks_every_segment():
    m = masked(two_segments())
    assert [set(s.loss_mask) for s in m.segments] == [{0}, {0}]
    assert all(lp is None for s in m.segments for lp in s.logprobs)
    out = generator_output([m], ["tid-a"], step_wise=True)
    assert [set(x) for x in out["loss_masks"]] == [{0}, {0}] and out["rewards"] == [0.0, 0.0]
    row = trl_row(m)
    assert set(row["env_mask"]) == {0} and row["env_reward"] == 0.0 and not row["usable"]
