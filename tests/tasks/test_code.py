"""code: right and wrong solutions through the real pipeline, real sandboxes, scripted policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.code import CodeTask, normalise_output, plugins_autoload
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.trajectory import Status
from rolloutd.sandbox import SandboxSpec

from .conftest import tool_call

SUM = {
    "kind": "code", "id": "sum",
    "prompt": "Read two integers and print their sum.",
    "tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "-5 5\n", "stdout": "0"},
              {"stdin": "10 20\n", "stdout": "30\n"}],
}
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
HALF_RIGHT = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)\n"


def write_and_finish(source: str, path: str = "solution.py", *, try_it: bool = True) -> list[str]:
    check = f"\npython3 {path} <<< '2 3'" if try_it else ""
    return [
        tool_call("bash", command=f"cat > {path} <<'EOF'\n{source}EOF{check}"),
        tool_call("finish", answer="done"),
    ]


async def test_right_solution(harness):
    await harness.script(write_and_finish(RIGHT))
    tr = await harness.run(SUM)
    assert tr.status is Status.completed, tr.error
    assert tr.reward == 1.0, tr.reward_info
    info = tr.reward_info
    assert info["passed"] == info["total"] == 3 and info["solution_from"] == "workspace"
    # the agent really ran its program in the sandbox
    assert "5" in tr.messages[3]["content"]


async def test_partly_wrong_solution_fraction_and_all(harness):
    await harness.script(write_and_finish(HALF_RIGHT))
    tr = await harness.run(SUM)
    assert tr.status is Status.completed and tr.usable
    assert tr.reward == pytest.approx(2 / 3)
    failed = [t for t in tr.reward_info["tests"] if not t["passed"]]
    assert [t["case"] for t in failed] == [1] and failed[0]["stdout"].strip() == "99"

    tr = await harness.run({**SUM, "reward": "all"})
    assert tr.reward == 0.0 and tr.reward_info["passed"] == 2


async def test_solution_from_code_block_when_no_file(harness):
    await harness.script([f"Here it is:\n```python\n{RIGHT}```"])
    tr = await harness.run(SUM)
    assert tr.reward == 1.0
    assert tr.reward_info["solution_from"] == "final_answer_code_block"


async def test_no_solution_scores_zero(harness):
    await harness.script(["I give up."])
    tr = await harness.run(SUM)
    assert tr.status is Status.completed and tr.usable and tr.reward == 0.0
    assert tr.reward_info["reason"] == "no_solution"


async def test_time_limit_per_case(harness):
    await harness.script(write_and_finish("while True:\n    pass\n", try_it=False))
    tr = await harness.run({**SUM, "tests": SUM["tests"][:1], "timeout_s": 1})
    assert tr.status is Status.completed and tr.reward == 0.0
    assert tr.reward_info["tests"][0]["timed_out"] is True


PYTEST_TASK = {
    "kind": "code", "id": "add-fn", "prompt": "Define add(a, b) in solution.py.",
    "pytest": "from solution import add\n\ndef test_ints():\n    assert add(1, 2) == 3\n\n"
              "def test_strs():\n    assert add('a', 'b') == 'ab'\n",
}


async def test_pytest_file_right_and_wrong(harness):
    await harness.script(write_and_finish("def add(a, b):\n    return a + b\n"))
    tr = await harness.run(PYTEST_TASK)
    assert tr.reward == 1.0, tr.reward_info
    assert {t["test"] for t in tr.reward_info["tests"]} == {
        "test_solution.py::test_ints", "test_solution.py::test_strs"}

    await harness.script(write_and_finish("def add(a, b):\n    return int(a) + int(b)\n"))
    tr = await harness.run(PYTEST_TASK)
    assert tr.status is Status.completed and tr.reward == 0.5
    assert "output" in tr.reward_info


PLUGIN_PROBE = (
    "import sys\n\n"
    "def test_probe():\n"
    "    from solution import add\n"
    "    assert add(1, 2) == 3\n"
    "    assert ('pytest_trio' in sys.modules) == {loaded}\n"
)


@pytest.mark.parametrize(("mode", "loaded"), [("auto", False), ("none", False),
                                              ("installed", True)])
async def test_pytest_plugins_of_the_daemons_interpreter(harness, mode, loaded):
    """On the host the EVAL interpreter is the daemon's, whose installed plugins (here
    pytest-trio, a dev extra) are not the task's: ``auto`` leaves them out, ``installed``
    loads them."""
    await harness.script(write_and_finish("def add(a, b):\n    return a + b\n"))
    task = {**PYTEST_TASK, "pytest": PLUGIN_PROBE.format(loaded=loaded), "pytest_plugins": mode}
    tr = await harness.run(task)
    assert tr.reward == 1.0, tr.reward_info


def test_pytest_plugins_auto_loads_them_in_an_image():
    class Box:  # TEST DOUBLE: only the spec of a sandbox
        def __init__(self, image: str | None) -> None:
            self.spec = SandboxSpec(image=image)

    assert plugins_autoload("auto", Box("oci:/images/x:latest"))  # type: ignore[arg-type]
    assert not plugins_autoload("auto", Box(None))  # type: ignore[arg-type]
    assert not plugins_autoload("none", Box("oci:/images/x:latest"))  # type: ignore[arg-type]
    assert plugins_autoload("installed", Box(None))  # type: ignore[arg-type]


async def test_files_in_directories_are_written(harness):
    """``files`` may name nested paths: their directories are made first."""
    await harness.script(write_and_finish("from pkg.helper import plus\n\ndef add(a, b):\n    return plus(a, b)\n"))
    task = {**PYTEST_TASK, "files": {"pkg/__init__.py": "", "pkg/helper.py": "def plus(a, b):\n    return a + b\n"}}
    tr = await harness.run(task)
    assert tr.status is Status.completed and tr.reward == 1.0, (tr.error, tr.reward_info)


def test_normalise_output():
    assert normalise_output("3  \n\n") == normalise_output("3")
    assert normalise_output("a\r\nb\n") == "a\nb"
    assert normalise_output("a\n\nb") != normalise_output("a\nb")


@pytest.mark.parametrize("bad, needle", [
    ({"kind": "code", "tests": [{"stdout": "1"}]}, "prompt"),
    ({"kind": "code", "prompt": "p"}, "exactly one of"),
    ({"kind": "code", "prompt": "p", "tests": [{"stdin": 1, "stdout": "1"}]}, r"tests\[0\]"),
    ({"kind": "code", "prompt": "p", "tests": [{"stdout": "1"}], "reward": "max"}, "reward"),
    ({"kind": "code", "prompt": "p", "tests": [{"stdout": "1"}], "entry": "../x.py"}, "entry"),
    ({"kind": "code", "prompt": "p", "pytest": "x", "files": {"/etc/x": ""}}, "files"),
    ({"kind": "code", "prompt": "p", "pytest": "x", "timeout_s": 0}, "timeout_s"),
])
def test_validate_names_the_field(bad, needle):
    with pytest.raises(TaskError, match=needle):
        CodeTask().validate(bad)


def test_example_code_tasks_are_valid(repo_root: Path):
    reg = TaskRegistry.default()
    lines = (repo_root / "examples/tasks/code.jsonl").read_text().splitlines()
    assert len(lines) >= 10
    for line in lines:
        reg.get("code").validate(json.loads(line))
