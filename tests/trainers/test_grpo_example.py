"""examples/grpo_cpu: the GRPO math, and two real training steps through rolloutd.

The two-step run is the example's own loop at tiny settings: ``rolloutd model-server`` (real
SmolLM2) and ``rolloutd serve`` children, a kept batch, a GRPO update of the trainer's copy,
the weights saved and reloaded into the model-server, the policy version bumped.
"""

from __future__ import annotations

import csv

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from examples.grpo_cpu.grpo import (
    common_prefix_length,
    group_advantages,
    grpo_loss,
    masked_logprobs,
)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_shared_prefix_logprobs_equal_full_forward_passes():
    model = tiny_llama()
    seqs = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 8], [1, 2, 3, 5, 5, 5, 5, 5, 6]]
    masks = [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1, 0, 1]]
    stored = [[None if m == 0 else -1.0 for m in mask] for mask in masks]
    assert common_prefix_length(seqs) == 3
    scored = masked_logprobs(model, seqs, masks, stored, temperature=0.7)
    for ids, mask, s in zip(seqs, masks, scored):
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        want = torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]])
        torch.testing.assert_close(s.new, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(s.old, torch.full_like(want, -1.0))

    # The gradient flows through the shared prefix too: equal to the per-sequence one.
    loss, stats = grpo_loss(scored, [1.0, -0.5, 0.25])
    loss.backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total, n = 0.0, 0
    for ids, mask, adv in zip(seqs, masks, [1.0, -0.5, 0.25]):
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0] / 0.7, dim=-1)
        new = torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]])
        ratio = torch.exp(new + 1.0)
        total = total + (-torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)).sum()
        n += len(new)
    (total / n).backward()
    for a, b in zip(fast, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert stats.tokens == 7


def test_group_advantages_and_clipping():
    assert group_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1, -1, 1, -1], abs=1e-5)
    assert group_advantages([1.0, 1.0]) == [0.0, 0.0]
    from examples.grpo_cpu.grpo import Scored

    s = Scored(new=torch.tensor([0.0, 0.0], requires_grad=True), old=torch.tensor([-1.0, 0.5]))
    loss, stats = grpo_loss([s], [1.0])
    # ratio e^1 is clipped at 1.28 (no gradient), e^-0.5 is not.
    assert stats.clip_frac == 0.5
    loss.backward()
    assert s.new.grad[0] == 0.0 and s.new.grad[1] != 0.0


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["vllm", "model-server"])
def test_two_training_steps_through_rolloutd(tmp_path, engine):
    """The default engine (vLLM's CPU build: whole-checkpoint reloads) and the fallback
    (``rolloutd model-server``: the trained tensors only)."""
    import json

    from examples.grpo_cpu.train import main

    rows = main(["--out", str(tmp_path), "--steps", "2", "--keep", "1", "--group-size", "2",
                 "--keep-all", "--gen-factor", "1", "--examples", "1", "--max-tokens", "32",
                 "--train-layers", "1", "--updates", "1", "--seed", "1", "--threads", "1",
                 "--engine", engine])
    assert [r["step"] for r in rows] == [0, 1] and [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 2 and r["kept_groups"] == 1 and r["tokens"] > 0
        # The trainer's copy scores the sampled tokens as the server sampled them (fp32 both):
        # after the first sync too, so the server did load the trained weights.
        assert r["logprob_mismatch"] < 1e-3
    with open(tmp_path / "rewards.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["0", "1"]
    with open(tmp_path / "samples.jsonl") as f:
        sampled = [json.loads(line) for line in f]
    assert [(d["step"], d["sample_index"]) for d in sampled] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (tmp_path / "reward.png").stat().st_size > 1000
    from safetensors import safe_open

    with safe_open(str(tmp_path / "weights" / "step-2" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # vLLM reloads whole checkpoints; the model-server takes the trained tensors alone.
    assert ("model.embed_tokens.weight" in names) == (engine == "vllm")
    assert "model.norm.weight" in names
    assert not (tmp_path / "weights" / "step-1").exists()
