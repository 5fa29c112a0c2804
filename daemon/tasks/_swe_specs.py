"""How an SWE instance is evaluated: its test command, log parser and eval script.

The official SWE-bench harness runs, in the instance's container, a bash script that
activates the ``testbed`` environment, re-installs the package where the repository needs
it, resets the files the test patch touches, applies the test patch and runs the test
command on the test patch's files between two markers; a per-repository parser reads the
output between the markers. This module builds the same script, in place:

- a row that carries its own ``eval_script`` (swebench >= 5 datasets do, with ``log_parser``
  and ``eval_type``) is run as it is, with the test command's exit status recorded after the
  end marker as the harness records it;
- otherwise the task's ``test_cmd`` / ``log_parser`` / ``test_directives`` /
  ``eval_commands``, else :data:`REPOS` (the harness's command and parser for the common
  repositories, by version where they differ), else pytest.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

START = ">>>>> Start Test Output"
END = ">>>>> End Test Output"
EXIT = ">>>>> Test Exit Code"
_EXIT_VAR = "ROLLOUTD_TEST_EXIT_CODE"

#: SWE-bench images activate their conda env so; harmless where there is none.
DEFAULT_ENV_SETUP = ("if [ -f /opt/miniconda3/bin/activate ]; then "
                     "source /opt/miniconda3/bin/activate && conda activate testbed; fi")
#: Files of a test patch that are never test targets (the harness's NON_TEST_EXTS).
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                 ".yaml", ".toml")

Directives = Literal["path", "module", "django", "none"]
EvalType = Literal["pass_and_fail", "fail_only"]
_DIFF_FILE = re.compile(r"^diff --git a/.* b/(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class EvalSpec:
    """How one instance's tests run and are read."""

    test_cmd: str
    log_parser: str
    directives: Directives = "path"
    eval_commands: tuple[str, ...] = ()
    install: str | None = None
    eval_type: EvalType = "pass_and_fail"
    #: where the spec came from: "eval_script", "task", "table:<repo>", "default"
    source: str = "default"
    script: str | None = field(default=None, repr=False)  # a row's own eval_script


_PYTEST = "pytest -rA"
_DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
_LOCALE = ("export LANG=en_US.UTF-8", "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8")


def _django(version: str | None) -> EvalSpec:
    if version == "1.9":
        return EvalSpec("./tests/runtests.py --verbosity 2", "parse_log_django", "django")
    old = version is not None and _version_key(version) < (3, 0)
    return EvalSpec(_DJANGO, "parse_log_django", "django",
                    eval_commands=() if old else ("export PYTHONIOENCODING=utf8", *_LOCALE))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


#: repository -> spec (or a function of the instance's ``version``): the harness's test
#: command family and log parser for SWE-bench's Python repositories.
REPOS: dict[str, Any] = {
    "django/django": _django,
    "sympy/sympy": EvalSpec("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' "
                            "bin/test -C --verbose", "parse_log_sympy"),
    "sphinx-doc/sphinx": EvalSpec("tox --current-env -epy39 -v --", "parse_log_sphinx",
                                  eval_commands=("sed -i 's/pytest/pytest -rA/' tox.ini",)),
    "astropy/astropy": EvalSpec(_PYTEST, "parse_log_astropy",
                                install="python -m pip install -e .[test] --verbose"),
    "matplotlib/matplotlib": EvalSpec(_PYTEST, "parse_log_matplotlib",
                                      install="python -m pip install -e ."),
    "scikit-learn/scikit-learn": EvalSpec(
        _PYTEST, "parse_log_scikit",
        install="python -m pip install -v --no-use-pep517 --no-build-isolation -e ."),
    "mwaskom/seaborn": EvalSpec("pytest --no-header -rA", "parse_log_seaborn"),
    "pydata/xarray": EvalSpec(_PYTEST, "parse_log_xarray"),
    "pylint-dev/pylint": EvalSpec(_PYTEST, "parse_log_pylint"),
    "pylint-dev/astroid": EvalSpec(_PYTEST, "parse_log_astroid"),
    "pytest-dev/pytest": EvalSpec(_PYTEST, "parse_log_pytest"),
    "psf/requests": EvalSpec(_PYTEST, "parse_log_requests"),
    "pallets/flask": EvalSpec(_PYTEST, "parse_log_flask"),
    "marshmallow-code/marshmallow": EvalSpec(_PYTEST, "parse_log_marshmallow"),
    "pvlib/pvlib-python": EvalSpec(_PYTEST, "parse_log_pvlib"),
    "pyvista/pyvista": EvalSpec(_PYTEST, "parse_log_pyvista"),
    "pydicom/pydicom": EvalSpec(_PYTEST, "parse_log_pydicom"),
    "sqlfluff/sqlfluff": EvalSpec(_PYTEST, "parse_log_sqlfluff"),
}


