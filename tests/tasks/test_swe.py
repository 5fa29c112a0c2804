"""swe: the full flow on generated repositories inside real sandboxes, scripted policy."""

from __future__ import annotations

import pytest

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.swe import SweTask, patch_files
from rolloutd.daemon.tasks.swe_examples import fixed_files
from rolloutd.daemon.trajectory import Status

from .conftest import BACKEND, tool_call

pytestmark = pytest.mark.slow


def by_id(tasks, instance_id):
    return next(dict(t) for t in tasks if t["instance_id"] == instance_id)


def write_files(files: dict[str, str]) -> str:
    return "\n".join(f"cat > {path} <<'EOF'\n{text}EOF" for path, text in files.items())


async def test_right_fix_with_bash_resolves(harness, swe_tasks):
    task = by_id(swe_tasks, "textkit-1")
    await harness.script([
        tool_call("bash", command="hostname; git status --short; cat textkit/slug.py"),
        tool_call("bash", command=write_files(fixed_files("textkit-1"))),
        tool_call("finish", answer="slugify now lower-cases"),
    ])
    tr = await harness.run(task)
    assert tr.status is Status.completed, tr.error
    info = tr.reward_info
    assert tr.reward == 1.0 and info["resolved"] is True, info.get("test_output")
    assert info["FAIL_TO_PASS"] == {"tests/test_slug.py::test_lowercase": "PASSED"}
    assert info["PASS_TO_PASS"] == {"tests/test_slug.py::test_spaces": "PASSED"}
    assert "+    words = text.strip().lower().split()" in info["patch"]
    assert info["resolution"] == "RESOLVED_FULL" and info["test_exit_code"] == 0
    assert info["eval_spec"]["log_parser"] == "parse_log_pytest"
    assert "PASSED tests/test_slug.py::test_lowercase" in info["eval_log_tail"]
    # INIT checked the repository out at base_commit, clean, in the workspace the agent works in
    first = tr.messages[3]["content"]
    assert "def slugify" in first and "??" not in first and " M " not in first
    if BACKEND == "bwrap":
        assert first.startswith("sandbox\n")  # the bwrap sandbox's hostname
    assert tr.task_id == "textkit-1"


async def test_right_fix_with_editor_resolves(harness, swe_tasks):
    task = by_id(swe_tasks, "mathx-1")
    await harness.script([
        tool_call("editor", command="str_replace", path="/workspace/mathx/core.py",
                  old_str="    if x > hi:\n        return lo", new_str="    if x > hi:\n        return hi"),
        tool_call("finish", answer="fixed"),
    ])
    tr = await harness.run(task)
    assert tr.status is Status.completed, tr.error
    assert tr.reward == 1.0, tr.reward_info
    # the hidden test lives in a new file added by the test patch
    assert tr.reward_info["FAIL_TO_PASS"] == {"tests/test_upper.py::test_above": "PASSED"}


async def test_wrong_fix_is_not_resolved(harness, swe_tasks):
    task = by_id(swe_tasks, "wordcount-1")
    wrong = {"wordcount/count.py": '"""Counting words."""\n\n\ndef count_words(text):\n'
                                   '    return len(text.strip().split(" "))\n'}
    # the agent also "fixes" the visible test file: EVAL resets it before the test patch
    await harness.script([
        tool_call("bash", command=write_files(wrong) + "\necho 'def test_fake(): pass' > tests/test_count.py"),
        tool_call("finish", answer="done"),
    ])
    tr = await harness.run(task)
    assert tr.status is Status.completed and tr.usable, tr.error
    info = tr.reward_info
    assert tr.reward == 0.0 and info["resolved"] is False and info["reason"] == "tests_failed"
    assert info["FAIL_TO_PASS"] == {"tests/test_count.py::test_repeated_spaces": "FAILED"}
    # and it breaks a test that passed before
    assert info["PASS_TO_PASS"] == {"tests/test_count.py::test_empty": "FAILED",
                                    "tests/test_count.py::test_simple": "PASSED"}
    assert info["report"]["PASS_TO_PASS"]["failure"] == ["tests/test_count.py::test_empty"]
    assert "tests/test_count.py" in info["patch"]


async def test_no_change_is_an_empty_patch(harness, swe_tasks):
    await harness.script([tool_call("bash", command="ls"), "I could not fix it."])
    tr = await harness.run(by_id(swe_tasks, "textkit-1"))
    assert tr.status is Status.completed and tr.usable
    assert tr.reward == 0.0 and tr.reward_info["reason"] == "empty_patch"


async def test_gold_patch_applies_and_tool_junk_is_excluded(harness, swe_tasks):
    task = by_id(swe_tasks, "mathx-1")
    # the known fix applied with git, plus the junk the tools leave in $HOME (= the workspace)
    await harness.script([
        tool_call("bash", command=f"git apply <<'EOF'\n{task['patch']}EOF\n"
                                  "echo x > .python_history; mkdir -p .ipython; echo x > .ipython/y"),
        tool_call("finish", answer="applied"),
    ])
    tr = await harness.run(task)
    assert tr.reward == 1.0, tr.reward_info
    assert patch_files(tr.reward_info["patch"]) == ["mathx/core.py"]


