"""``code``: the model writes a Python solution file; tests run in a fresh sandbox.

Task fields::

    {"kind": "code", "id": "sum-two", "prompt": "Read two integers ...",
     "entry": "solution.py",                  # the file the model writes (default)
     "tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...],   # stdin/stdout cases, or
     "pytest": "from solution import add\\ndef test_add(): ...",   # a pytest file
     "pytest_plugins": "auto",                # or "installed" / "none" (see below)
     "reward": "fraction",                    # or "all": 1.0 only when every test passes
     "files": {"helper.txt": "..."},          # optional starting files
     "timeout_s": 10, "memory_mb": 512, "pids_max": 64,   # limits of the test sandbox
     "tools": ["bash", "editor", "finish"]}

EVAL reads ``entry`` from the rollout's workspace; if the model never wrote it, the last
fenced Python block of its final answer is used instead (``reward_info.solution_from``).
The solution and tests are copied into a *fresh* sandbox with the limits above (no
network); each stdin/stdout case runs ``python entry`` with its stdin under ``timeout_s``
and passes when the output matches (trailing whitespace ignored). A pytest file runs as
``test_solution.py`` next to the solution; every collected test counts. The reward is the
fraction of tests that pass, or with ``"reward": "all"`` 1.0 or 0.0.

``pytest_plugins``: whether pytest loads the plugins installed beside it (its entry-point
autoload). ``auto``: only in an image, whose plugins are the task's environment; on the
host the interpreter is the daemon's own, whose plugins (hypothesis, pytest-trio, whatever
the daemon's venv holds) are not the task's, must not change its grade, and cost seconds of
every EVAL. ``installed``: always; ``none``: never.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutd.daemon.tasks._common import (
    _SEGMENT,
    KNOWN_TOOLS,
    RUNNER_SOURCE,
    NonBlank,
    PathMap,
    PositiveNumber,
    TaskModel,
    answer_texts,
    code_block,
    omitted,
    read_runner_output,
    runner_argv,
    tail,
    tools_type,
)
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskHandler
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.sandbox import Sandbox, SandboxSpec

TEST_FILE = "test_solution.py"
RUNNER_FILE = "_rolloutd_runner.py"
RESULT_FILE = "_rolloutd_result.json"
#: The rollout's own sandbox (where the model works).
AGENT_MEMORY_MB = 1024
AGENT_PIDS_MAX = 256
MAX_SOLUTION_BYTES = 1_000_000

SYSTEM = (
    "You are a programmer working in a Linux sandbox; the current directory is {workdir}. "
    "Write a complete Python 3 program to the file {entry} that solves the task{io}. "
    "Use the tools to write and test it, then call finish."
)


#: pytest's switch for its plugin autoload (setuptools entry points of every installed dist).
NO_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"


def plugins_autoload(mode: str, sb: Sandbox) -> bool:
    """Whether pytest in ``sb`` loads the installed plugins (``pytest_plugins``; ``auto``:
    only where the sandbox runs an image, whose interpreter is the task's, not the daemon's)."""
    return mode == "installed" or (mode == "auto" and sb.spec.image is not None)


def normalise_output(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


class CodeTestCase(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    stdin: str = ""
    stdout: str


class CodeTaskModel(TaskModel):
    """A ``code`` task: ``prompt`` (or its alias ``question``) and exactly one of ``tests``
    (stdin/stdout cases) or ``pytest`` (the text of a pytest file)."""

    model_config = ConfigDict(json_schema_extra={
        "allOf": [{"anyOf": [{"required": ["prompt"]}, {"required": ["question"]}]},
                  {"oneOf": [{"required": ["tests"]}, {"required": ["pytest"]}]}],
    })

    kind: Literal["code"]
    prompt: NonBlank = omitted()  # this or question (not null)
    question: NonBlank = omitted()
    entry: Annotated[str, Field(pattern=rf"^(?:{_SEGMENT}/)*[^/\x00]*\.py$")] = "solution.py"
    tests: Annotated[list[CodeTestCase], Field(min_length=1)] = omitted()
    pytest: NonBlank = omitted()
    pytest_plugins: Literal["auto", "installed", "none"] = "auto"
    reward: Literal["fraction", "all"] = "fraction"
    files: PathMap = Field(default_factory=dict)
    timeout_s: PositiveNumber = 10.0
    memory_mb: int = Field(512, ge=16)
    pids_max: int = Field(64, ge=8)
    tools: tools_type(KNOWN_TOOLS) = Field(default_factory=lambda: ["bash", "editor", "finish"])  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _one_of(self) -> CodeTaskModel:
        if self.prompt is None and self.question is None:
            raise ValueError("give 'prompt' (or 'question')")
        if (self.tests is None) == (self.pytest is None):
            raise ValueError("give exactly one of 'tests' (stdin/stdout cases) or 'pytest'")
        if self.prompt is None:
            self.prompt = self.question
        return self


class CodeTask(TaskHandler):
    kind = "code"
    task_model = CodeTaskModel

    def sandbox_spec(self, task: dict[str, Any]) -> SandboxSpec:
        return SandboxSpec(memory_mb=max(AGENT_MEMORY_MB, task["memory_mb"]), pids_max=AGENT_PIDS_MAX)

    def eval_spec(self, task: dict[str, Any]) -> SandboxSpec:
        return SandboxSpec(memory_mb=task["memory_mb"], pids_max=task["pids_max"], network=False)

    async def setup(self, sandbox: Sandbox | None, task: dict[str, Any]) -> None:
        assert sandbox is not None
        await _write_files(sandbox, task["files"])

    def prompt(self, task: dict[str, Any]) -> Prompt:
        io = " (read standard input, write standard output)" if "tests" in task else ""
        system = SYSTEM.format(workdir="/workspace", entry=task["entry"], io=io)
        return Prompt(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": task["prompt"]}],
            tools=list(task["tools"]),
        )

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        source, origin = await self._solution(task, trajectory, ctx)
        if source is None:
            return Reward(0.0, {"reason": "no_solution", "passed": 0, "total": self._count(task)})
        async with ctx.open_sandbox(self.eval_spec(task)) as sb:
            await _write_files(sb, {task["entry"]: source, **task["files"]})
            output = None
            if "tests" in task:
                results = await self._run_cases(sb, task)
            else:
                results, output = await self._run_pytest(sb, task)
        passed = sum(1 for r in results if r["passed"])
        total = max(len(results), self._count(task))
        if task["reward"] == "all":
            reward = 1.0 if total and passed == total else 0.0
        else:
            reward = passed / total if total else 0.0
        info = {"passed": passed, "total": total, "mode": task["reward"],
                "solution_from": origin, "tests": results}
        if output is not None and passed < total:
            info["output"] = output
        return Reward(reward, info)

    @staticmethod
    def _count(task: dict[str, Any]) -> int:
        return len(task["tests"]) if "tests" in task else 0

    async def _solution(
        self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext
    ) -> tuple[bytes | None, str | None]:
        sb = ctx.sandbox
        if sb is not None:
            st = await sb.stat(task["entry"])
            if st is not None and st.type == "file":
                return await sb.read_file(task["entry"], max_bytes=MAX_SOLUTION_BYTES), "workspace"
        for source, text in answer_texts(ctx.final_answer, trajectory):
            block = code_block(text)
            if block is not None and block.strip():
                return block.encode(), f"{source}_code_block"
        return None, None

    async def _run_cases(self, sb: Sandbox, task: dict[str, Any]) -> list[dict[str, Any]]:
        results = []
        for i, case in enumerate(task["tests"]):
            res = await sb.run([sb.python, task["entry"]], stdin=case["stdin"].encode(),
                               timeout_s=task["timeout_s"], max_output_bytes=100_000)
            got = res.stdout.decode(errors="replace")
            ok = (not res.timed_out and res.exit_code == 0
                  and normalise_output(got) == normalise_output(case["stdout"]))
            entry: dict[str, Any] = {"case": i, "passed": ok, "exit_code": res.exit_code,
                                     "timed_out": res.timed_out, "seconds": round(res.duration_s, 3)}
            if not ok:
                entry["stdout"] = tail(got, 300)
                entry["stderr"] = tail(res.stderr, 300)
            results.append(entry)
        return results

    async def _run_pytest(self, sb: Sandbox, task: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        await sb.write_file(TEST_FILE, task["pytest"].encode())
        await sb.write_file(RUNNER_FILE, RUNNER_SOURCE.read_bytes())
        argv = runner_argv(sb.python, RUNNER_FILE, tests=[], paths=[TEST_FILE], out=RESULT_FILE)
        env = {} if plugins_autoload(task["pytest_plugins"], sb) else {NO_AUTOLOAD: "1"}
        res = await sb.run(argv, timeout_s=task["timeout_s"], max_output_bytes=200_000, env=env)
        output = tail(res.stdout + res.stderr, 1500)
        if res.timed_out:
            return [{"test": TEST_FILE, "passed": False, "outcome": "timed_out"}], output
        try:
            data = read_runner_output(await sb.read_file(RESULT_FILE))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"code task: the test runner failed ({exc}): {output}") from None
        results = [{"test": nodeid, "passed": outcome == "passed", "outcome": outcome}
                   for nodeid, outcome in data["results"].items()]
        if not results:
            results = [{"test": TEST_FILE, "passed": False, "outcome": "no_tests"}]
        return results, output


async def _write_files(sb: Sandbox, files: dict[str, str | bytes]) -> None:
    """Files into the workspace; a file in a directory gets its directory first."""
    for path, data in files.items():
        parent = posixpath.dirname(path)
        if parent:
            await sb.mkdir(parent, parents=True)
        await sb.write_file(path, data.encode() if isinstance(data, str) else data)
