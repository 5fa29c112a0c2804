"""TRL: a ``rollout_func`` for ``GRPOTrainer`` that gets its completions from rolloutd.

    from rolloutd.trainers.trl_adapter import make_rollout_func, env_reward

    rollout_func = make_rollout_func("http://127.0.0.1:8321", sampling={"temperature": 1.0},
                                     limits={"max_turns": 4, "max_tokens_per_turn": 256})
    trainer = GRPOTrainer(model=..., reward_funcs=env_reward, args=GRPOConfig(...),
                          train_dataset=ds, rollout_func=rollout_func)

The contract (TRL >= 1.0, ``trl/trainer/grpo_trainer.py``): ``rollout_func(prompts, trainer)``
gets the process's prompt slice, in which the ``RepeatSampler`` has already put each prompt
``num_generations`` times in a row, and must return one row per entry, in order. Each run of
identical prompts becomes one rolloutd group (``n`` = the run's length, one ``group_id``), so
its samples share a backend and form one GRPO group. Per row (``P`` = the prompt boundary):

=================  ===========================================================
``prompt_ids``     ``T.token_ids[:P]``
``completion_ids`` ``T.token_ids[P:]`` (turns and tool observations)
``logprobs``       ``T.logprobs[P:]``, null (observation tokens) as 0.0
``env_mask``       ``T.loss_mask[P:]``: TRL trains only where it is 1
``env_reward``     ``T.reward``: :func:`env_reward` is the reward function that returns it
extras             ``rolloutd_id``, ``usable``, ``num_turns``, ``policy_version_min``/``_max``,
                   ``segments``, ``segments_left_out``
=================  ===========================================================

**Segments** (harness-driven rollouts whose harness rewrote its history): TRL takes exactly
one completion per prompt entry (it scores ``inputs`` and reshapes rewards to
``(-1, num_generations)``), so a row is the rollout's LAST segment (``T`` above is that
segment, ``P`` its ``prompt_length``, the versions its calls'), and the row records
``segments`` (how many the rollout had) and ``segments_left_out`` (how many are not trained
on). A built-in-loop rollout has ``segments`` 1 and ``segments_left_out`` 0.

Do not pass ``tools=`` to the trainer: TRL's own tool loop would replace ``env_mask``. Unusable
samples are resubmitted, and masked (``env_mask`` all 0, reward 0) if they stay unusable, so
every group keeps its size. The dataset's ``prompt`` must say which task to run: by default a
rolloutd task dict or its JSON string (``task_fn`` maps other prompts). TRL does not sync
weights to rolloutd's backends by itself unless they are its ``trl vllm-serve``; otherwise
push weights after each step (``Client.reload_backend``) and bump the policy version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rolloutd.daemon.client import Client
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.trainers._common import (
    boundary,
    last_sequence,
    run_group,
    segment_info,
    task_from_prompt,
    versions,
    zeros_for_null,
)

ROW_KEYS = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "rolloutd_id",
            "usable", "num_turns", "policy_version_min", "policy_version_max", "segments",
            "segments_left_out")


def trl_row(rollout: Trajectory) -> dict[str, Any]:
    """One TRL row from one trajectory: its last sequence (see the module table)."""
    t, left_out = last_sequence(rollout)
    p = boundary(t)
    lo, hi = versions(t)
    completion = list(t.token_ids[p:])
    mask = list(t.loss_mask[p:])
    if not completion:  # a sample with no turn: one masked token so TRL can pad the row
        completion, mask = [t.token_ids[-1] if t.token_ids else 0], [0]
    return {
        "prompt_ids": list(t.token_ids[:p]),
        "completion_ids": completion,
        "logprobs": zeros_for_null(t.logprobs[p:]) or [0.0] * len(completion),
        "env_mask": mask,
        "env_reward": float(t.reward or 0.0),
        "rolloutd_id": t.id,
        "usable": t.usable,
        "num_turns": len(t.turns),
        "policy_version_min": lo,
        "policy_version_max": hi,
        **segment_info(rollout, left_out),
    }


def runs(prompts: list[Any], size: int) -> list[tuple[Any, int]]:
    """Consecutive identical prompts as (prompt, count) runs of at most ``size``."""
    out: list[tuple[Any, int]] = []
    for p in prompts:
        if out and out[-1][0] == p and out[-1][1] < size:
            out[-1] = (p, out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def make_rollout_func(
    client: Client | str,
    *,
    task_fn: Callable[[Any], Mapping[str, Any]] = task_from_prompt,
    max_resubmits: int = 2,
    **options: Any,
) -> Callable[[list[Any], Any], dict[str, list[Any]]]:
    """A ``rollout_func(prompts, trainer)``. ``options`` are rollout request fields
    (``sampling``, ``limits``, ``timeout_s``, ``labels``...). The trainer's
    ``state.global_step`` names each group (``trl-step<N>-<i>``)."""
    own = isinstance(client, str)
    http = Client(client) if isinstance(client, str) else client

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        training = getattr(getattr(trainer, "model", None), "training", True)
        size = int(getattr(trainer, "num_generations" if training else "num_generations_eval", 0)
                   or getattr(trainer.args, "num_generations", 1))
        step = getattr(getattr(trainer, "state", None), "global_step", 0)
        rows: dict[str, list[Any]] = {k: [] for k in ROW_KEYS}
        for i, (prompt, n) in enumerate(runs(list(prompts), size)):
            group = run_group(http, task_fn(prompt), n, group_id=f"trl-step{step}-{i}-{id(prompts):x}",
                              max_resubmits=max_resubmits, **options)
            for t in group.rollouts:
                for k, v in trl_row(t).items():
                    rows[k].append(v)
        return rows

    rollout_func.close = http.close if own else (lambda: None)  # type: ignore[attr-defined]
    return rollout_func


def env_reward(prompts: Any = None, completions: Any = None, env_reward: list[float] | None = None,
               **kwargs: Any) -> list[float]:
    """The reward function to pair with the rollout func: rolloutd's reward, as it is."""
    assert env_reward is not None, "env_reward is missing: is the rolloutd rollout_func in use?"
    return [float(r) for r in env_reward]
