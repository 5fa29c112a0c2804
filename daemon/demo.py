"""``rolloutd demo``: a real daemon, a real tiny model, real sandboxes, one small mixed batch.

Starts a daemon in this process (the embedded SmolLM2-135M on CPU, the bwrap sandbox
backend, or the local one with a loud warning when bwrap is unusable), submits a few
math, code and SWE tasks through the HTTP client, shows their progress live, prints a
results table and writes every trajectory to ``out`` (JSON lines). A 135M model mostly
earns reward 0 here: the demo shows the machinery (turns, sampled tokens, tool calls,
per-stage seconds), not a good policy.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from rich import box
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler
from rich.panel import Panel
from rich.table import Table

from rolloutd.daemon.client import AsyncClient, RolloutdError
from rolloutd.daemon.config import Settings
from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.node import Node
from rolloutd.daemon.trajectory import Status, Trajectory

ENGINE_LABELS = {"vllm": "vLLM CPU engine", "transformers": "in-process transformers", None: ""}

#: The batch. Small limits keep the whole demo within ~3 minutes on 2 CPU cores.
MATH_TASKS: list[dict[str, Any]] = [
    {"kind": "math", "id": "math-add", "question": "What is 17 + 25?", "answer": "42"},
    {"kind": "math", "id": "math-linear", "question": "Solve for x: 3x + 7 = 22.", "answer": "5"},
    {"kind": "math", "id": "math-frac", "question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
]
CODE_TASKS: list[dict[str, Any]] = [
    {"kind": "code", "id": "code-sum-two",
     "prompt": "Read two integers a and b separated by a space from standard input and print their sum.",
     "tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "-5 5\n", "stdout": "0\n"}],
     "tools": ["bash", "finish"]},
    {"kind": "code", "id": "code-add-fn",
     "prompt": "Write solution.py defining a function add(a, b) that returns a + b.",
     "pytest": "from solution import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n",
     "tools": ["bash", "finish"]},
]
SWE_INSTANCE = "textkit-1"
LIMITS: dict[str, dict[str, int]] = {
    "math": {"max_turns": 1, "max_tokens_per_turn": 64},
    "code": {"max_turns": 2, "max_tokens_per_turn": 80},
    "swe": {"max_turns": 2, "max_tokens_per_turn": 80},
}
#: ``--swe``: this many instances of the SWE set (examples/swe_set), one per project.
SWE_SET_INSTANCES = 4
SWE_SET_LIMITS = {"max_turns": 4, "max_tokens_per_turn": 160}
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "seed": 1}
TIMEOUT_S = 150.0
SWE_TIMEOUT_S = 400.0
POLL_S = 0.5

log = logging.getLogger(__name__)


class DemoError(DaemonError):
    """The demo cannot run here; the message says why."""


@dataclass
class Row:
    task: dict[str, Any]
    rollout_id: str = ""
    traj: Trajectory | None = None
    started: float = field(default_factory=time.monotonic)


def choose_sandbox_backend(state_dir: Path, console: Console) -> str:
    """bwrap when it works here; otherwise local, with a warning nobody can miss."""
    from rolloutd.sandbox import SandboxStartError, open_backend

    why = "bwrap is not installed"
    if shutil.which("bwrap"):
        try:
            open_backend("bwrap", state_dir=state_dir / "probe", boot_id="probe", check=True)
            return "bwrap"
        except SandboxStartError as exc:
            why = str(exc)
    console.print(Panel(
        f"[bold]{why}[/bold]\n\nFalling back to the LOCAL sandbox backend: the model's commands "
        "run as YOU, with NO ISOLATION, on this machine.\nInstall bubblewrap (apt install "
        "bubblewrap) for real sandboxes.",
        title="WARNING: no sandbox isolation", border_style="bold red"))
    return "local"


def _tokens(t: Trajectory) -> str:
    return f"{sum(t.loss_mask)}/{len(t.token_ids)}"


def _tool_calls(t: Trajectory) -> int:
    return sum(len(turn.tool_calls) for turn in t.turns)


def progress_table(rows: list[Row]) -> Table:
    table = Table(title="rollouts (live)", box=box.SIMPLE_HEAD)
    table.add_column("task", no_wrap=True, min_width=12)
    for col in ("kind", "status", "turns", "tokens", "tools", "seconds"):
        table.add_column(col, justify="left" if col in ("kind", "status") else "right")
    for r in rows:
        t = r.traj
        status = t.status.value if t else "submitting"
        secs = t.timing.total_s if t and t.status.terminal else time.monotonic() - r.started
        table.add_row(_name(r.task), r.task["kind"], _styled(status),
                      str(len(t.turns)) if t else "0", _tokens(t) if t else "0/0",
                      str(_tool_calls(t)) if t else "0", f"{secs:.1f}")
    return table


def results_table(rows: list[Row]) -> Table:
    table = Table(title="results (seconds per stage)", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    table.add_column("task", no_wrap=True, min_width=12)
    for col in ("reward", "turns", "tokens", "tools", "init", "run", "eval", "llm", "tool"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for r in rows:
        t = r.traj
        if t is None:
            continue
        tm = t.timing
        table.add_row(_name(r.task), "-" if t.reward is None else f"{t.reward:.2f}", str(len(t.turns)), _tokens(t),
                      str(_tool_calls(t)), f"{tm.init_s:.1f}", f"{tm.run_s:.1f}", f"{tm.eval_s:.1f}",
                      f"{tm.llm_s:.1f}", f"{tm.tool_s:.1f}")
    table.caption = "tokens: sampled / all; llm, tool: seconds of run in the model, in tools"
    return table


def _name(task: dict[str, Any]) -> str:
    return str(task.get("id") or task.get("instance_id"))


def _styled(status: str) -> str:
    style = {"completed": "green", "failed": "red", "timed_out": "yellow",
             "cancelled": "red"}.get(status, "cyan")
    return f"[{style}]{status}[/{style}]"


def note(t: Trajectory) -> str:
    """One line on what the reward means."""
    if t.error is not None:
        return f"{t.error.stage} {t.error.type}: {t.error.message}"
    info = t.reward_info
    if info.get("reason") in ("no_answer", "no_solution", "empty_patch"):
        return str(info["reason"]).replace("_", " ")
    if "gold" in info:
        return f"answer {info.get('extracted')}, expected {info['gold']}"
    if "passed" in info:
        return f"{info['passed']}/{info['total']} tests passed"
    if "resolved" in info:
        return "resolved" if info["resolved"] else f"not resolved ({info.get('reason', 'tests fail')})"
    return str(info or t.finish_reason or "")


def swe_set_module() -> Any:
    """examples/swe_set/build.py of this checkout (the SWE set's images and instances)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "swe_set" / "build.py"
    if not path.is_file():
        raise DemoError(f"--swe needs a rolloutd checkout: {path} is missing")
    spec = importlib.util.spec_from_file_location("rolloutd_swe_set_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swe_set_tasks(console: Console, n: int = SWE_SET_INSTANCES) -> list[dict[str, Any]]:
    """The first instance of each of ``n`` projects of the SWE set, images built (cached)."""
    build = swe_set_module()
    console.print("[dim]Building the SWE set's images (cached after the first time, "
                  "a few minutes then)...[/dim]")
    rows = build.load_instances()
    picked: dict[str, dict[str, Any]] = {}
    for row in rows:
        picked.setdefault(row["repo"], row)
    hidden = ("patch", "wrong_patch")  # the known fix and the wrong one stay hidden
    return [{k: v for k, v in row.items() if k not in hidden} for row in list(picked.values())[:n]]


async def _drive(client: AsyncClient, node: Node, rows: list[Row], console: Console) -> None:
    for r in rows:
        swe_set = r.task.get("image") is not None
        sub = await client.submit(r.task, n=1, sampling=SAMPLING,
                                  limits=SWE_SET_LIMITS if swe_set else LIMITS[r.task["kind"]],
                                  timeout_s=SWE_TIMEOUT_S if swe_set else TIMEOUT_S)
        r.rollout_id = sub.ids[0]
        r.started = time.monotonic()
    by_id = {r.rollout_id: r for r in rows}

    def running(r: Row) -> bool:
        return r.traj is None or not r.traj.status.terminal

    with Live(progress_table(rows), console=console, refresh_per_second=4, transient=False) as live:
        async with trio.open_nursery() as nursery:

            async def results() -> None:
                """Each result the moment it is in: the demo ends with its last rollout."""
                async for traj in client.stream(list(by_id)):
                    by_id[traj.id].traj = traj
                    live.update(progress_table(rows))
                nursery.cancel_scope.cancel()

            async def progress() -> None:
                """The running rollouts' turns so far, every POLL_S."""
                while not node.draining:
                    await trio.sleep(POLL_S)
                    for r in rows:
                        if running(r):
                            traj = await client.get(r.rollout_id)
                            if running(r):  # the stream may have brought its result meanwhile
                                r.traj = traj
                    live.update(progress_table(rows))
                nursery.cancel_scope.cancel()

            nursery.start_soon(results)
            nursery.start_soon(progress)
    console.print()


async def _engine_ready(node: Node, console: Console) -> float:
    """Wait until the embedded model's backend is healthy; seconds waited."""
    from rolloutd.daemon.llm.cpu_engine import EMBEDDED_ID

    started = time.monotonic()
    with console.status("starting the vLLM CPU engine (about 30-70 s) ..."):
        while node.embedded_engine == "vllm" and node.services.pool is not None:
            if any(b["id"] == EMBEDDED_ID and b["healthy"] for b in node.services.pool.describe()):
                break
            await trio.sleep(0.2)
    return time.monotonic() - started


async def run_demo(out: Path, state_dir: Path, console: Console, *,
                   policy: list[str] | None = None, swe: bool = False, engine: str = "auto",
                   dtype: str = "auto", timings: dict[str, float] | None = None) -> int:
    from rolloutd.daemon.tasks.swe_examples import make_swe_repos

    backend = choose_sandbox_backend(state_dir, console)
    tasks: list[dict[str, Any]]
    if swe:
        if backend != "bwrap":
            raise DemoError("--swe runs each instance in its image: it needs bwrap")
        tasks = await trio.to_thread.run_sync(swe_set_tasks, console)
    else:
        repos = await trio.to_thread.run_sync(make_swe_repos, state_dir / "swe-repos")
        swe_task = next(t for t in repos if t["instance_id"] == SWE_INSTANCE)
        swe_task = {k: v for k, v in swe_task.items() if k != "patch"}  # the known fix stays hidden
        tasks = [*MATH_TASKS, *CODE_TASKS, {**swe_task, "tools": ["bash", "finish"]}]

    settings = Settings(
        host="127.0.0.1", port=0, state_dir=state_dir, sandbox_backend=backend,
        embedded_model=policy is None, embedded_engine=engine, embedded_dtype=dtype,
        backends=[] if policy is None else [{"kind": "scripted", "replies": policy}],
        # every rollout's RUN at once: the vLLM engine batches their turns
        n_init=2, n_run=len(tasks), n_eval=2, drain_timeout_s=5.0, log_level="warning",
    )
    rows = [Row(t) for t in tasks]
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        node: Node = await nursery.start(Node(settings).run)
        try:
            url = node.urls[0]
            model = (f"SmolLM2-135M-Instruct, embedded, CPU, {ENGINE_LABELS[node.embedded_engine]}"
                     if policy is None else "scripted replies (TEST DOUBLE, not a model)")
            console.print(f"[bold]rolloutd demo[/bold]  daemon {url}  model: {model}  "
                          f"sandbox: {backend}  tasks: {len(tasks)}")
            if node.embedded_engine == "vllm":
                ready_s = await _engine_ready(node, console)
                console.print(f"[dim]vLLM CPU engine ready in {ready_s:.0f} s "
                              f"({node.embedded_dtype})[/dim]")
                if timings is not None:
                    timings["engine_ready_s"] = ready_s
            elif policy is None:
                console.print("[dim]The first model turn includes loading the model "
                              "(~30 s the first time).[/dim]")
            rollouts_started = time.monotonic()
            async with AsyncClient(url, token=node.token) as client:
                await _drive(client, node, rows, console)
            if timings is not None:
                timings["rollouts_s"] = time.monotonic() - rollouts_started
        finally:
            node.request_stop()

    done = [r.traj for r in rows if r.traj is not None]
    with out.open("w") as f:
        for t in done:
            f.write(json.dumps(t.model_dump(mode="json")) + "\n")
    console.print(results_table(rows))
    for t in done:
        status = "" if t.status is Status.completed else _styled(t.status.value) + " "
        console.print(f"  [bold]{t.task_id}[/bold]: {status}{note(t)}", highlight=False)
    rewards = [t.reward for t in done if t.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    console.print(f"{len(done)} rollouts in {time.monotonic() - started:.0f} s, mean reward "
                  f"{mean:.2f}; trajectories (token ids, logprobs, loss mask, messages) in {out}")
    broken = [t for t in done if t.status in (Status.failed, Status.lost, Status.cancelled)]
    if broken or len(done) < len(rows):
        console.print(f"[bold red]{len(broken) or len(rows) - len(done)} rollouts did not "
                      "complete: see the table above[/bold red]")
        return 1
    return 0


def main(out: Path = Path("trajectories.jsonl"), state_dir: Path | None = None, *,
         policy: list[str] | None = None, console: Console | None = None,
         swe: bool = False, engine: str = "auto", dtype: str = "auto",
         timings: dict[str, float] | None = None) -> int:
    """Run the demo; 0 when every rollout ran to a result. ``policy`` (scripted replies, a
    TEST DOUBLE) replaces the model, for the test that exercises this code path. ``swe``: a
    few instances of the SWE set (examples/swe_set) in their images instead of the mix.
    ``engine``: the embedded model's engine (``auto``: vLLM's CPU build where installed);
    ``dtype``: that engine's (``auto``: bfloat16 where the CPU computes it natively).
    ``timings`` (if given) gets ``engine_ready_s`` (vLLM) and ``rollouts_s``."""
    console = console or Console()
    handler = RichHandler(console=console, show_path=False, show_time=False)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    own_dir = state_dir is None
    # A short path: sandbox socket paths must fit in 107 bytes.
    state = Path(tempfile.mkdtemp(prefix="rolloutd-demo-")) if state_dir is None else state_dir
    try:
        return trio.run(lambda: run_demo(out, state, console, policy=policy, swe=swe, engine=engine,
                                         dtype=dtype, timings=timings))
    except RolloutdError as exc:
        console.print(f"[bold red]the demo daemon answered an error: {exc}[/bold red]")
        return 1
    except DemoError as exc:
        console.print(f"[bold red]{exc}[/bold red]")
        return 1
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        if own_dir:
            shutil.rmtree(state, ignore_errors=True)