@pytest.mark.parametrize("where", [{"image": "/nonexistent/instance.sif"},
                                   {"repo_path": "/nonexistent/repo"}])
async def test_sandbox_that_cannot_start_fails_unusable(harness, swe_tasks, where):
    task = {k: v for k, v in by_id(swe_tasks, "textkit-1").items() if k != "repo_path"}
    await harness.script([tool_call("finish", answer="x")])
    tr = await harness.run({**task, **where})
    assert tr.status is Status.failed
    assert tr.usable is False and tr.reward is None
    assert tr.error is not None and tr.error.stage == "init"


def test_validate(swe_tasks):
    handler = SweTask()
    task = handler.validate(by_id(swe_tasks, "textkit-1"))
    assert task["id"] == "textkit-1"
    as_json = handler.validate({**task, "FAIL_TO_PASS": '["a::b"]', "PASS_TO_PASS": "[]"})
    assert as_json["FAIL_TO_PASS"] == ["a::b"] and as_json["PASS_TO_PASS"] == []
    for change, needle in [({"base_commit": "--upload-pack=x"}, "base_commit"),
                           ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS"),
                           ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS"),
                           ({"repo_path": "relative/path"}, "repo_path"),
                           ({"problem_statement": ""}, "problem_statement")]:
        with pytest.raises(TaskError, match=needle):
            handler.validate({**task, **change})
    with pytest.raises(TaskError, match="repo_path"):
        handler.validate({k: v for k, v in task.items() if k != "repo_path"})


# ---- never a silent 0: what is not the model's failure is failed and unusable ----------


async def fixed_run(harness, task):
    await harness.script([
        tool_call("bash", command=write_files(fixed_files(task["instance_id"]))),
        tool_call("finish", answer="fixed"),
    ])
    return await harness.run(task)


@pytest.mark.parametrize(("change", "etype"), [
    ({"FAIL_TO_PASS": ["test_lowercase (tests.test_slug.SlugTests)"]}, "tests_not_found"),
    ({"test_cmd": "no-such-test-runner"}, "test_command_failed"),
    ({"log_parser": "parse_log_django"}, "tests_not_found"),
])
async def test_what_evaluation_cannot_judge_is_failed_not_zero(harness, swe_tasks, change, etype):
    tr = await fixed_run(harness, {**by_id(swe_tasks, "textkit-1"), **change})
    assert tr.status is Status.failed and tr.usable is False and tr.reward is None, tr.error
    assert tr.error is not None and (tr.error.stage, tr.error.type) == ("eval", etype)
    # what EVAL found stays: the patch, the spec, the log
    assert "lower()" in tr.reward_info["patch"] and tr.reward_info["eval_log_tail"]


async def test_a_test_patch_that_does_not_apply_is_the_instances_failure(harness, swe_tasks):
    task = by_id(swe_tasks, "textkit-1")
    broken = task["test_patch"].replace('assert slugify("a b  c") == "a-b-c"', 'assert nothing()')
    tr = await fixed_run(harness, {**task, "test_patch": broken})
    assert tr.status is Status.failed and tr.usable is False
    assert tr.error.type == "test_patch_failed" and "apply_output" in tr.reward_info


async def test_a_patch_that_breaks_the_import_is_the_models_failure(harness, swe_tasks):
    task = by_id(swe_tasks, "textkit-1")
    await harness.script([
        tool_call("bash", command="echo 'def slugify(:' > textkit/slug.py"),
        tool_call("finish", answer="done"),
    ])
    tr = await harness.run(task)
    assert tr.status is Status.completed and tr.usable, tr.error
    assert tr.reward == 0.0 and tr.reward_info["reason"] == "tests_not_run"
    assert "textkit/slug.py" in tr.reward_info["eval_log_tail"]


async def test_env_setup_reaches_the_agents_shell_and_the_tests(harness, swe_tasks):
    task = {**by_id(swe_tasks, "textkit-1"), "env_setup": "export SWE_ENV=activated; cd /"}
    await harness.script([
        tool_call("bash", command="echo env=$SWE_ENV; pwd"),
        tool_call("bash", command=write_files(fixed_files("textkit-1"))),
        tool_call("finish", answer="fixed"),
    ])
    # EVAL's script stops before the tests if the variable is not there
    tr = await harness.run({**task, "eval_commands": ['test "$SWE_ENV" = activated || exit 9']})
    assert "env=activated" in tr.messages[3]["content"]
    assert "/workspace" in tr.messages[3]["content"]  # the agent still starts in its repo
    assert tr.status is Status.completed and tr.reward == 1.0, (tr.error, tr.reward_info)
    tr = await fixed_run(harness, {**task, "env_setup": "echo cannot activate >&2; exit 3"})
    assert tr.status is Status.failed and tr.error.stage == "init"
    assert tr.error.type == "env_setup_failed" and "cannot activate" in tr.error.message
