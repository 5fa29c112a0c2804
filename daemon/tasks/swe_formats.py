"""Published SWE instance rows -> ``swe`` tasks, loaded as the datasets ship them.

:func:`convert_row` turns one row of a published dataset into a ``swe`` task (see
``rolloutd.daemon.tasks.swe``); a row that lacks what a task needs raises :class:`RowError`
naming the field. The row's own fields are kept in the task (``hints_text``, ``created_at``,
``environment_setup_commit``, ...); the ones below are set from it. Nothing is downloaded.

``swebench``: SWE-bench, Lite, Verified (and Multilingual/Multimodal rows of the same shape):
    ``instance_id, repo, base_commit, patch, test_patch, problem_statement, hints_text,
    created_at, version, FAIL_TO_PASS, PASS_TO_PASS`` (test lists as JSON text, kept as they
    are: the task reads either), ``environment_setup_commit``. Rows of swebench >= 5 also carry
    ``image``, ``eval_script``, ``log_parser`` and ``eval_type``: kept, so the row's own
    evaluation spec is used; otherwise the handler picks the official spec from ``repo`` +
    ``version``. Image: the row's ``image``, else
    ``swebench/sweb.eval.x86_64.<id>:latest`` with ``__`` in the id spelt ``_1776_``, lower
    case (the SWE-bench harness's rule).
``swe-gym``: SWE-Gym (and SWE-Gym Lite): SWE-bench-shaped rows (test lists as JSON arrays).
    Image: ``xingyaoww/sweb.eval.x86_64.<id>:latest``, ``__`` spelt ``_s_``, lower case (the
    name SWE-Gym's images are published under). The repositories are not SWE-bench's, so the
    tests run with pytest in the image's conda env ``testbed`` (``env_setup``).
``swe-smith``: SWE-smith: ``instance_id`` (``owner__repo.<commit8>.<bug kind>``), ``repo``
    (``swesmith/owner__repo.<commit8>``), ``patch`` (the diff that *makes* the bug),
    ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``image_name``, ``problem_statement``, ``base_commit``.
    SWE-smith keeps each instance as a branch named after its instance id in the mirror
    repository, the bug applied: ``base_commit`` is that branch name, so the image's repository
    must hold the branch (a ``git fetch`` of the mirror into the image). The row's commit is
    kept as ``bug_commit`` and its ``patch`` as ``bug_patch`` (in a task ``patch`` means the
    gold fix, which SWE-smith does not ship). No ``test_patch``: the tests are in the
    repository. Image: the row's ``image_name``.
``r2e-gym``: R2E-Gym: ``repo_name, docker_image, commit_hash, parsed_commit_content,
    problem_statement, expected_output_json, ...``. R2E-Gym grades by running the image's
    ``/run_tests.sh`` (its hidden tests are in ``/r2e_tests``, outside the repository) and
    requiring *every* test's status to equal ``expected_output_json`` (failures expected to
    stay failures included). That comparison has no ``swe`` field, so the task's
    ``eval_script`` runs ``/run_tests.sh`` in ``/testbed`` and does it (R2E-Gym's own pytest
    summary parsing), printing one pytest-style line for the single test id
    ``r2e_expected_output`` that ``FAIL_TO_PASS`` lists (``log_parser`` ``parse_log_pytest``).
    What differs: ``reward_info`` shows that one outcome, not one per test (the script's output
    lists the mismatches); ``instance_id`` (the rows have none) is ``<repo_name>-<commit_hash>``;
    ``base_commit`` is the parent commit from ``parsed_commit_content``
    (``old_commit_hash``). Image: the row's ``docker_image``.
``swe-rebench``: SWE-rebench (``nebius/SWE-rebench``): SWE-bench-shaped rows plus
    ``install_config`` (a mapping, or its JSON text) whose ``test_cmd`` and ``log_parser`` name
    the test command and parser; its ``eval_commands`` and ``install`` run before the tests (as
    SWE-rebench's harness runs them); test targets are the test patch's files (``path``).
    Image: the row's ``docker_image`` (or ``image_name``), else
    ``swerebench/sweb.eval.x86_64.<id>:latest`` (``__`` spelt ``_1776_``). Only Python rows
    map (SWE-rebench-V2's other languages keep the repository elsewhere).

Images: a row's image name is given as ``docker://NAME``. ``image_template`` replaces the
format's default and the row's own field: a :meth:`str.format` template with
``{instance_id}``, ``{id_docker}`` (the id as the format's image names spell it), ``{repo}``,
``{org}``, ``{name}`` and ``{version}``, e.g. ``oci:/shared/images/{id_docker}:latest``; its
result is used as it is (an image source of docs/sandbox.md, or a name in the image store).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from rolloutd.daemon.tasks.base import TaskError

FORMATS = ("swebench", "swe-gym", "swe-smith", "r2e-gym", "swe-rebench")

#: Default image templates (formats whose rows name their image have none).
DEFAULT_IMAGE_TEMPLATES = {
    "swebench": "docker://swebench/sweb.eval.x86_64.{id_docker}:latest",
    "swe-gym": "docker://xingyaoww/sweb.eval.x86_64.{id_docker}:latest",
    "swe-rebench": "docker://swerebench/sweb.eval.x86_64.{id_docker}:latest",
}
TEMPLATE_FIELDS = ("instance_id", "id_docker", "repo", "org", "name", "version")
#: The conda environment SWE-bench-built images (SWE-Gym's, SWE-smith's, SWE-rebench's) test in.
CONDA_TESTBED = "source /opt/miniconda3/bin/activate && conda activate testbed"
#: SWE-Gym's repositories: a SWE-bench-shaped row from one of them is a SWE-Gym row.
SWE_GYM_REPOS = frozenset({
    "getmoto/moto", "Project-MONAI/MONAI", "pandas-dev/pandas", "python/mypy", "dask/dask",
    "iterative/dvc", "conan-io/conan", "pydantic/pydantic", "facebookresearch/hydra",
    "bokeh/bokeh", "modin-project/modin",
})
R2E_TEST_ID = "r2e_expected_output"

_TRANSPORT = re.compile(r"^(?:[a-z][a-z0-9+.-]*://|oci:|docker-archive:|sif:|sha256:|/)")
_SWESMITH_ID = re.compile(r"^[^/\s]+__[^/\s]+\.[0-9a-f]{7,40}\.\S+$")


class RowError(TaskError):
    """A row that cannot be mapped to a task; the message is the reason, naming the field."""


# ---- detection --------------------------------------------------------------------


def detect_format(row: Mapping[str, Any]) -> str:
    """The format of a published row (one of :data:`FORMATS`), from the fields it has."""
    if not isinstance(row, Mapping):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    if "repo_name" in row and ("expected_output_json" in row or "parsed_commit_content" in row):
        return "r2e-gym"
    if "install_config" in row:
        return "swe-rebench"
    repo = row.get("repo")
    if ("image_name" in row or (isinstance(repo, str) and repo.startswith("swesmith/"))
            or _SWESMITH_ID.match(str(row.get("instance_id", "")))):
        return "swe-smith"
    if "instance_id" in row:
        return "swe-gym" if repo in SWE_GYM_REPOS and "image" not in row else "swebench"
    raise RowError("cannot tell the format: the row has no 'instance_id' (SWE-bench, SWE-Gym, "
                   "SWE-smith, SWE-rebench) and no 'repo_name' with 'expected_output_json' "
                   "(R2E-Gym)")


# ---- conversion ---------------------------------------------------------------------


def convert_row(row: Mapping[str, Any], *, fmt: str = "auto",
                image_template: str | None = None) -> dict[str, Any]:
    """A ``swe`` task from a published row of format ``fmt`` (``"auto"``: :func:`detect_format`).
    Raises :class:`RowError` naming what the row lacks."""
    if not isinstance(row, Mapping):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown format {fmt!r} (one of: auto, {', '.join(FORMATS)})")
    if image_template is not None:
        check_template(image_template)
    return _CONVERTERS[fmt](dict(row), image_template)


def check_template(template: str) -> None:
    """Raise ValueError unless ``template`` only uses :data:`TEMPLATE_FIELDS`."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"image template {template!r}: {exc}") from None
    for f in fields:
        if f not in TEMPLATE_FIELDS:
            raise ValueError(f"image template {template!r}: unknown field {{{f}}} "
                             f"(known: {', '.join('{' + n + '}' for n in TEMPLATE_FIELDS)})")


