"""The GRPO math of the example, in plain torch: advantages, logprobs, the clipped loss.

Everything works on rolloutd trajectories as they come (``token_ids``, ``loss_mask``,
``logprobs``); nothing is re-tokenized. The policy's logprob of token ``t`` comes from the
hidden state at ``t - 1``; only positions with ``loss_mask == 1`` (tokens the policy sampled)
are scored and trained.

Speed on CPU: every trajectory of a batch starts with the same system prompt and worked
examples, so :func:`masked_logprobs` runs that common prefix through the model once, repeats
its KV cache over the batch, and runs only the rest of each sequence. The result is the same
as a full forward pass per sequence (the gradient flows through the shared prefix too).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: ``(r - mean) / (std + eps)`` over one group (population std)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


@dataclass
class Scored:
    """One sequence's scored positions: the policy's logprobs now, and rolloutd's stored ones."""

    new: torch.Tensor  # logprobs under the current weights (with grad)
    old: torch.Tensor  # the sampling logprobs rolloutd returned


def masked_logprobs(
    model: Any, token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
    stored: Sequence[Sequence[float | None]], *, temperature: float = 1.0,
) -> list[Scored]:
    """Logprobs of every sampled token (``loss_mask == 1``) under ``model``, at ``temperature``
    (the sampling temperature: rolloutd's backends return the logprob of the distribution
    sampled from), next to the stored logprobs."""
    firsts = [list(m).index(1) for m in loss_masks]
    if min(firsts) < 1:
        raise ValueError("a sampled token at position 0 has no context")
    prefix = min(common_prefix_length(token_ids), min(firsts) - 1)
    base, head = model.model, model.lm_head
    cache = None
    if prefix > 0:
        out = base(input_ids=torch.tensor([list(token_ids[0][:prefix])]), use_cache=True)
        cache = getattr(out, "cache", None)  # transformers 5.x; past_key_values before
        if cache is None:
            cache = out.past_key_values
        cache.batch_repeat_interleave(len(token_ids))
    width = max(len(s) for s in token_ids) - prefix
    rows = [list(s[prefix:]) + [0] * (width - (len(s) - prefix)) for s in token_ids]
    positions = torch.arange(prefix, prefix + width).expand(len(rows), width)
    # Right padding: real tokens never attend to the pads after them, so no mask is needed.
    # transformers 5.x renamed forward's past_key_values to cache (the old name warns)
    cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    hidden = base(input_ids=torch.tensor(rows), **{cache_kw: cache}, position_ids=positions,
                  use_cache=cache is not None).last_hidden_state
    out_list = []
    for b, (ids, mask, lps) in enumerate(zip(token_ids, loss_masks, stored, strict=True)):
        where = [t for t in range(1, len(ids)) if mask[t] == 1]
        h = hidden[b, torch.tensor(where) - 1 - prefix]
        logp = torch.log_softmax(head(h).float() / temperature, dim=-1)
        new = logp.gather(1, torch.tensor([ids[t] for t in where])[:, None])[:, 0]
        old = torch.tensor([float(lps[t]) for t in where])  # type: ignore[arg-type]
        out_list.append(Scored(new, old))
    return out_list


@dataclass
class LossStats:
    loss: float
    tokens: int
    clip_frac: float
    mismatch: float  # mean |new - stored| logprob (0 when the trainer's weights = the server's)
    ratio_mean: float


def grpo_loss(
    scored: Sequence[Scored], advantages: Sequence[float], *, clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped policy gradient with token-level normalisation (DAPO): the ratio is
    ``exp(new - stored)``; ``clip_high > clip_low`` is DAPO's clip-higher."""
    terms, clipped, diffs, ratios = [], 0, [], []
    for s, adv in zip(scored, advantages, strict=True):
        ratio = torch.exp(s.new - s.old)
        unclipped = ratio * adv
        bounded = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
        terms.append(-torch.minimum(unclipped, bounded))
        clipped += int((bounded < unclipped).sum())
        diffs.append((s.new.detach() - s.old).abs())
        ratios.append(ratio.detach())
    flat = torch.cat(terms)
    loss = flat.sum() / flat.numel()
    n = flat.numel()
    return loss, LossStats(
        loss=float(loss.detach()), tokens=n, clip_frac=clipped / n,
        mismatch=float(torch.cat(diffs).mean()), ratio_mean=float(torch.cat(ratios).mean()),
    )
