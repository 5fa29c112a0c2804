"""``swe``: a SWE-bench-style instance. The agent edits a repository; hidden tests judge it,
as the official SWE-bench harness judges them, in the environment the agent worked in.

Task fields (SWE-bench / SWE-Gym / SWE-smith export names; see docs/tasks.md)::

    {"kind": "swe", "instance_id": "django__django-11099", "repo": "django/django",
     "version": "3.0", "base_commit": "<sha or branch>", "problem_statement": "<the issue>",
     "test_patch": "<diff adding the hidden tests>",
     "FAIL_TO_PASS": ["test_x (module.Class)"],     # a list, or a JSON-encoded list
     "PASS_TO_PASS": [...],
     "image": "docker://swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
     "repo_dir": "/testbed",                         # the repository inside the image
     # or "repo_path": "/abs/host/repo"              # a git repository on the daemon's host
     # optional evaluation spec (else the harness's spec for repo/version, else pytest):
     "eval_script": "...", "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
     "test_cmd": "...", "test_directives": "path", "eval_commands": ["export ..."],
     "env_setup": "source /opt/miniconda3/bin/activate && conda activate testbed",
     "test_timeout_s": 900, "memory_mb": 4096, "tools": ["bash", "editor", "finish"]}

One environment. With an ``image`` the agent works in place, in ``repo_dir`` inside the
image (the image's build artefacts, interpreter and installed packages included): INIT runs
``env_setup`` (default: SWE-bench's ``testbed`` conda env where the image has one) and every
later process of the sandbox, the agent's shell, IPython and EVAL alike, gets the environment
it made; the repository is put at ``base_commit`` (SWE-smith's instance branches too). With
``repo_path`` INIT clones the host repository into the workspace (the agent's cwd). Files
untracked at INIT (build artefacts) are excluded from the agent's patch.

EVAL evaluates in place, never re-cloning: it stops whatever the agent left running, records
the agent's diff against ``base_commit``, checks that the test patch applies to the base
versions of its files, then runs the eval script (``_swe_specs``: reset those files, apply
the test patch, run the test command on them between the harness's markers) and grades the
log as the harness does (``_swe_grading``; with the ``swebench`` package when installed).
resolved = RESOLVED_FULL; reward 1.0 or 0.0. ``reward_info`` holds the patch, every listed
test's outcome, the harness report, the spec used, the test exit status and the log's tail.

The model's failures (reward 0, usable): an empty patch, a repository the agent broke,
failing tests, tests that time out, tests its patch kept from running (the log names a file
the patch touches). Not the model's (status ``failed``, usable false, ``error.type``):
``env_setup_failed``, ``base_commit_missing``, ``test_patch_failed``, ``eval_script_failed``
(the script never reached its tests), ``test_command_failed`` (not found / not executable),
``tests_not_found`` (listed tests the parser cannot find, with nothing of the patch's in the
log: a test id in another form than the runner prints, or a wrong parser).
"""

from __future__ import annotations

import functools
import posixpath
import re
from typing import Annotated, Any, Literal

import trio
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
    AbsPath,
    NonBlank,
    PositiveNumber,
    TaskModel,
    describe_run,
    omitted,
    tail,
    tools_type,
)
from rolloutd.daemon.tasks._swe_grading import Grade, grade, swebench_parsers
from rolloutd.daemon.tasks._swe_parsers import PARSERS
from rolloutd.daemon.tasks._swe_specs import (
    DEFAULT_ENV_SETUP,
    EvalSpec,
    build_script,
    eval_spec,
    listed_files,
    reset_command,
    touched_files,
)
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskFailure, TaskHandler
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.sandbox import Bind, Sandbox, SandboxSpec

GIT_TIMEOUT_S = 120.0
#: Junk the agent's tools leave in the workspace (it is also their HOME): never part of a patch.
EXCLUDES = (".bash_history", ".python_history", ".ipython/", ".jupyter/", ".local/", ".cache/",
            ".config/", ".gitconfig", ".viminfo", "__pycache__/", "*.pyc", ".pytest_cache/")