def docker_id(instance_id: str, dunder: str = "_1776_") -> str:
    """An instance id as Docker Hub image names spell it: ``__`` -> ``dunder``, lower case."""
    return instance_id.replace("__", dunder).lower()


def _swebench(row: dict[str, Any], template: str | None, *, fmt: str = "swebench") -> dict[str, Any]:
    task = _swebench_fields(row, fmt)
    row_image = _opt_text(row, "image", fmt)
    dunder = "_s_" if fmt == "swe-gym" else "_1776_"
    task["image"] = _image(task, fmt, template, row_image, dunder)
    if fmt == "swe-gym":
        task.setdefault("env_setup", CONDA_TESTBED)
    return task


def _swegym(row: dict[str, Any], template: str | None) -> dict[str, Any]:
    return _swebench(row, template, fmt="swe-gym")


def _swebench_fields(row: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The fields every SWE-bench-shaped row has, checked; the row's other fields kept."""
    task: dict[str, Any] = {"kind": "swe", **row}
    for key in ("instance_id", "problem_statement", "base_commit"):
        task[key] = _text(row, key, fmt)
    test_patch = _text(row, "test_patch", fmt, blank_ok=True)
    if not test_patch.strip():
        raise RowError("'test_patch' is empty: nothing adds the tests that grade it "
                       "(SWE-bench Multimodal's test split ships without one)")
    task["FAIL_TO_PASS"] = _tests(row, "FAIL_TO_PASS", required=True)
    task["PASS_TO_PASS"] = _tests(row, "PASS_TO_PASS", required=False)
    if "repo" in row:
        task["repo"] = _text(row, "repo", fmt)
    _version(task, row)
    return task


def _swesmith(row: dict[str, Any], template: str | None) -> dict[str, Any]:
    fmt = "swe-smith"
    task: dict[str, Any] = {"kind": "swe", **row}
    iid = task["instance_id"] = _text(row, "instance_id", fmt)
    task["problem_statement"] = _text(
        row, "problem_statement", fmt,
        empty_hint="SWE-smith ships issue texts for a subset of its instances")
    task["FAIL_TO_PASS"] = _tests(row, "FAIL_TO_PASS", required=True)
    task["PASS_TO_PASS"] = _tests(row, "PASS_TO_PASS", required=False)
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._/-]{0,199}", iid):
        raise RowError(f"'instance_id' {iid!r} cannot name a git branch (the instance's base)")
    task["base_commit"] = iid  # the branch SWE-smith keeps the instance on
    if "base_commit" in row:
        task["bug_commit"] = row["base_commit"]
    task.pop("patch", None)
    if "patch" in row:
        task["bug_patch"] = _text(row, "patch", fmt, blank_ok=True)
    if "repo" in row:
        task["repo"] = _text(row, "repo", fmt)
    _version(task, row)
    task["image"] = _image(task, fmt, template, _opt_text(row, "image_name", fmt), "_1776_")
    task.setdefault("env_setup", CONDA_TESTBED)
    return task


