"""``swe``: a SWE-bench-style instance. The agent edits a repository; hidden tests judge it.

Task fields (SWE-bench / SWE-Gym export names)::

    {"kind": "swe", "instance_id": "textkit-1", "repo": "example/textkit",
     "base_commit": "<sha>", "problem_statement": "<the issue text>",
     "test_patch": "<diff adding the hidden tests>",
     "FAIL_TO_PASS": ["tests/test_x.py::test_new"],   # a list, or a JSON-encoded list
     "PASS_TO_PASS": ["tests/test_x.py::test_old"],
     "repo_path": "/abs/host/path/to/repo",          # bwrap/local: a git repository, or
     "image": "oci:/images/textkit-1:latest",        # or the instance's image (any source
                                                     # of docs/sandbox.md; any backend),
     "repo_dir": "/testbed",                         #   with the repository at repo_dir
     "python": null,                                 # interpreter inside the sandbox
     "test_timeout_s": 120, "memory_mb": 2048,
     "tools": ["bash", "editor", "finish"]}

INIT clones the repository (``repo_path`` bound read-only at its own path, or ``repo_dir``
inside the image) into the workspace at ``base_commit``, so the agent's shell starts in it.
EVAL takes ``git diff`` of the workspace against ``base_commit`` (new files included) and,
in a fresh sandbox, clones the repository again, applies the model's patch, resets the files
the test patch touches, applies the test patch and runs ``FAIL_TO_PASS + PASS_TO_PASS``.
resolved = every listed test passes; reward 1.0 or 0.0. ``reward_info`` holds the patch,
whether it applied, and every test's outcome.

What counts as the model's failure (reward 0): an empty patch, a patch that does not apply,
failing or timed-out tests, a workspace whose git repository the agent broke. What counts as
an infrastructure or task error (status ``failed``, no reward): a sandbox that cannot start,
a repository that cannot be cloned at ``base_commit``, a test patch that does not apply.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from rolloutd.daemon.tasks._common import (
    KNOWN_TOOLS,
    RUNNER_SOURCE,
    AbsPath,
    NonBlank,
    PositiveNumber,
    TaskModel,
    describe_run,
    omitted,
    read_runner_output,
    runner_argv,
    tail,
    tools_type,
)
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskHandler
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.sandbox import Bind, Sandbox, SandboxSpec

GIT_TIMEOUT_S = 120.0
#: Junk the agent's tools leave in the workspace (it is also their HOME): never part of a patch.
EXCLUDES = (".bash_history", ".python_history", ".ipython/", ".jupyter/", ".local/", ".cache/",
            ".config/", ".gitconfig", ".viminfo", "__pycache__/", "*.pyc", ".pytest_cache/")
EVAL_REPO = "repo"
MODEL_PATCH = "model.patch"
TEST_PATCH = "test.patch"
RUNNER_FILE = "runner.py"
RESULT_FILE = "result.json"
MAX_PATCH_BYTES = 5_000_000

SYSTEM = (
    "You are a software engineer working in a Linux sandbox. The repository is checked out "
    "in the current directory ({workdir}). Fix the issue below by editing the source code "
    "with the tools. Do not change the tests. When you are done, call finish."
)

_SAFE_REF = re.compile(r"[0-9A-Za-z][0-9A-Za-z._/-]{0,199}")
_PATCH_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)

# git as every command here runs it: no pager, no prompts, no hooks, any owner.
_GIT = ["git", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null",
        "-c", "advice.detachedHead=false", "-c", "user.name=rolloutd",
        "-c", "user.email=rolloutd@localhost"]


def patch_files(patch: str) -> list[str]:
    """Paths a unified git diff touches (old and new names)."""
    files: list[str] = []
    for a, b in _PATCH_FILE.findall(patch):
        for path in (a, b):
            if path not in files:
                files.append(path)
    return files


_TestIds = list[NonBlank]
_TEST_IDS = TypeAdapter(_TestIds, config=ConfigDict(strict=True))


def _json_test_ids(text: str) -> list[str]:
    try:
        return _TEST_IDS.validate_json(text)
    except ValidationError:
        raise ValueError("input should be the JSON text of a list of test ids") from None


#: SWE-bench exports store test lists as JSON text: format ``json-test-ids`` is the JSON text
#: of a list of test ids (non-empty for FAIL_TO_PASS); it is read as that list.
_TestIdsText = Annotated[str, Field(json_schema_extra={"format": "json-test-ids"}),
                         AfterValidator(_json_test_ids)]


class SweTaskModel(TaskModel):
    """A ``swe`` task (SWE-bench style): the repository from ``repo_path`` (a git repository on
    the daemon's host) or ``image`` (the instance's container image)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["repo_path"]}, {"required": ["image"]}]})

    kind: Literal["swe"]
    instance_id: NonBlank
    problem_statement: NonBlank
    base_commit: Annotated[str, Field(pattern=rf"^{_SAFE_REF.pattern}$")]
    test_patch: str = ""
    FAIL_TO_PASS: Annotated[_TestIds, Field(min_length=1)] | _TestIdsText
    PASS_TO_PASS: _TestIds | _TestIdsText = Field(default_factory=list)
    repo_path: AbsPath = omitted()  # this or image (not null)
    image: NonBlank = omitted()
    repo_dir: Annotated[str, Field(pattern="^/")] = "/testbed"
    python: Annotated[str, Field(pattern="^/")] = omitted()
    test_timeout_s: PositiveNumber = 120.0
    memory_mb: int = Field(2048, ge=64)
    tools: tools_type(KNOWN_TOOLS) = Field(default_factory=lambda: ["bash", "editor", "finish"])  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _checks(self) -> SweTaskModel:
        if self.repo_path is None and self.image is None:
            raise ValueError("give 'repo_path' (a git repository on the daemon's host) "
                             "or 'image' (the instance's container image)")
        if not self.FAIL_TO_PASS:
            raise ValueError("'FAIL_TO_PASS' must list at least one test")
        if "id" not in (self.model_extra or {}):
            self.id = self.instance_id  # the trajectory's task_id
        return self


