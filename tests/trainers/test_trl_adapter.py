"""The TRL adapter: rows from real rolloutd trajectories, whole groups, and a real
``trl.GRPOTrainer`` taking a training step on the tiny model (CPU) with them."""

from __future__ import annotations

import json

import pytest

from rolloutd.daemon.client import Client
from rolloutd.trainers._common import run_group
from rolloutd.trainers.trl_adapter import env_reward, make_rollout_func, runs, trl_row

from .conftest import calc


def test_runs_split_repeated_prompts():
    assert runs(["a", "a", "b", "b", "b", "a"], 2) == [("a", 2), ("b", 2), ("b", 1), ("a", 1)]


def test_rows_map_the_trajectory_exactly(daemon_url):
    with Client(daemon_url) as c:
        group = run_group(c, calc(), 2)
    t = group.rollouts[0]
    row = trl_row(t)
    p = t.turns[0].start
    assert row["prompt_ids"] + row["completion_ids"] == t.token_ids
    assert len(row["prompt_ids"]) == p and row["env_mask"] == t.loss_mask[p:]
    assert len(row["logprobs"]) == len(row["completion_ids"])
    assert all(lp == 0.0 for lp, m in zip(row["logprobs"], row["env_mask"]) if m == 0)
    assert [lp for lp, m in zip(row["logprobs"], row["env_mask"]) if m] == [x for x in t.logprobs[p:] if x is not None]
    assert row["env_reward"] == 1.0 and row["num_turns"] == 2 and row["usable"]
    assert (row["policy_version_min"], row["policy_version_max"]) == (0, 0)


def test_unusable_samples_are_resubmitted_then_masked_never_dropped(daemon_url):
    with Client(daemon_url) as c:
        # The labelled sleep task fails in INIT every time: resubmitted, then masked.
        group = run_group(c, {"kind": "sleep", "fail_stage": "init"}, 3, max_resubmits=1)
    assert len(group.rollouts) == 3 and group.resubmitted == 3 and group.masked == [0, 1, 2]
    for t in group.rollouts:
        row = trl_row(t)
        assert set(row["env_mask"]) == {0} and row["env_reward"] == 0.0 and not row["usable"]
        assert len(row["completion_ids"]) == len(row["logprobs"]) == len(row["env_mask"]) >= 1


@pytest.mark.slow
@pytest.mark.model
def test_grpo_trainer_accepts_the_rows_and_trains(daemon_url, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rolloutd.daemon.llm import _embedded

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    _embedded.load_tokenizer()  # converts and caches on a fresh machine
    _embedded.load_model()
    model = AutoModelForCausalLM.from_pretrained(str(_embedded.cache_dir() / "model"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(_embedded.cache_dir() / "tokenizer"))
    # Two prompts: the scripted policy answers 1889832, right for one and wrong for the other.
    ds = datasets.Dataset.from_list([{"prompt": json.dumps(calc("4821 * 392"))},
                                     {"prompt": json.dumps(calc("12 * 34"))}])
    seen: list[dict] = []

    def reward(prompts=None, completions=None, **kw):
        # rolloutd's reward, plus 0.1 on every other row: the scripted policy answers the same
        # within a group, and a group needs reward variance for a nonzero GRPO gradient.
        seen.append(kw)
        return [r + 0.1 * (i % 2) for i, r in enumerate(env_reward(prompts, completions, **kw))]

    with Client(daemon_url) as client:
        rollout_func = make_rollout_func(client, limits={"max_turns": 3, "max_tokens_per_turn": 64})
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
            max_steps=1, learning_rate=1e-5, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", bf16=False, max_completion_length=128, seed=0,
            dataloader_num_workers=0, beta=0.0,
        )
        trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args,
                                  train_dataset=ds, rollout_func=rollout_func)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.train()
    assert trainer.state.global_step == 1
    assert seen and all(len(kw["env_reward"]) == len(kw["rolloutd_id"]) == 4 for kw in seen)
    assert sorted(seen[0]["env_reward"]) == [0.0, 0.0, 1.0, 1.0]
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert logged and logged[0]["reward"] == pytest.approx(0.55)
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed, "the trainer took no optimizer step on the rolloutd rows"