def _swerebench(row: dict[str, Any], template: str | None) -> dict[str, Any]:
    fmt = "swe-rebench"
    language = row.get("language")
    if language is not None and str(language).lower() != "python":
        raise RowError(f"'language' is {language!r}: only Python SWE-rebench rows map (the "
                       f"others' images keep the repository outside /testbed)")
    task = _swebench_fields(row, fmt)
    config = row["install_config"]
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            raise RowError("'install_config' is not a JSON object") from None
    if not isinstance(config, Mapping):
        raise RowError(f"'install_config' should be an object, got {type(config).__name__}")
    test_cmd = config.get("test_cmd")
    if isinstance(test_cmd, list) and len(test_cmd) == 1:
        test_cmd = test_cmd[0]
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise RowError("'install_config.test_cmd' is missing (a test command is needed)")
    parser = config.get("log_parser")
    if not isinstance(parser, str) or not parser.strip():
        raise RowError("'install_config.log_parser' is missing (a log parser name is needed)")
    task["test_cmd"], task["log_parser"] = test_cmd, parser
    commands = _lines(config.get("eval_commands"), "install_config.eval_commands")
    commands += _lines(config.get("install"), "install_config.install")
    if commands:
        task["eval_commands"] = commands
    task["test_directives"] = "django" if task.get("repo") == "django/django" else "path"
    task.setdefault("env_setup", CONDA_TESTBED)
    row_image = _opt_text(row, "docker_image", fmt) or _opt_text(row, "image_name", fmt)
    task["image"] = _image(task, fmt, template, row_image, "_1776_")
    return task