def eval_spec(task: dict[str, Any], *, python: str) -> EvalSpec:
    """The spec a task is evaluated with (``python``: the interpreter of the default)."""
    if task.get("eval_script"):
        return EvalSpec("", task.get("log_parser") or "parse_log_pytest", "none",
                        eval_type=task.get("eval_type") or "pass_and_fail",
                        source="eval_script", script=task["eval_script"])
    entry = REPOS.get(str(task.get("repo") or ""))
    if callable(entry):
        base = entry(task.get("version"))
        base = replace(base, source=f"table:{task['repo']}")
    elif entry is not None:
        base = replace(entry, source=f"table:{task['repo']}")
    else:
        base = EvalSpec(f"{shlex.quote(python)} -m pytest -rA -p no:cacheprovider", "parse_log_pytest")
    own = {k: task[k] for k in ("test_cmd", "log_parser", "eval_type") if task.get(k)}
    if task.get("test_directives"):
        own["directives"] = task["test_directives"]
    if task.get("eval_commands"):
        own["eval_commands"] = tuple(task["eval_commands"])
    if own:
        base = replace(base, source="task", **own)
    return base


def touched_files(test_patch: str) -> list[str]:
    """The files a test patch touches (their new names), in order."""
    return list(dict.fromkeys(_DIFF_FILE.findall(test_patch)))


def directives(spec: EvalSpec, files: Sequence[str]) -> list[str]:
    """The test patch's files as the test command's targets (the harness's rule: files
    with a non-test extension are left out; Django takes dotted modules under tests/)."""
    if spec.directives == "none":
        return []
    out: list[str] = []
    for path in files:
        if path.endswith(NON_TEST_EXTS):
            continue
        if spec.directives in ("module", "django"):
            path = path[:-3] if path.endswith(".py") else path
            if spec.directives == "django" and path.startswith("tests/"):
                path = path[len("tests/"):]
            path = path.replace("/", ".")
        out.append(path)
    return out


def record_exit_code(script: str) -> str:
    """The script with the test command's exit status echoed after the end marker (what the
    harness adds to a dataset's eval script); unchanged if it has no end marker."""
    lines = script.split("\n")
    for i, line in enumerate(lines):
        if END in line:
            return "\n".join([*lines[:i], f"{_EXIT_VAR}=$?", line,
                              f'echo "{EXIT}: ${_EXIT_VAR}"', *lines[i + 1:]])
    return script


def reset_command(base_commit: str, files: Sequence[str]) -> str:
    """Put the files back as they are at ``base_commit``; delete those it does not have."""
    quoted = " ".join(shlex.quote(f) for f in files)
    return (f"for f in {quoted}; do git -c safe.directory='*' checkout -q "
            f"{shlex.quote(base_commit)} -- \"$f\" 2>/dev/null || rm -f -- \"$f\"; done")


def listed_files(spec: EvalSpec, tests: Sequence[str]) -> list[str]:
    """The files of listed pytest ids (``path::name``) for a ``path`` spec: run with the test
    patch's files, so a listed test outside them (or a dataset with no test patch, such as
    SWE-smith's) is run too. SWE-bench's lists name only the test patch's files."""
    if spec.directives != "path":
        return []
    return list(dict.fromkeys(t.split("::", 1)[0] for t in tests if "::" in t))


def build_script(spec: EvalSpec, *, repo_dir: str, base_commit: str, env_setup: str,
                 files: Sequence[str], test_patch_path: str | None,
                 extra_targets: Sequence[str] = ()) -> str:
    """The eval script, run from ``repo_dir`` with bash; its output is the eval log."""
    if spec.script is not None:
        return record_exit_code(spec.script)
    git = "git -c safe.directory='*' -c core.fileMode=false"
    lines = ["#!/bin/bash", "set -uxo pipefail", env_setup, f"cd {shlex.quote(repo_dir)}",
             *spec.eval_commands, f"{git} status", f"{git} diff {shlex.quote(base_commit)}"]
    if spec.install:
        lines.append(spec.install)
    if files:
        lines.append(reset_command(base_commit, files))
    if test_patch_path is not None:
        lines.append(f"{git} apply -v {shlex.quote(test_patch_path)}")
    wanted = list(dict.fromkeys([*directives(spec, files), *extra_targets]))
    targets = " ".join(shlex.quote(d) for d in wanted)
    lines += [f": '{START}'", f"{spec.test_cmd} {targets}".rstrip(), f"{_EXIT_VAR}=$?",
              f": '{END}'", f'echo "{EXIT}: ${_EXIT_VAR}"']
    if files:
        lines.append(reset_command(base_commit, files))
    return "\n".join(line for line in lines if line) + "\n"
