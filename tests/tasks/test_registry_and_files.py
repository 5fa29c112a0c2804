"""The registry (built-in kinds, entry points), task files, and the in-sandbox test runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

import rolloutd.daemon.tasks.registry as registry_mod
from rolloutd.daemon.tasks._common import RUNNER_SOURCE
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskError, TaskHandler
from rolloutd.daemon.tasks.jsonl import TaskFileError, load_tasks, parse_tasks
from rolloutd.daemon.tasks.registry import TaskRegistry


class EchoTask(TaskHandler):
    """A third-party handler, as a plugin package would ship it."""

    kind = "echo"

    def validate(self, task: dict[str, Any]) -> dict[str, Any]:
        return dict(task)

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(messages=[{"role": "user", "content": "echo"}])

    async def evaluate(self, task, trajectory, ctx: EvalContext) -> Reward:
        return Reward(1.0)


def test_builtin_kinds():
    assert {"math", "code", "swe", "sleep"} <= set(TaskRegistry.default().kinds)


def test_entry_point_handler_is_loaded(monkeypatch):
    seen: list[str] = []

    def fake_entry_points(*, group: str):
        seen.append(group)
        return [EntryPoint(name="echo", value=f"{__name__}:EchoTask", group=group),
                EntryPoint(name="broken", value="no_such_module_xyz:Nope", group=group)]

    monkeypatch.setattr(registry_mod, "entry_points", fake_entry_points)
    reg = TaskRegistry.default()
    assert seen == ["rolloutd.tasks"]
    assert isinstance(reg.get("echo"), EchoTask)
    assert "broken" not in reg.kinds  # logged, not fatal
    with pytest.raises(TaskError, match=r"unknown task kind 'nope'; known kinds: .*echo"):
        reg.get("nope")


def test_task_file_errors_name_the_line(tmp_path: Path):
    reg = TaskRegistry.default()
    good = json.dumps({"kind": "math", "question": "1+1?", "answer": "2"})
    cases = {
        "not json": "not valid JSON",
        "[1, 2]": "must be a JSON object",
        '{"question": "q"}': "no string 'kind'",
        '{"kind": "nope"}': "unknown task kind 'nope'",
        '{"kind": "math", "question": "q"}': "math task: missing field|'answer'",
    }
    for line, needle in cases.items():
        path = tmp_path / "tasks.jsonl"
        path.write_text(f"{good}\n\n# a comment\n{line}\n{good}\n")
        with pytest.raises(TaskFileError, match=rf"^{path}:4: .*({needle})"):
            load_tasks(path, registry=reg)
    assert len(parse_tasks(f"{good}\n{good}\n", registry=reg)) == 2
    with pytest.raises(TaskFileError, match="no tasks"):
        parse_tasks("\n")
    with pytest.raises(TaskFileError, match="cannot read"):
        load_tasks(tmp_path / "missing.jsonl")


def test_example_files_load(repo_root: Path):
    reg = TaskRegistry.default()
    for name in ("math.jsonl", "code.jsonl"):
        assert load_tasks(repo_root / "examples/tasks" / name, registry=reg)


def test_make_swe_repos_script(tmp_path: Path, repo_root: Path):
    out = subprocess.run([sys.executable, str(repo_root / "examples/make_swe_repos.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "wrote 3 tasks" in out.stdout
    tasks = load_tasks(tmp_path / "swe.jsonl", registry=TaskRegistry.default())
    assert len(tasks) >= 3
    for task in tasks:
        assert task["test_patch"].startswith("diff --git") and task["patch"].startswith("diff --git")
        assert (Path(task["repo_path"]) / ".git").is_dir()


@pytest.mark.parametrize("runner", ["pytest", "builtin"])
def test_runner_reports_each_test(tmp_path: Path, runner: str):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("def inc(x):\n    return x + 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_a.py").write_text(
        "from pkg import inc\n\ndef test_ok():\n    assert inc(1) == 2\n\n"
        "def test_bad():\n    assert inc(1) == 3\n\nclass TestC:\n    def test_m(self):\n        assert True\n")
    (tmp_path / "tests/test_broken.py").write_text("import nothing_here_xyz\n\ndef test_x():\n    pass\n")
    tests = ["tests/test_a.py::test_ok", "tests/test_a.py::test_bad", "tests/test_a.py::TestC::test_m",
             "tests/test_a.py::test_gone", "tests/test_broken.py::test_x"]
    env = {**os.environ, "ROLLOUTD_TEST_RUNNER": runner}
    subprocess.run([sys.executable, str(RUNNER_SOURCE),
                    json.dumps({"tests": tests, "paths": [], "out": "r.json"})],
                   cwd=tmp_path, env=env, capture_output=True, check=False, timeout=60)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["runner"] == runner
    res = data["results"]
    assert [res[t] for t in tests] == ["passed", "failed", "passed", "missing", "error"]


def test_unknown_kind_is_a_422_naming_the_known_kinds(tmp_path: Path):
    from rolloutd.daemon.api import ANSWERS
    from rolloutd.daemon.config import Settings
    from rolloutd.daemon.errors import InvalidTask
    from rolloutd.daemon.node import Node
    from rolloutd.daemon.pipeline import Services
    from rolloutd.daemon.service import RolloutRequest

    node = Node(Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c", port=0),
                services=Services())
    with pytest.raises(InvalidTask) as err:
        node.submit(RolloutRequest(task={"kind": "chess"}))
    assert ANSWERS[InvalidTask] == (422, "invalid_task")
    assert "unknown task kind 'chess'" in str(err.value)
    for kind in ("code", "math", "swe"):
        assert kind in str(err.value)
    with pytest.raises(InvalidTask, match="math task: 'answer'"):
        node.submit(RolloutRequest(task={"kind": "math", "question": "q"}))