def _r2egym(row: dict[str, Any], template: str | None) -> dict[str, Any]:
    fmt = "r2e-gym"
    task: dict[str, Any] = {"kind": "swe", **row}
    name = _text(row, "repo_name", fmt)
    commit = _text(row, "commit_hash", fmt)
    task["problem_statement"] = _text(row, "problem_statement", fmt)
    task.setdefault("instance_id", f"{name}-{commit}")
    task["instance_id"] = _text(task, "instance_id", fmt)
    parsed = _json_object(row, "parsed_commit_content")
    old = parsed.get("old_commit_hash")
    if not isinstance(old, str) or not old.strip():
        raise RowError("'parsed_commit_content' has no 'old_commit_hash' (the base commit)")
    task["base_commit"] = old
    expected = _json_object(row, "expected_output_json")
    if not expected:
        raise RowError("'expected_output_json' lists no tests")
    bad = [k for k, v in expected.items() if not isinstance(v, str)]
    if bad:
        raise RowError(f"'expected_output_json': the outcome of {bad[0]!r} is not a string")
    if "PASSED" not in expected.values():
        raise RowError("'expected_output_json': no test is expected to pass")
    task["FAIL_TO_PASS"], task["PASS_TO_PASS"] = [R2E_TEST_ID], []
    task["test_patch"] = ""
    task["eval_script"] = _r2e_eval_script(task.get("repo_dir", "/testbed"), expected)
    task["log_parser"] = "parse_log_pytest"
    task["eval_type"] = "pass_and_fail"
    task.setdefault("repo", name)
    task["image"] = _image(task, fmt, template, _opt_text(row, "docker_image", fmt), "_1776_")
    return task


_CONVERTERS: dict[str, Callable[[dict[str, Any], str | None], dict[str, Any]]] = {
    "swebench": _swebench,
    "swe-gym": _swegym,
    "swe-smith": _swesmith,
    "r2e-gym": _r2egym,
    "swe-rebench": _swerebench,
}


# ---- R2E-Gym's grading as an eval script ------------------------------------------------

# R2E-Gym's pytest summary parsing (r2egym/repo_analysis/execution_log_parser.py) and exact
# comparison (DockerRuntime._calculate_reward_r2e), restated; reads the expected outcomes
# from argv[1] and the test output from stdin.
_R2E_GRADER = r"""
import json, re, sys
expected = json.load(open(sys.argv[1]))
log = sys.stdin.read()
got = {}
if "short test summary info" in log:
    for line in log.split("short test summary info")[1].strip().split("\n"):
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                got[".".join(line.split("::")[1:]).split(" - ")[0]] = status
                break
plain = lambda d: {re.sub(r"\x1b\[\d+m", "", k).split(" - ")[0]: v for k, v in d.items()}
got, expected = plain(got), plain(expected)
wrong = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
for k in wrong:
    print(f"r2e: {k}: expected {expected.get(k, 'absent')}, got {got.get(k, 'absent')}")
print(("FAILED " if wrong or not expected else "PASSED ") + sys.argv[2])
"""