class SweTask(TaskHandler):
    kind = "swe"
    task_model = SweTaskModel

    # ---- INIT ---------------------------------------------------------------------

    def sandbox_spec(self, task: dict[str, Any]) -> SandboxSpec:
        if task.get("image") is not None:
            return SandboxSpec(image=task["image"], memory_mb=task["memory_mb"],
                               pids_max=512, python=task.get("python"))
        path = task["repo_path"]
        return SandboxSpec(memory_mb=task["memory_mb"], pids_max=512, python=task.get("python"),
                           binds=[Bind(host=path, dest=path, readonly=True)])

    @staticmethod
    def _source(task: dict[str, Any]) -> str:
        return str(task["repo_dir"] if task.get("image") is not None else task["repo_path"])

    async def _git(self, sb: Sandbox, args: list[str], *, cwd: str | None = None,
                   what: str) -> None:
        res = await sb.run([*_GIT, *args], timeout_s=GIT_TIMEOUT_S, cwd=cwd)
        if res.exit_code != 0:
            raise RuntimeError(f"swe task: {what} failed ({describe_run(res)})")

    async def _checkout(self, sb: Sandbox, task: dict[str, Any], dest: str) -> None:
        """Clone the repository into ``dest`` (relative to the workdir) at base_commit."""
        source, base = self._source(task), task["base_commit"]
        await self._git(sb, ["clone", "--quiet", "--no-hardlinks", "--no-checkout", "--", source, dest],
                        what=f"cloning {source}")
        await self._git(sb, ["checkout", "--quiet", "--detach", base, "--"], cwd=dest,
                        what=f"checking out base_commit {base}")
        await sb.write_file(f"{dest}/.git/info/exclude", ("\n".join(EXCLUDES) + "\n").encode())

    async def setup(self, sandbox: Sandbox | None, task: dict[str, Any]) -> None:
        assert sandbox is not None
        await self._checkout(sandbox, task, ".")

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(
            messages=[
                {"role": "system", "content": SYSTEM.format(workdir="/workspace")},
                {"role": "user", "content": "<issue>\n" + task["problem_statement"].strip() + "\n</issue>"},
            ],
            tools=list(task["tools"]),
        )

    # ---- EVAL ---------------------------------------------------------------------

    async def model_patch(self, sb: Sandbox, task: dict[str, Any]) -> tuple[str | None, str]:
        """``git diff`` of the workspace against base_commit, or (None, why) if there is none."""
        add = await sb.run([*_GIT, "add", "-A", "."], timeout_s=GIT_TIMEOUT_S)
        if add.exit_code != 0:
            return None, f"git add failed in the workspace ({describe_run(add)})"
        diff = await sb.run([*_GIT, "diff", "--cached", "--binary", "--no-color", task["base_commit"]],
                            timeout_s=GIT_TIMEOUT_S, max_output_bytes=MAX_PATCH_BYTES)
        if diff.exit_code != 0:
            return None, f"git diff failed in the workspace ({describe_run(diff)})"
        if diff.truncated:
            return None, f"the patch is larger than {MAX_PATCH_BYTES} bytes"
        return diff.stdout.decode(errors="replace"), ""

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        if ctx.sandbox is None:
            raise RuntimeError("swe task: the rollout's sandbox is gone; no patch to evaluate")
        patch, why = await self.model_patch(ctx.sandbox, task)
        info: dict[str, Any] = {"resolved": False, "patch": patch or "", "patch_applied": False,
                                "instance_id": task["instance_id"]}
        if patch is None:
            return Reward(0.0, {**info, "reason": why})
        if not patch.strip():
            return Reward(0.0, {**info, "reason": "empty_patch"})
        async with ctx.open_sandbox(self.sandbox_spec(task)) as sb:
            applied, detail = await self._prepare_eval(sb, task, patch)
            if not applied:
                return Reward(0.0, {**info, "reason": "patch_does_not_apply", "apply_output": detail})
            info["patch_applied"] = True
            outcome = await self._run_tests(sb, task)
        f2p = {t: outcome["results"].get(t, "missing") for t in task["FAIL_TO_PASS"]}
        p2p = {t: outcome["results"].get(t, "missing") for t in task["PASS_TO_PASS"]}
        resolved = all(v == "passed" for v in (*f2p.values(), *p2p.values()))
        info.update(resolved=resolved, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p,
                    runner=outcome.get("runner"), test_seconds=outcome.get("seconds"))
        if outcome.get("timed_out"):
            info["reason"] = "tests_timed_out"
        if not resolved:
            info["test_output"] = outcome.get("output", "")
        return Reward(1.0 if resolved else 0.0, info)

    async def _prepare_eval(self, sb: Sandbox, task: dict[str, Any], patch: str) -> tuple[bool, str]:
        """Fresh checkout + model patch + test patch. (False, output) if the model's patch fails."""
        await self._checkout(sb, task, EVAL_REPO)
        await sb.write_file(MODEL_PATCH, patch.encode())
        res = await sb.run([*_GIT, "apply", "--whitespace=nowarn", "--binary", f"../{MODEL_PATCH}"],
                           cwd=EVAL_REPO, timeout_s=GIT_TIMEOUT_S)
        if res.exit_code != 0:
            return False, tail(res.stderr or res.stdout, 1000)
        test_patch = task["test_patch"]
        if test_patch.strip():
            files = patch_files(test_patch)
            if files:
                # The hidden tests win over whatever the model did to those files.
                reset = ('base=$1; shift; for f in "$@"; do '
                         'git -c safe.directory="*" checkout -q "$base" -- "$f" 2>/dev/null '
                         '|| rm -f -- "$f"; done')
                await sb.run(["sh", "-c", reset, "sh", task["base_commit"], *files],
                             cwd=EVAL_REPO, timeout_s=GIT_TIMEOUT_S)
            await sb.write_file(TEST_PATCH, test_patch.encode())
            await self._git(sb, ["apply", "--whitespace=nowarn", f"../{TEST_PATCH}"], cwd=EVAL_REPO,
                            what="applying the task's test_patch")
        await sb.write_file(RUNNER_FILE, RUNNER_SOURCE.read_bytes())
        return True, ""

    async def _run_tests(self, sb: Sandbox, task: dict[str, Any]) -> dict[str, Any]:
        tests = list(dict.fromkeys([*task["FAIL_TO_PASS"], *task["PASS_TO_PASS"]]))
        argv = runner_argv(sb.python, f"../{RUNNER_FILE}", tests=tests, paths=[],
                           out=f"../{RESULT_FILE}")
        res = await sb.run(argv, cwd=EVAL_REPO, timeout_s=task["test_timeout_s"],
                           max_output_bytes=500_000)
        output = tail(res.stdout + res.stderr)
        if res.timed_out:
            return {"results": {}, "timed_out": True, "output": output, "seconds": res.duration_s}
        try:
            data = read_runner_output(await sb.read_file(RESULT_FILE))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"swe task: the test runner failed ({exc}): {output}") from None
        return {**data, "output": output, "seconds": round(res.duration_s, 3)}
