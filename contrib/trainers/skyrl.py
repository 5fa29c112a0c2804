"""SkyRL: a ``GeneratorInterface`` whose ``generate()`` runs the batch on rolloutd.

    generator = RolloutdGenerator("http://127.0.0.1:8321", task_fn=my_task_fn)
    output = await generator.generate(input_batch)      # GeneratorOutput, in input order

``GeneratorInput`` (``skyrl/train/generators/base.py``) holds ``prompts``, ``env_classes``,
``env_extras``, ``sampling_params``, ``trajectory_ids`` (``TrajectoryID(instance_id,
repetition_id)``) and ``batch_metadata``. The rows of one ``instance_id`` become one rolloutd
group (one ``group_id``, one backend); the task of a row is ``task_fn(prompt, env_class,
env_extras)``, by default ``env_extras["rolloutd_task"]``. Unusable samples are resubmitted,
then masked (``loss_masks`` all 0, reward 0), so the output has exactly one row per input row.
``RolloutdGenerator`` subclasses SkyRL's ``GeneratorInterface`` where SkyRL is importable:
from ``skyrl.train.generators.base`` (the ``skyrl`` package, SkyRL >= 0.3), else from the
legacy ``skyrl_train.generators.base`` (``skyrl-train``), else a plain class. rolloutd's dev
environment (Python 3.11) has skyrl-train 0.3.1 (the ``skyrl`` package does not import below
Python 3.12); tests/trainers/test_adapters_real.py checks the output with its
``validate_generator_output`` and converts it to training tensors as its trainer does.
``GeneratorOutput`` fields:

===============================  ==================================================
``prompt_token_ids``             ``T.token_ids[:P]``
``response_ids``                 ``T.token_ids[P:]``
``loss_masks``                   ``T.loss_mask[P:]``
``rollout_logprobs``             ``T.logprobs[P:]``, null as 0.0
``rewards``                      ``T.reward`` (or per token, reward on the last sampled token)
``stop_reasons``                 the last turn's ``finish_reason``
``trajectory_ids``               echoed
``trajectory_generation_times``  ``T.timing.total_s``
``trajectory_time_splits``       ``{"llm": [T.timing.llm_s], "env": [T.timing.tool_s]}``
``rollout_metrics``              reward mean, resubmitted and masked counts, policy
                                 versions, ``rolloutd/segments`` and
                                 ``rolloutd/segments_left_out``
``is_last_step``                 step-wise mode only (below)
===============================  ==================================================

**Segments** (harness-driven rollouts whose harness rewrote its history). SkyRL's step-wise
training (``generator.step_wise_trajectories=true``) takes a variable number of rows per
trajectory, made for exactly this (context management that breaks the appending history):
rows of one trajectory are adjacent and share its ``trajectory_ids`` entry, ``is_last_step``
marks the last, and the advantage is computed on the last row and broadcast to the others.
With ``RolloutdGenerator(..., step_wise=True)`` (set it together with that flag) each
segment is a row (``T`` above is the segment, ``P`` its ``prompt_length``), each with the
rollout's reward, ``trajectory_ids`` entry, time and stop reason of its last call, so no
sampled token is lost; a built-in-loop rollout is one row with ``is_last_step`` true.
Without step-wise mode SkyRL requires exactly one row per input row, so a row is the
rollout's LAST segment and ``rollout_metrics["rolloutd/segments_left_out"]`` counts the
segments not trained on (``rolloutd/segments`` counts them all). Default: ``step_wise=False``
(as SkyRL's), with an output unchanged for built-in-loop rollouts but for the two metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.trainers._common import (
    GroupResult,
    arun_group,
    boundary,
    last_sequence,
    sequence_views,
    versions,
    zeros_for_null,
)

try:  # SkyRL >= 0.3: the `skyrl` package (Python >= 3.12)
    from skyrl.train.generators.base import GeneratorInterface  # type: ignore[import-not-found]
except ImportError:
    try:  # the legacy skyrl-train distribution (rolloutd's dev environment, Python 3.11)
        from skyrl_train.generators.base import GeneratorInterface  # type: ignore[import-not-found]
    except ImportError:  # no SkyRL: SkyRL only ever calls generate(), so a plain base will do
        GeneratorInterface = object

TaskFn = Callable[[Any, Any, Mapping[str, Any]], Mapping[str, Any]]


def default_task(prompt: Any, env_class: Any, env_extras: Mapping[str, Any]) -> dict[str, Any]:
    task = (env_extras or {}).get("rolloutd_task")
    if not isinstance(task, Mapping):
        raise ValueError("no rolloutd task: put it in env_extras['rolloutd_task'] or pass task_fn=")
    return dict(task)


def _instance(tid: Any, i: int) -> str:
    if tid is None:
        return f"row{i}"
    return str(getattr(tid, "instance_id", None) or (tid.get("instance_id") if isinstance(tid, Mapping) else tid))


def generator_output(rollouts: list[Trajectory], trajectory_ids: list[Any] | None, *,
                     per_token_rewards: bool = False, groups: Sequence[GroupResult] = (),
                     step_wise: bool = False) -> dict[str, Any]:
    """``GeneratorOutput`` for trajectories in input order (see the module table): one row
    per sequence in step-wise mode, else one row (the last sequence) per trajectory."""
    out: dict[str, Any] = {k: [] for k in ("prompt_token_ids", "response_ids", "loss_masks",
                                           "rollout_logprobs", "rewards", "stop_reasons")}
    trajs: list[Trajectory] = []  # the rows' views, in row order
    owner: list[int] = []  # the input row each output row belongs to
    is_last: list[bool] = []
    left_out = 0
    for i, rollout in enumerate(rollouts):
        if step_wise:
            views = sequence_views(rollout)
        else:
            view, n = last_sequence(rollout)
            views, left_out = [view], left_out + n
        trajs += views
        owner += [i] * len(views)
        is_last += [False] * (len(views) - 1) + [True]
    for t in trajs:
        p = boundary(t)
        response, mask = list(t.token_ids[p:]), list(t.loss_mask[p:])
        if not response:
            response, mask = [t.token_ids[-1] if t.token_ids else 0], [0]
        out["prompt_token_ids"].append(list(t.token_ids[:p]))
        out["response_ids"].append(response)
        out["loss_masks"].append(mask)
        out["rollout_logprobs"].append(zeros_for_null(t.logprobs[p:]) or [0.0] * len(response))
        reward = float(t.reward or 0.0)
        if per_token_rewards:
            last = max((i for i, m in enumerate(mask) if m), default=len(mask) - 1)
            out["rewards"].append([reward if i == last else 0.0 for i in range(len(mask))])
        else:
            out["rewards"].append(reward)
        out["stop_reasons"].append(t.turns[-1].finish_reason if t.turns else (t.finish_reason or "error"))
    rewards = [float(t.reward or 0.0) for t in rollouts]  # per trajectory, not per row
    lows = [v for v in (versions(t)[0] for t in trajs) if v is not None]
    out["trajectory_ids"] = [trajectory_ids[i] for i in owner] if trajectory_ids is not None else None
    if step_wise:
        out["is_last_step"] = is_last
    out["trajectory_generation_times"] = [t.timing.total_s for t in trajs]
    out["trajectory_time_splits"] = {"llm": [t.timing.llm_s for t in trajs], "env": [t.timing.tool_s for t in trajs]}
    out["rollout_metrics"] = {
        "rolloutd/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "rolloutd/resubmitted": sum(g.resubmitted for g in groups),
        "rolloutd/masked": sum(len(g.masked) for g in groups),
        "rolloutd/policy_version_min": min(lows) if lows else None,
        "rolloutd/segments": sum(max(1, len(t.segments)) for t in rollouts),
        "rolloutd/segments_left_out": left_out,
    }
    return out


class RolloutdGenerator(GeneratorInterface):  # type: ignore[misc,valid-type]
    """SkyRL ``GeneratorInterface`` over a rolloutd daemon (SkyRL's own class where SkyRL is
    importable; pass it where SkyRL expects a generator: SkyRL only calls ``generate``)."""

    def __init__(self, rolloutd_url: str, *, task_fn: TaskFn = default_task, max_resubmits: int = 2,
                 per_token_rewards: bool = False, step_wise: bool = False, **options: Any) -> None:
        self.url = rolloutd_url
        self.task_fn = task_fn
        self.max_resubmits = max_resubmits
        self.per_token_rewards = per_token_rewards
        self.step_wise = step_wise  # SkyRL's generator.step_wise_trajectories
        self.options = options

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        prompts = list(input_batch["prompts"])
        extras = list(input_batch.get("env_extras") or [{}] * len(prompts))
        classes = list(input_batch.get("env_classes") or [None] * len(prompts))
        tids = input_batch.get("trajectory_ids")
        sp = dict(input_batch.get("sampling_params") or {})
        sampling = {k: sp[k] for k in ("temperature", "top_p", "top_k") if sp.get(k) is not None}
        meta = input_batch.get("batch_metadata")
        step = getattr(meta, "global_step", None) if meta is not None else None
        rows: dict[str, list[int]] = {}
        for i in range(len(prompts)):
            rows.setdefault(_instance(tids[i] if tids else None, i), []).append(i)
        trajs: list[Trajectory | None] = [None] * len(prompts)
        groups: list[GroupResult] = []

        async def one(instance: str, idx: list[int], client: AsyncClient) -> None:
            first = idx[0]
            task = self.task_fn(prompts[first], classes[first], extras[first] or {})
            group = await arun_group(client, task, len(idx), group_id=f"skyrl-{step}-{instance}",
                                     max_resubmits=self.max_resubmits, sampling=sampling or None,
                                     **self.options)
            groups.append(group)
            for i, t in zip(idx, group.rollouts, strict=True):
                trajs[i] = t

        # anyio: SkyRL runs on asyncio; the groups run concurrently on either event loop.
        async with AsyncClient(self.url) as client, anyio.create_task_group() as tg:
            for instance, idx in rows.items():
                tg.start_soon(one, instance, idx, client)
        done = [t for t in trajs if t is not None]
        assert len(done) == len(prompts)
        return generator_output(done, list(tids) if tids is not None else None,
                                per_token_rewards=self.per_token_rewards, groups=groups,
                                step_wise=self.step_wise)