def _r2e_eval_script(repo_dir: str, expected: dict[str, Any]) -> str:
    """A bash eval script: run the image's /run_tests.sh in the repository (its tests linked in
    as R2E-Gym's runtime does), then compare every test's outcome with ``expected``."""
    delim = "R2E_EXPECTED_OUTPUT_JSON"
    data = json.dumps(expected, ensure_ascii=False)
    q = _shell_quote
    return "\n".join([
        "#!/bin/bash",
        "set -uo pipefail",
        f"cd {q(repo_dir)} || exit 1",
        "[ -e r2e_tests ] || ln -s /r2e_tests r2e_tests",
        f"cat > /tmp/r2e_expected.json <<'{delim}'", data, delim,
        f"cat > /tmp/r2e_grade.py <<'R2E_GRADER'{_R2E_GRADER}R2E_GRADER",
        "PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python",
        "echo '>>>>> Start Test Output'",
        "bash /run_tests.sh > /tmp/r2e_test_output.txt 2>&1",
        "cat /tmp/r2e_test_output.txt",
        f"\"$PY\" /tmp/r2e_grade.py /tmp/r2e_expected.json {R2E_TEST_ID} < /tmp/r2e_test_output.txt",
        "echo '>>>>> End Test Output'",
        "",
    ])


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


# ---- field helpers ------------------------------------------------------------------------


def _text(row: Mapping[str, Any], key: str, fmt: str, *, blank_ok: bool = False,
          empty_hint: str = "") -> str:
    if key not in row or row[key] is None:
        raise RowError(f"'{key}' is missing (a {fmt} row has it)")
    value = row[key]
    if not isinstance(value, str):
        raise RowError(f"'{key}' should be a string, got {type(value).__name__}")
    if not blank_ok and not value.strip():
        raise RowError(f"'{key}' is empty" + (f" ({empty_hint})" if empty_hint else ""))
    return value


def _opt_text(row: Mapping[str, Any], key: str, fmt: str) -> str | None:
    if row.get(key) in (None, ""):
        return None
    return _text(row, key, fmt)


def _tests(row: Mapping[str, Any], key: str, *, required: bool) -> Any:
    """A test list as the row has it (a list, or its JSON text), checked; [] when absent."""
    value = row.get(key)
    if value is None:
        if required:
            raise RowError(f"'{key}' is missing")
        return []
    tests = value
    if isinstance(value, str):
        try:
            tests = json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"'{key}' is neither a list nor the JSON text of one") from None
    if not isinstance(tests, list) or not all(isinstance(t, str) and t.strip() for t in tests):
        raise RowError(f"'{key}' should list test ids (non-empty strings)")
    if required and not tests:
        raise RowError(f"'{key}' is empty: no test decides whether the instance is resolved")
    return value if isinstance(value, str) else list(tests)


def _version(task: dict[str, Any], row: Mapping[str, Any]) -> None:
    """``version`` as text (SWE-bench's is; some exports store a number)."""
    value = row.get("version")
    if value is None:
        task.pop("version", None)
    elif isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowError(f"'version' should be a string, got {type(value).__name__}")
    else:
        task["version"] = str(value)


def _lines(value: Any, where: str) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v for v in value if v.strip()]
    raise RowError(f"'{where}' should be a command or a list of commands")


def _json_object(row: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = row.get(key)
    if value is None:
        raise RowError(f"'{key}' is missing")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"'{key}' is not valid JSON") from None
    if not isinstance(value, dict):
        raise RowError(f"'{key}' should be a JSON object")
    return value


def _image(task: Mapping[str, Any], fmt: str, template: str | None, row_image: str | None,
           dunder: str) -> str:
    """The task's image: the template's, else the row's own (as docker://), else the
    format's default template."""
    if template is None and row_image is not None:
        return row_image if _TRANSPORT.match(row_image) else "docker://" + row_image
    template = template or DEFAULT_IMAGE_TEMPLATES.get(fmt)
    if template is None:
        field = {"swe-smith": "image_name", "r2e-gym": "docker_image"}.get(fmt, "image")
        raise RowError(f"'{field}' is missing (or give an image template)")
    iid = str(task.get("instance_id", ""))
    repo = task.get("repo")
    org, _, name = str(repo).partition("/") if isinstance(repo, str) and "/" in repo else (None, "", repo)
    values = {"instance_id": iid, "id_docker": docker_id(iid, dunder), "repo": repo,
              "org": org, "name": name, "version": task.get("version")}
    for _, f, _, _ in string.Formatter().parse(template):
        if f is not None and values.get(f) is None:
            raise RowError(f"the image template needs {{{f}}}, and the row has no "
                           f"{'repo' if f in ('org', 'name') else f!r} to give it")
    return template.format(**values)
