"""The learning claim with its control: GRPO over several seeds against learning rate 0.

    python examples/grpo_cpu/curves.py --out runs/curves                 # 3 seeds + controls
    python examples/grpo_cpu/curves.py --out runs/curves --repeat 0      # + seed 0 run again
    python examples/grpo_cpu/curves.py --out runs/more --resume runs/curves/curves.csv

Runs ``train.py`` once per seed with the default learning rate, and once per control seed with
``--lr 0`` (the same tasks and the same seeded sampling, weights never updated), one run after
the other, each with its own ``rolloutd serve``. ``--repeat SEED`` runs that trained seed a
second time and compares the two runs sample by sample (token sequences, rewards), which is
how reproducible a run is. Writes ``OUT/curves.csv`` (one row per run and step),
``OUT/curves.png`` (mean reward per step over the seeds, trained against control, with the
range over seeds) and prints a table; each run's own output is under ``OUT/<run>/``.
``--resume CSV`` completes a series that was cut short: the runs that CSV (an earlier
``curves.csv``) already has are taken from it, not run again.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.grpo_cpu import train


def run(out: Path, name: str, seed: int, extra: list[str]) -> list[dict[str, Any]]:
    print(f"== {name}: seed {seed} {' '.join(extra)}", flush=True)
    t0 = time.monotonic()
    rows = train.main(["--out", str(out / name), "--seed", str(seed), *extra])
    for r in rows:
        r.update(run=name, seed=seed, run_wall_s=round(time.monotonic() - t0, 1))
    return rows


def samples(path: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    with open(path / "samples.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return {(d["step"], d["prompt_index"], d["sample_index"]): d for d in lines}


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Two runs of one configuration, sample by sample."""
    sa, sb = samples(a), samples(b)
    common = sorted(set(sa) & set(sb))
    same = [k for k in common if sa[k]["tokens"] == sb[k]["tokens"]]
    first = next((k[0] for k in common if sa[k]["tokens"] != sb[k]["tokens"]), None)
    return {"samples": len(common), "identical": len(same), "first_step_differing": first,
            "only_in_one": len(set(sa) ^ set(sb))}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier ``curves.csv``, with their numbers as numbers."""
    with open(path, newline="") as f:
        rows: list[dict[str, Any]] = list(csv.DictReader(f))
    for r in rows:
        for key, value in r.items():
            if key != "run" and value not in ("", None):
                r[key] = float(value) if any(c in value for c in ".en") else int(value)
    return rows


def mean_band(rows: list[dict[str, Any]], runs: list[str], steps: int) -> list[tuple[float, float, float]]:
    out = []
    for step in range(steps):
        vals = [r["mean_reward"] for r in rows if r["run"] in runs and r["step"] == step]
        out.append((statistics.fmean(vals), min(vals), max(vals)) if vals else (float("nan"),) * 3)
    return out


def plot(rows: list[dict[str, Any]], trained: list[str], control: list[str], steps: int, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    for runs, label, color in ((trained, "GRPO (lr 5e-5)", "tab:blue"), (control, "control (lr 0)", "tab:gray")):
        if not runs:
            continue
        band = mean_band(rows, runs, steps)
        xs = list(range(steps))
        ax.plot(xs, [b[0] for b in band], marker="o", color=color, label=f"{label}, mean of {len(runs)} seeds")
        ax.fill_between(xs, [b[1] for b in band], [b[2] for b in band], color=color, alpha=0.2)
    ax.set_xlabel("step (policy version before the update)")
    ax.set_ylabel("mean reward (all judged samples)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("GRPO through rolloutd, SmolLM2-135M, calc tool task (band: min-max over seeds)", fontsize=8)
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/curves"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--control-seeds", type=int, nargs="*", default=None, help="default: --seeds")
    p.add_argument("--repeat", type=int, default=None, help="run this trained seed twice")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--resume", type=Path, default=None,
                   help="an earlier curves.csv: its runs are kept, not run again")
    args, rest = p.parse_known_args(argv)  # the rest goes to train.py
    controls = args.seeds if args.control_seeds is None else args.control_seeds
    extra = ["--steps", str(args.steps), *rest]
    rows: list[dict[str, Any]] = read_rows(args.resume) if args.resume else []
    args.out.mkdir(parents=True, exist_ok=True)
    trained = [f"seed{s}" for s in args.seeds]
    control = [f"control{s}" for s in controls]
    fields = ["run", "seed", "step", "mean_reward", "samples", "kept_groups", "loss", "rollout_s",
              "train_s", "sync_s", "wall_s", "run_wall_s"]

    def save() -> None:  # after every run, so a cut-short series still has its curves
        with open(args.out / "curves.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        plot(rows, [n for n in trained if any(r["run"] == n for r in rows)],
             [n for n in control if any(r["run"] == n for r in rows)], args.steps, args.out / "curves.png")

    # The first seed, its rerun and its control first, then the other seeds, then their
    # controls: a series cut short still has a trained/control pair and the rerun.
    plan = [(f"seed{s}", s, extra) for s in args.seeds[:1]]
    if args.repeat is not None:
        plan.append((f"seed{args.repeat}-again", args.repeat, extra))
    plan += [(f"control{s}", s, [*extra, "--lr", "0"]) for s in controls[:1]]
    plan += [(f"seed{s}", s, extra) for s in args.seeds[1:]]
    plan += [(f"control{s}", s, [*extra, "--lr", "0"]) for s in controls[1:]]
    done = {r["run"] for r in rows}
    for name, seed, run_args in plan:
        if name in done:
            print(f"== {name}: from {args.resume}", flush=True)
            continue
        rows += run(args.out, name, seed, run_args)
        save()
    repeat = None
    if args.repeat is not None and f"seed{args.repeat}-again" not in done:
        repeat = compare(args.out / f"seed{args.repeat}", args.out / f"seed{args.repeat}-again")

    def early_late(name: str) -> tuple[float, float, float]:
        rs = [r for r in rows if r["run"] == name]
        vals = [r["mean_reward"] for r in rs]
        return statistics.fmean(vals[:3]), statistics.fmean(vals[-3:]), rs[-1]["run_wall_s"]

    print(f"{'run':>14}  first 3 steps  last 3 steps  wall s")
    for name in [*trained, *control] + ([f"seed{args.repeat}-again"] if repeat else []):
        e, late, wall = early_late(name)
        print(f"{name:>14}  {e:13.3f}  {late:12.3f}  {wall:6.0f}")
    for label, runs in (("trained", trained), ("control", control)):
        if runs:
            lates = [early_late(n)[1] for n in runs]
            gain = [early_late(n)[1] - early_late(n)[0] for n in runs]
            print(f"{label}: last-3 mean {statistics.fmean(lates):.3f} "
                  f"(sd {statistics.pstdev(lates):.3f}, range {min(lates):.3f}-{max(lates):.3f}); "
                  f"gain over the first 3 steps {statistics.fmean(gain):+.3f} "
                  f"(range {min(gain):+.3f} to {max(gain):+.3f})")
    if repeat:
        print(f"rerun of seed {args.repeat}: {repeat['identical']} of {repeat['samples']} kept samples "
              f"identical token for token; first step with a difference: {repeat['first_step_differing']}")


if __name__ == "__main__":
    main()