#: Where EVAL keeps its script, the test patch and the log (outside the repository).
EVAL_DIR = "/tmp/.rolloutd-eval"
MAX_PATCH_BYTES = 5_000_000
MAX_LOG_BYTES = 64_000_000
LOG_TAIL_CHARS = 6000
FULL_LOG_CHARS = 1_000_000
#: Variables a shell or the sandbox's helper sets for itself: not part of an activated
#: environment (ROLLOUTD_RUN differs per command: it marks what a run leaves behind).
_SHELL_OWN = frozenset({"_", "SHLVL", "PWD", "OLDPWD", "PS1", "PS2", "PS4", "ROLLOUTD_RUN",
                        "ROLLOUTD_SANDBOX"})

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


#: The harness's parser names: the built-in ones, and the installed swebench's.
PARSER_NAMES = tuple(sorted({*PARSERS, *swebench_parsers()}))


class SweTaskModel(TaskModel):
    """A ``swe`` task (SWE-bench style): the repository from ``image`` (the instance's
    container image, the repository at ``repo_dir``) or ``repo_path`` (a git repository on the
    daemon's host)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["repo_path"]}, {"required": ["image"]}]})

    kind: Literal["swe"]
    instance_id: NonBlank
    problem_statement: NonBlank
    base_commit: Annotated[str, Field(pattern=rf"^{_SAFE_REF.pattern}$")]
    test_patch: str = ""
    FAIL_TO_PASS: Annotated[_TestIds, Field(min_length=1)] | _TestIdsText
    PASS_TO_PASS: _TestIds | _TestIdsText = Field(default_factory=list)
    repo: NonBlank = omitted()
    version: str = omitted()
    repo_path: AbsPath = omitted()  # this or image (not null)
    image: NonBlank = omitted()
    repo_dir: Annotated[str, Field(pattern="^/[^\x00/][^\x00]*$")] = "/testbed"
    python: Annotated[str, Field(pattern="^/")] = omitted()
    env_setup: str = omitted()
    eval_script: NonBlank = omitted()
    log_parser: Literal[PARSER_NAMES] = omitted()  # type: ignore[valid-type]
    eval_type: Literal["pass_and_fail", "fail_only"] = omitted()
    test_cmd: NonBlank = omitted()
    test_directives: Literal["path", "module", "django", "none"] = omitted()
    eval_commands: list[str] = omitted()
    test_timeout_s: PositiveNumber = 900.0
    memory_mb: int = Field(2048, ge=64)
    tools: tools_type(KNOWN_TOOLS) = Field(default_factory=lambda: ["bash", "editor", "finish"])  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _checks(self) -> SweTaskModel:
        if self.repo_path is None and self.image is None:
            raise ValueError("give 'image' (the instance's container image) "
                             "or 'repo_path' (a git repository on the daemon's host)")
        if not self.FAIL_TO_PASS:
            raise ValueError("'FAIL_TO_PASS' must list at least one test")
        if "id" not in (self.model_extra or {}):
            self.id = self.instance_id  # the trajectory's task_id
        return self


def _environ(raw: bytes) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.decode(errors="replace").partition("=")
        if sep and name:
            env[name] = value
    return env


class SweTask(TaskHandler):
    kind = "swe"
    task_model = SweTaskModel

    # ---- INIT ---------------------------------------------------------------------

    def sandbox_spec(self, task: dict[str, Any]) -> SandboxSpec:
        if task.get("image") is not None:
            return SandboxSpec(image=task["image"], memory_mb=task["memory_mb"], pids_max=1024,
                               python=task.get("python"), cwd=task["repo_dir"])
        path = task["repo_path"]
        return SandboxSpec(memory_mb=task["memory_mb"], pids_max=1024, python=task.get("python"),
                           binds=[Bind(host=path, dest=path, readonly=True)])

    @staticmethod
    def _repo(task: dict[str, Any], sb: Sandbox) -> str:
        """The repository the agent works in and EVAL judges."""
        return str(task["repo_dir"]) if task.get("image") is not None else sb.workdir

    async def _git(self, sb: Sandbox, args: list[str], *, cwd: str, what: str,
                   etype: str = "") -> str:
        res = await sb.run([*_GIT, *args], timeout_s=GIT_TIMEOUT_S, cwd=cwd)
        if res.exit_code != 0:
            message = f"swe task: {what} failed ({describe_run(res)})"
            if etype:
                raise TaskFailure(etype, message)
            raise RuntimeError(message)
        return res.stdout.decode(errors="replace").strip()

    async def _activate(self, sb: Sandbox, task: dict[str, Any]) -> None:
        """Run ``env_setup`` once; the environment it makes becomes the sandbox's."""
        setup = task.get("env_setup")
        if setup is None:
            setup = DEFAULT_ENV_SETUP if task.get("image") is not None else ""
        if not setup.strip():
            return
        script = f"{setup}\nrolloutd_rc=$?\n[ $rolloutd_rc -eq 0 ] || exit $rolloutd_rc\nexec env -0"
        shell = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; else exec sh -c "$1"; fi'
        before = await sb.run(["env", "-0"], timeout_s=GIT_TIMEOUT_S)
        after = await sb.run(["sh", "-c", shell, "sh", script], timeout_s=GIT_TIMEOUT_S,
                             cwd=self._repo(task, sb))
        if before.exit_code != 0 or after.exit_code != 0:
            raise TaskFailure("env_setup_failed", f"swe task: env_setup failed ({describe_run(after)})")
        old, new = _environ(before.stdout), _environ(after.stdout)
        changed = {k: v for k, v in new.items() if old.get(k) != v and k not in _SHELL_OWN}
        gone = [k for k in old if k not in new and k not in _SHELL_OWN]
        if changed or gone:
            await sb.set_env(changed, unset=gone)

    async def _at_base(self, sb: Sandbox, task: dict[str, Any], repo: str) -> None:
        """Put the image's repository at base_commit (a commit or a branch such as
        SWE-smith's instance branches), in place."""
        base = task["base_commit"]
        want = await self._git(sb, ["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"],
                               cwd=repo, what=f"finding base_commit {base} in {repo}",
                               etype="base_commit_missing")
        head = await sb.run([*_GIT, "rev-parse", "--verify", "--quiet", "HEAD"], cwd=repo,
                            timeout_s=GIT_TIMEOUT_S)
        if head.stdout.decode().strip() != want:
            await self._git(sb, ["checkout", "--quiet", "--force", "--detach", want, "--"],
                            cwd=repo, what=f"checking out base_commit {base}",
                            etype="base_commit_missing")

    async def _clone(self, sb: Sandbox, task: dict[str, Any]) -> None:
        """Clone the host repository into the workspace at base_commit."""
        source, base, repo = task["repo_path"], task["base_commit"], sb.workdir
        await self._git(sb, ["clone", "--quiet", "--no-hardlinks", "--no-checkout", "--", source, "."],
                        cwd=repo, what=f"cloning {source}")
        await self._git(sb, ["checkout", "--quiet", "--detach", base, "--"], cwd=repo,
                        what=f"checking out base_commit {base}", etype="base_commit_missing")

    async def _exclude_untracked(self, sb: Sandbox, repo: str) -> None:
        """What is untracked now (build artefacts, generated files) and the tools' junk never
        enter the agent's patch: git's info/exclude lists them."""
        listed = await sb.run([*_GIT, "ls-files", "--others", "--exclude-standard", "--directory", "-z"],
                              cwd=repo, timeout_s=GIT_TIMEOUT_S, max_output_bytes=MAX_PATCH_BYTES)
        exclude = await self._git(sb, ["rev-parse", "--git-path", "info/exclude"], cwd=repo,
                                  what="finding .git/info/exclude")
        path = posixpath.join(repo, exclude)
        old = b""
        if await sb.stat(path) is not None:
            old = await sb.read_file(path)
        untracked = [p for p in listed.stdout.decode(errors="replace").split("\0") if p]
        lines = [*EXCLUDES, *("/" + re.sub(r"([\\*?\[!#])", r"\\\1", p) for p in untracked)]
        await sb.mkdir(posixpath.dirname(path))
        await sb.write_file(path, old + ("\n" + "\n".join(lines) + "\n").encode())

    async def setup(self, sandbox: Sandbox | None, task: dict[str, Any]) -> None:
        assert sandbox is not None
        repo = self._repo(task, sandbox)
        await self._activate(sandbox, task)
        if task.get("image") is not None:
            await self._at_base(sandbox, task, repo)
        else:
            await self._clone(sandbox, task)
        await self._exclude_untracked(sandbox, repo)

    def prompt(self, task: dict[str, Any]) -> Prompt:
        workdir = task["repo_dir"] if task.get("image") is not None else "/workspace"
        return Prompt(
            messages=[
                {"role": "system", "content": SYSTEM.format(workdir=workdir)},
                {"role": "user", "content": "<issue>\n" + task["problem_statement"].strip() + "\n</issue>"},
            ],
            tools=list(task["tools"]),
        )

    # ---- EVAL ---------------------------------------------------------------------

    async def model_patch(self, sb: Sandbox, task: dict[str, Any],
                          repo: str | None = None) -> tuple[str | None, str]:
        """``git diff`` of the repository against base_commit, or (None, why) if there is none."""
        repo = repo or self._repo(task, sb)
        add = await sb.run([*_GIT, "add", "-A", "."], cwd=repo, timeout_s=GIT_TIMEOUT_S)
        if add.exit_code != 0:
            return None, f"git add failed in the repository ({describe_run(add)})"
        diff = await sb.run([*_GIT, "diff", "--cached", "--binary", "--no-color", task["base_commit"]],
                            cwd=repo, timeout_s=GIT_TIMEOUT_S, max_output_bytes=MAX_PATCH_BYTES)
        await sb.run([*_GIT, "reset", "--quiet"], cwd=repo, timeout_s=GIT_TIMEOUT_S)
        if diff.exit_code != 0:
            return None, f"git diff failed in the repository ({describe_run(diff)})"
        if diff.truncated:
            return None, f"the patch is larger than {MAX_PATCH_BYTES} bytes"
        return diff.stdout.decode(errors="replace"), ""

    def _spec(self, task: dict[str, Any], sb: Sandbox) -> EvalSpec:
        python = task.get("python") or ("python3" if task.get("image") is not None else sb.python)
        return eval_spec(task, python=python)

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        sb = ctx.sandbox
        if sb is None:
            raise RuntimeError("swe task: the rollout's sandbox is gone; no patch to evaluate")
        await sb.kill_all()  # nothing the agent left running may touch what is judged
        repo = self._repo(task, sb)
        patch, why = await self.model_patch(sb, task, repo)
        info: dict[str, Any] = {"resolved": False, "patch": patch or "", "instance_id": task["instance_id"]}
        if patch is None:
            return Reward(0.0, {**info, "reason": why})
        if not patch.strip():
            return Reward(0.0, {**info, "reason": "empty_patch"})
        spec = self._spec(task, sb)
        info["eval_spec"] = {"source": spec.source, "test_cmd": spec.test_cmd,
                             "log_parser": spec.log_parser, "eval_type": spec.eval_type}
        files = touched_files(task["test_patch"])
        await sb.mkdir(EVAL_DIR)
        patch_path = await self._check_test_patch(sb, task, repo, files, info)
        script = build_script(spec, repo_dir=repo, base_commit=task["base_commit"],
                              env_setup=task.get("env_setup") or "", files=files,
                              test_patch_path=patch_path,
                              extra_targets=listed_files(spec, [*task["FAIL_TO_PASS"], *task["PASS_TO_PASS"]]))
        await sb.write_file(f"{EVAL_DIR}/eval.sh", script.encode())
        log_path = f"{EVAL_DIR}/eval.log"
        run = await sb.run(["sh", "-c", f"exec bash {EVAL_DIR}/eval.sh > {log_path} 2>&1"],
                           cwd=repo, timeout_s=task["test_timeout_s"])
        log = (await sb.read_file(log_path, max_bytes=MAX_LOG_BYTES)).decode(errors="replace") \
            if await sb.stat(log_path) is not None else ""
        info.update(eval_seconds=round(run.duration_s, 3), eval_log_tail=tail(log, LOG_TAIL_CHARS))
        if len(log) <= FULL_LOG_CHARS:  # whole, so anyone can grade it again
            info["eval_log"] = log
        if run.timed_out:
            return Reward(0.0, {**info, "reason": "tests_timed_out"})
        if run.exit_code == 127 and not log:
            raise TaskFailure("eval_script_failed", "swe task: the image has no bash to run the "
                              f"eval script ({describe_run(run)})", info)
        result = await trio.to_thread.run_sync(functools.partial(
            grade, log, parser=spec.log_parser, f2p=task["FAIL_TO_PASS"], p2p=task["PASS_TO_PASS"],
            eval_type=spec.eval_type, instance_id=task["instance_id"], repo=task.get("repo") or "",
            version=task.get("version") or "",
            use_swebench={"builtin": False, "swebench": True}.get(ctx.options.get("swe_grader", "auto"))))
        return self._judge(task, result, patch, log, info)

    async def _check_test_patch(self, sb: Sandbox, task: dict[str, Any], repo: str,
                                files: list[str], info: dict[str, Any]) -> str | None:
        """The test patch must apply to the base versions of its files (else the instance,
        not the model, is broken). Returns where it is written, or None if there is none."""
        test_patch = task["test_patch"]
        if not test_patch.strip():
            return None
        path = f"{EVAL_DIR}/test.patch"
        await sb.write_file(path, test_patch.encode())
        if files:
            await sb.run(["sh", "-c", reset_command(task["base_commit"], files)], cwd=repo,
                         timeout_s=GIT_TIMEOUT_S)
        check = await sb.run([*_GIT, "apply", "--check", path], cwd=repo, timeout_s=GIT_TIMEOUT_S)
        if check.exit_code != 0:
            raise TaskFailure("test_patch_failed", "swe task: the task's test_patch does not apply "
                              f"to base_commit ({describe_run(check)})",
                              {**info, "apply_output": tail(check.stderr or check.stdout, 2000)})
        return path

    def _judge(self, task: dict[str, Any], result: Grade, patch: str, log: str,
               info: dict[str, Any]) -> Reward:
        f2p, p2p = result.outcomes(task["FAIL_TO_PASS"]), result.outcomes(task["PASS_TO_PASS"])
        info.update(resolved=result.resolved, resolution=result.resolution, grader=result.grader,
                    FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, report=result.report,
                    test_exit_code=result.exit_code)
        if not result.markers:
            raise TaskFailure("eval_script_failed", "swe task: the eval script never reached its "
                              "tests (no test-output markers in the log)", info)
        if result.exit_code in (126, 127):
            raise TaskFailure("test_command_failed", "swe task: the test command could not be run "
                              f"(exit status {result.exit_code}: not found or not executable)", info)
        if result.missing:
            section = log.split(">>>>> Start Test Output", 1)[-1]
            if not any(f in section for f in patch_files(patch)):
                shown = ", ".join(result.missing[:3]) + (" ..." if len(result.missing) > 3 else "")
                raise TaskFailure("tests_not_found", f"swe task: the {info['eval_spec']['log_parser']} "
                                  f"parser found no result for {len(result.missing)} listed "
                                  f"test(s) ({shown}) and the log names no file of the patch", info)
            info["reason"] = "tests_not_run"  # the patch kept them from running
        elif not result.resolved:
            info["reason"] = "tests_failed"
        return Reward(1.0 if result.resolved else 0.0, info)
