"""verl: an ``AgentLoop`` whose ``run()`` is a rolloutd rollout.

Register it in the YAML named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path``::

    - name: rolloutd_agent
      _target_: rolloutd.trainers.verl.RolloutdAgentLoop

and select it with ``default_agent_loop: rolloutd_agent`` (or a per-row ``agent_name``).
Set ``ROLLOUTD_URL`` for the loop. verl creates one loop per sample and calls
``await loop.run(sampling_params, **row)``; the row's ``extra_info`` (or ``tools_kwargs``)
must hold the rolloutd task under ``rolloutd_task``, or override :meth:`task`. The samples of
one prompt share a rolloutd ``group_id`` (global step and row ``index``), so they share a
backend. ``run()`` returns verl's ``AgentLoopOutput`` (``verl/experimental/agent_loop``), or
the same fields as a dict when verl is not importable. rolloutd's dev environment installs
verl 0.9.1 (``--no-deps``, see the Makefile), and tests/trainers/test_adapters_real.py builds
the loop as verl does (``hydra.utils.instantiate`` of the ``_target_`` below) and runs verl's
own per-sample post-processing and batch assembly on its outputs:

=====================  ===========================================================
``prompt_ids``         ``T.token_ids[:P]``
``response_ids``       ``T.token_ids[P:]``, cut to ``rollout.response_length``
``response_mask``      ``T.loss_mask[P:]``, same cut
``response_logprobs``  ``T.logprobs[P:]``, null as 0.0, same cut
``reward_score``       ``T.reward`` (verl puts it on the last response token)
``num_turns``          user + assistant + tool messages
``metrics``            ``generate_sequences = T.timing.llm_s``, ``tool_calls = T.timing.tool_s``
``extra_fields``       ``rolloutd_id``, ``usable``, ``reward_info``, ``param_version_start``/``_end``,
                       ``segments``, ``segments_left_out``
=====================  ===========================================================

**Segments** (harness-driven rollouts whose harness rewrote its history): verl's agent loop
returns exactly one ``AgentLoopOutput`` per sample (``run()`` is awaited once per sample and
the outputs are stacked into one batch row each), so the output is the rollout's LAST segment
(``T`` above is that segment, ``P`` its ``prompt_length``, the param versions its calls').
``extra_fields`` records ``segments`` (how many the rollout had) and ``segments_left_out``
(how many are not trained on); every sample carries both keys (1 and 0 for a built-in-loop
rollout), as verl stacks ``extra_fields`` key by key.

An unusable sample is resubmitted; if it stays unusable its ``response_mask`` is all 0
(verl cannot drop one sample of a group).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.trainers._common import (
    arun_group,
    boundary,
    last_sequence,
    segment_info,
    versions,
    zeros_for_null,
)

try:  # verl's own classes where verl is installed (rolloutd's dev environment has it)
    from verl.experimental.agent_loop.agent_loop import (  # type: ignore[import-not-found]
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
    )
except ImportError:  # the same interface, so the module imports (and is tested) without verl
    AgentLoopOutput = None
    AgentLoopMetrics = None

    class AgentLoopBase:  # type: ignore[no-redef]
        def __init__(self, trainer_config: Any = None, server_manager: Any = None, tokenizer: Any = None,
                     processor: Any = None, **kwargs: Any) -> None:
            self.config = trainer_config
            self.server_manager = server_manager
            self.tokenizer = tokenizer
            self.processor = processor


def agent_loop_output(rollout: Trajectory, *, response_length: int | None = None) -> dict[str, Any]:
    """The ``AgentLoopOutput`` fields for one trajectory: its last sequence (see the module table)."""
    t, left_out = last_sequence(rollout)
    p = boundary(t)
    cut = slice(p, p + response_length if response_length is not None else None)
    lo, hi = versions(t)
    response = list(t.token_ids[cut])
    mask = list(t.loss_mask[cut])
    if not response:  # no turn at all: one masked token, so verl can pad the row
        response, mask = [t.token_ids[-1] if t.token_ids else 0], [0]
    return {
        "prompt_ids": list(t.token_ids[:p]),
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": zeros_for_null(t.logprobs[cut]) or [0.0] * len(response),
        "reward_score": float(t.reward or 0.0),
        "num_turns": sum(1 for m in t.messages if m.get("role") in ("user", "assistant", "tool")),
        "metrics": {"generate_sequences": t.timing.llm_s, "tool_calls": t.timing.tool_s, "num_preempted": 0},
        "extra_fields": {"rolloutd_id": t.id, "usable": t.usable, "reward_info": dict(t.reward_info),
                         "param_version_start": lo, "param_version_end": hi,
                         **segment_info(rollout, left_out)},
    }


class RolloutdAgentLoop(AgentLoopBase):
    """One verl sample = one rolloutd rollout (see the module doc)."""

    max_resubmits = 2

    def __init__(self, *args: Any, rolloutd_url: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rolloutd_url = rolloutd_url or os.environ.get("ROLLOUTD_URL", "http://127.0.0.1:8321")

    def task(self, row: Mapping[str, Any]) -> dict[str, Any]:
        for key in ("extra_info", "tools_kwargs"):
            holder = row.get(key) or {}
            if isinstance(holder, Mapping) and isinstance(holder.get("rolloutd_task"), Mapping):
                return dict(holder["rolloutd_task"])
        raise ValueError("no rolloutd task: put it in extra_info['rolloutd_task'] or override task()")

    def _response_length(self) -> int | None:
        try:
            return int(self.config.actor_rollout_ref.rollout.response_length)  # type: ignore[union-attr]
        except AttributeError:
            return None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        sampling = {k: sampling_params[k] for k in ("temperature", "top_p", "top_k")
                    if sampling_params.get(k) is not None}
        step = kwargs.get("global_steps", kwargs.get("global_step", 0))
        group_id = f"verl-{step}-{kwargs.get('index', id(self))}"
        async with AsyncClient(self.rolloutd_url) as client:
            group = await arun_group(client, self.task(kwargs), 1, group_id=group_id,
                                     max_resubmits=self.max_resubmits, sampling=sampling or None)
        fields = agent_loop_output(group.rollouts[0], response_length=self._response_length())
        if AgentLoopOutput is None:
            return fields
        fields["metrics"] = AgentLoopMetrics(**fields["metrics"])
        return AgentLoopOutput(**fields)
