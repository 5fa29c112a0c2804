"""SkyRL ``Generator`` adapter, by shape: a shape test, not a test against the package.

The current SkyRL (the ``skyrl`` package, 0.3.0/0.4.0, whose ``skyrl/train/generators/base.py``
the adapter follows) does not install here: 0.4.0 requires Python >= 3.12, and 0.3.0 (which
declares >= 3.11) fails at import on 3.11, in ``skyrl/tinker/types.py``: pydantic's "Please use
`typing_extensions.TypedDict` instead of `typing.TypedDict` on Python < 3.12". So its
``GeneratorOutput`` field names are copied here (as recorded in shared/research/trainers.md).
The legacy skyrl-train 0.3.1 does import, and tests/trainers/test_adapters_real.py checks the
adapter with its real classes and functions, as it does verl and NeMo-Gym (whose shape tests
were here). The trajectories are real ones from a ``rolloutd serve`` child (scripted LLM test
double, real tokenizer and calculator tool).
"""

from __future__ import annotations

from rolloutd.trainers.skyrl import RolloutdGenerator

from .conftest import calc

SKYRL_OUTPUT_FIELDS = {  # skyrl/train/generators/base.py GeneratorOutput (skyrl 0.4.0)
    "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
    "rollout_logprobs", "trajectory_ids", "trajectory_generation_times", "trajectory_time_splits",
    "rollout_expert_indices", "rollout_sample_support", "is_last_step", "env_metrics",
    "pixel_values", "image_grid_thw",
}
SKYRL_REQUIRED = {"prompt_token_ids", "response_ids", "rewards", "loss_masks"}


async def test_skyrl_generator_output(daemon_url):
    class TID:
        def __init__(self, instance_id: str, repetition_id: int) -> None:
            self.instance_id, self.repetition_id = instance_id, repetition_id

    tids = [TID("a", 0), TID("b", 0)]
    extras = [{"rolloutd_task": calc("4821 * 392")}, {"rolloutd_task": calc("12 * 34")}]
    gen = RolloutdGenerator(daemon_url, limits={"max_turns": 3})
    out = await gen.generate({"prompts": [[{"role": "user", "content": "?"}]] * 2, "env_classes": ["calc"] * 2,
                              "env_extras": extras, "sampling_params": {"temperature": 1.0},
                              "trajectory_ids": tids, "batch_metadata": None})
    assert set(out) <= SKYRL_OUTPUT_FIELDS and SKYRL_REQUIRED <= set(out)
    assert out["rewards"] == [1.0, 0.0]  # input order
    assert out["trajectory_ids"] == tids
    for ids, mask, lps in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"]):
        assert len(ids) == len(mask) == len(lps) and set(mask) == {0, 1}
    assert out["stop_reasons"] == ["stop"] * 2
    assert len(out["trajectory_time_splits"]["llm"]) == len(out["trajectory_generation_times"]) == 2
    per_token = await RolloutdGenerator(daemon_url, per_token_rewards=True).generate(
        {"prompts": ["?"], "env_extras": [{"rolloutd_task": calc()}], "trajectory_ids": None})
    (rewards,), (mask,) = per_token["rewards"], per_token["loss_masks"]
    assert len(rewards) == len(mask) and sum(rewards) == 1.0
    assert rewards.index(1.0) == max(i for i, m in enumerate(mask) if m)
