"""Published SWE rows -> swe tasks (swe_formats), and `rolloutd tasks convert` as a command.

The rows are hand-made samples in the published shapes (tests/tasks/data/README.md)."""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.tasks.swe_formats import (
    FORMATS,
    R2E_TEST_ID,
    RowError,
    convert_row,
    detect_format,
    docker_id,
)

DATA = Path(__file__).parent / "data"
REGISTRY = TaskRegistry.default()


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def convert_valid(row: dict, **kw) -> dict:
    task = convert_row(row, **kw)
    REGISTRY.validate(task)  # raises TaskError if it is not a valid swe task
    return task


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutd.daemon.cli", "tasks", "convert", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


# ---- formats ------------------------------------------------------------------------


def test_swebench_rows_keep_their_json_test_lists_and_fields():
    django, astropy, _ = rows("swebench.jsonl")
    assert detect_format(django) == "swebench"
    task = convert_valid(django)
    assert task["kind"] == "swe"
    assert task["image"] == "docker://swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert task["FAIL_TO_PASS"] == django["FAIL_TO_PASS"]  # the JSON text, as published
    assert isinstance(task["FAIL_TO_PASS"], str)
    checked = REGISTRY.validate(task)
    assert checked["FAIL_TO_PASS"] == json.loads(django["FAIL_TO_PASS"])
    assert checked["repo_dir"] == "/testbed" and checked["id"] == "django__django-11099"
    for key in ("patch", "hints_text", "created_at", "version", "environment_setup_commit",
                "difficulty", "repo", "test_patch", "base_commit", "problem_statement"):
        assert task[key] == django[key], key
    assert "eval_script" not in task and "test_cmd" not in task  # the handler's official spec
    assert convert_valid(astropy)["PASS_TO_PASS"] == "[]"


def test_swebench_5_rows_bring_their_image_and_evaluation_spec():
    row = rows("swebench.jsonl")[2]
    task = convert_valid(row)
    assert task["image"] == "docker://swebench/sweb.eval.x86_64.google_1776_gson-2479:latest"
    assert task["eval_script"] == row["eval_script"]
    assert (task["log_parser"], task["eval_type"]) == ("parse_log_maven", "pass_and_fail")


def test_image_names_follow_each_harness_rule():
    assert docker_id("django__django-11099") == "django_1776_django-11099"
    assert docker_id("Project-MONAI__MONAI-3715", "_s_") == "project-monai_s_monai-3715"


def test_swe_gym_rows():
    monai, moto = rows("swe-gym.jsonl")
    assert detect_format(monai) == detect_format(moto) == "swe-gym"
    task = convert_valid(monai)
    assert task["image"] == "docker://xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3715:latest"
    assert task["FAIL_TO_PASS"] == monai["FAIL_TO_PASS"]
    assert task["env_setup"] == "source /opt/miniconda3/bin/activate && conda activate testbed"
    assert convert_valid(moto)["PASS_TO_PASS"] == []
    # told it is a SWE-bench row, it gets SWE-bench's image name
    as_swebench = convert_valid(monai, fmt="swebench")
    assert as_swebench["image"] == "docker://swebench/sweb.eval.x86_64.project-monai_1776_monai-3715:latest"


def test_swe_smith_rows_start_from_the_instance_branch():
    (row,) = rows("swe-smith.jsonl")
    assert detect_format(row) == "swe-smith"
    task = convert_valid(row)
    assert task["base_commit"] == row["instance_id"]  # the branch holding the bug
    assert task["bug_commit"] == row["base_commit"]
    assert task["bug_patch"] == row["patch"] and "patch" not in task  # not a gold fix
    assert task["image"] == "docker://jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536"
    assert task["repo"] == "swesmith/oauthlib__oauthlib.1fd52536"
    assert REGISTRY.validate(task)["test_patch"] == ""
    assert task["image_name"] == row["image_name"] and task["created_at"] == row["created_at"]


def test_swe_smith_row_without_issue_text_or_image():
    (row,) = rows("swe-smith.jsonl")
    with pytest.raises(RowError, match="'problem_statement' is empty"):
        convert_row(dict(row, problem_statement=""))
    with pytest.raises(RowError, match="'image_name' is missing"):
        convert_row({k: v for k, v in row.items() if k != "image_name"}, fmt="swe-smith")
    task = convert_valid({k: v for k, v in row.items() if k != "image_name"}, fmt="swe-smith",
                         image_template="oci:/images/{name}:latest")
    assert task["image"] == "oci:/images/oauthlib__oauthlib.1fd52536:latest"


def test_swe_rebench_rows_map_their_test_command_and_parser():
    (row,) = rows("swe-rebench.jsonl")
    assert detect_format(row) == "swe-rebench"
    task = convert_valid(row)
    config = row["install_config"]
    assert (task["test_cmd"], task["log_parser"]) == (config["test_cmd"], "parse_log_pytest")
    assert task["eval_commands"] == ["pip install -e .[dev]"]
    assert task["test_directives"] == "path"
    assert task["image"] == "docker://swerebench/sweb.eval.x86_64.oemof_1776_tespy-653"
    assert task["install_config"] == config and task["meta"] == row["meta"]
    # install_config as its JSON text; no docker_image: the conventional name
    bare = {k: v for k, v in row.items() if k != "docker_image"}
    task = convert_valid(dict(bare, install_config=json.dumps(dict(config, eval_commands=["export X=1"]))))
    assert task["eval_commands"] == ["export X=1", "pip install -e .[dev]"]
    assert task["image"] == "docker://swerebench/sweb.eval.x86_64.oemof_1776_tespy-653:latest"


@pytest.mark.parametrize(("change", "reason"), [
    ({"install_config": {"log_parser": "parse_log_pytest"}}, "'install_config.test_cmd' is missing"),
    ({"install_config": {"test_cmd": "pytest"}}, "'install_config.log_parser' is missing"),
    ({"install_config": "{oops"}, "'install_config' is not a JSON object"),
    ({"language": "go"}, "'language' is 'go'"),
])
def test_swe_rebench_rows_that_cannot_map(change, reason):
    (row,) = rows("swe-rebench.jsonl")
    with pytest.raises(RowError, match=reason):
        convert_row(dict(row, **change))


def test_r2e_gym_rows():
    (row,) = rows("r2e-gym.jsonl")
    assert detect_format(row) == "r2e-gym"
    task = convert_valid(row)
    assert task["instance_id"] == f"pandas-{row['commit_hash']}"
    assert task["base_commit"] == "9c1a0ad5ba7c1b2d59d05a4fe84ee3cb0ac89c1e"  # the parent
    assert task["FAIL_TO_PASS"] == [R2E_TEST_ID] and task["PASS_TO_PASS"] == []
    assert task["image"] == "docker://" + row["docker_image"]
    assert task["log_parser"] == "parse_log_pytest" and task["test_patch"] == ""
    assert task["expected_output_json"] == row["expected_output_json"]
    with pytest.raises(RowError, match="'parsed_commit_content' has no 'old_commit_hash'"):
        convert_row(dict(row, parsed_commit_content="{}"))
    with pytest.raises(RowError, match="'expected_output_json': no test is expected to pass"):
        convert_row(dict(row, expected_output_json='{"T.test_a": "FAILED"}'))


R2E_SUMMARY = """\
============================= test session starts ==============================
collected 3 items
r2e_tests/test_1.py ..F
=========================== short test summary info ============================
PASSED r2e_tests/test_1.py::TestPandasContainer::test_frame_from_json_precise_float
PASSED r2e_tests/test_1.py::TestPandasContainer::test_series_roundtrip_object
FAILED r2e_tests/test_1.py::TestPandasContainer::test_date_format_raises - AssertionError
"""


@pytest.mark.parametrize("fixed", [True, False])
def test_r2e_eval_script_grades_like_r2e_gym(tmp_path, fixed):
    """The eval script, run for real by bash, with the image's /run_tests.sh and /r2e_tests
    relocated into tmp_path: every test must have its expected outcome (an expected failure
    included), and the verdict is one pytest summary line for R2E_TEST_ID."""
    (row,) = rows("r2e-gym.jsonl")
    repo = tmp_path / "testbed"
    (repo / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, repo / ".venv" / "bin" / "python")
    (tmp_path / "r2e_tests").mkdir()
    summary = R2E_SUMMARY if fixed else R2E_SUMMARY.replace(
        "FAILED r2e_tests/test_1.py::TestPandasContainer::test_date_format_raises - AssertionError",
        "PASSED r2e_tests/test_1.py::TestPandasContainer::test_date_format_raises")
    (tmp_path / "summary.txt").write_text(summary)
    run_tests = tmp_path / "run_tests.sh"
    run_tests.write_text(f"test -L r2e_tests || exit 3\ncat {tmp_path}/summary.txt\n")
    run_tests.chmod(run_tests.stat().st_mode | stat.S_IXUSR)
    task = convert_valid(dict(row, repo_dir=str(repo)))
    assert f"cd '{repo}' || exit 1" in task["eval_script"]
    script = (task["eval_script"].replace("/tmp/r2e_", f"{tmp_path}/r2e_")
              .replace("/run_tests.sh", str(run_tests))
              .replace("/r2e_tests", str(tmp_path / "r2e_tests")))
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (repo / "r2e_tests").is_symlink()  # linked in as R2E-Gym's runtime does
    lines = res.stdout.splitlines()
    assert lines[0] == ">>>>> Start Test Output" and lines[-1] == ">>>>> End Test Output"
    assert "short test summary info" in res.stdout  # the test output is shown
    if fixed:
        assert lines[-2] == f"PASSED {R2E_TEST_ID}"
    else:
        assert lines[-2] == f"FAILED {R2E_TEST_ID}"
        assert ("r2e: TestPandasContainer.test_date_format_raises: expected FAILED, got PASSED"
                in lines)


# ---- rows that cannot be mapped; detection; templates ---------------------------------------


def test_row_errors_name_the_field():
    django = rows("swebench.jsonl")[0]
    assert issubclass(RowError, TaskError)
    cases = [
        ({k: v for k, v in django.items() if k != "base_commit"}, "'base_commit' is missing"),
        (dict(django, FAIL_TO_PASS="[]"), "'FAIL_TO_PASS' is empty"),
        (dict(django, FAIL_TO_PASS='["ok", 3]'), "'FAIL_TO_PASS' should list test ids"),
        (dict(django, PASS_TO_PASS="nope"), "'PASS_TO_PASS' is neither a list nor the JSON text"),
        (dict(django, problem_statement=7), "'problem_statement' should be a string, got int"),
        (dict(django, test_patch=""), "'test_patch' is empty"),
        (dict(django, version=["3.0"]), "'version' should be a string, got list"),
    ]
    for row, reason in cases:
        with pytest.raises(RowError, match=reason):
            convert_row(row)
    with pytest.raises(RowError, match="cannot tell the format"):
        detect_format({"text": "hello"})
    with pytest.raises(RowError, match="a row must be a JSON object, got list"):
        convert_row([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown format 'swe-bench'"):
        convert_row(django, fmt="swe-bench")
    assert set(FORMATS) == {"swebench", "swe-gym", "swe-smith", "r2e-gym", "swe-rebench"}


def test_a_numeric_version_is_text():
    (row,) = rows("swe-rebench.jsonl")
    assert convert_valid(dict(row, version=7))["version"] == "7"


def test_image_templates():
    django = rows("swebench.jsonl")[0]
    task = convert_valid(django, image_template="oci:/shared/{org}/{name}-{version}/{id_docker}:latest")
    assert task["image"] == "oci:/shared/django/django-3.0/django_1776_django-11099:latest"
    task = convert_valid(django, image_template="swe/{instance_id}")  # a name in the image store
    assert task["image"] == "swe/django__django-11099"
    gson = rows("swebench.jsonl")[2]  # the template wins over the row's own image
    assert convert_valid(gson, image_template="oci:/i/{id_docker}")["image"] == "oci:/i/google_1776_gson-2479"
    with pytest.raises(ValueError, match=r"unknown field \{tag\}"):
        convert_row(django, image_template="x/{tag}")
    with pytest.raises(RowError, match=r"needs \{version\}, and the row has no 'version'"):
        convert_row({k: v for k, v in django.items() if k != "version"}, image_template="x:{version}")


# ---- the command ----------------------------------------------------------------------------


def test_cli_converts_each_format_to_a_task_file(tmp_path):
    for name in ("swebench", "swe-gym", "swe-smith", "r2e-gym", "swe-rebench"):
        out = tmp_path / f"{name}.tasks.jsonl"
        res = cli(str(DATA / f"{name}.jsonl"), "-o", str(out))
        n = len(rows(f"{name}.jsonl"))
        assert res.returncode == 0, res.stderr
        assert res.stderr.strip() == f"converted {n} of {n} rows; 0 skipped"
        tasks = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(tasks) == n
        for task in tasks:
            REGISTRY.validate(task)


def test_cli_reports_rows_it_cannot_map(tmp_path):
    path = DATA / "bad.jsonl"
    res = cli(str(path))
    assert res.returncode == 0  # one row converted, none failed to be read
    assert len(res.stdout.splitlines()) == 1
    assert json.loads(res.stdout)["instance_id"] == "django__django-11099"
    err = res.stderr.splitlines()
    assert err == [
        f"{path}:row 2 (django__django-1): 'FAIL_TO_PASS' is empty: no test decides whether the instance is resolved",
        f"{path}:row 3 (django__django-2): 'problem_statement' is missing (a swebench row has it)",
        f"{path}:row 4: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{path}:row 5 (django__django-3): 'test_patch' is empty: nothing adds the tests that grade it "
        "(SWE-bench Multimodal's test split ships without one)",
        f"{path}:row 6 (django__django-4): 'FAIL_TO_PASS' is neither a list nor the JSON text of one",
        f"{path}:row 7: a row must be a JSON object, got list",
        "converted 1 of 7 rows; 6 skipped",
    ]
    assert cli(str(path), "--strict").returncode == 1
    limited = cli(str(path), "--limit", "2")
    assert limited.stderr.splitlines()[-1] == "converted 1 of 2 rows; 1 skipped"
    only_bad = tmp_path / "only-bad.jsonl"
    only_bad.write_text("\n".join(path.read_text().splitlines()[1:]) + "\n")
    res = cli(str(only_bad))
    assert res.returncode == 1 and res.stderr.splitlines()[-1] == "converted 0 of 6 rows; 6 skipped"


def test_cli_a_task_that_the_swe_kind_refuses_is_reported(tmp_path):
    row = dict(rows("swebench.jsonl")[0], base_commit="-rf")  # not a safe git ref
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(row) + "\n")
    res = cli(str(path))
    assert res.returncode == 1
    assert res.stderr.startswith(f"{path}:row 1 (django__django-11099): swe task: 'base_commit': ")


def test_cli_format_and_template_options(tmp_path):
    res = cli(str(DATA / "swe-gym.jsonl"), "--format", "swebench", "--image-template",
              "oci:/images/{id_docker}:latest")
    assert res.returncode == 0, res.stderr
    images = [json.loads(line)["image"] for line in res.stdout.splitlines()]
    assert images == ["oci:/images/project-monai_1776_monai-3715:latest",
                      "oci:/images/getmoto_1776_moto-5752:latest"]
    res = cli(str(DATA / "swe-gym.jsonl"), "--image-template", "x/{nope}")
    assert res.returncode == 2 and "unknown field {nope}" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_input_that_cannot_be_read(tmp_path):
    res = cli(str(tmp_path / "missing.jsonl"))
    assert res.returncode == 2
    assert res.stderr == f"rolloutd tasks: {tmp_path / 'missing.jsonl'}: no such file\n"
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("not parquet")
    res = cli(str(not_parquet))
    assert res.returncode == 2 and "cannot read as Parquet" in res.stderr
    assert "Traceback" not in res.stderr
    res = cli(str(DATA / "swebench.jsonl"), "--limit", "0")
    assert res.returncode == 2 and "--limit must be at least 1" in res.stderr


def test_cli_json_array_input(tmp_path):
    path = tmp_path / "task_insts.json"  # SWE-smith writes its task files as one JSON array
    path.write_text(json.dumps(rows("swe-smith.jsonl"), indent=2))
    res = cli(str(path))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["base_commit"] == rows("swe-smith.jsonl")[0]["instance_id"]


def test_cli_parquet(tmp_path):
    """Parquet as the hub serves it: typed columns (lists, a struct, a timestamp)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rebench = rows("swe-rebench.jsonl")[0]
    rebench["created_at"] = datetime.datetime(2025, 1, 3, 10, 21, 44, tzinfo=datetime.UTC)
    gym = rows("swe-gym.jsonl")
    table = pa.Table.from_pylist(gym)
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(table, path)
    res = cli(str(path), "--format", "swe-gym")
    assert res.returncode == 0, res.stderr
    tasks = [json.loads(line) for line in res.stdout.splitlines()]
    assert [t["FAIL_TO_PASS"] for t in tasks] == [r["FAIL_TO_PASS"] for r in gym]
    for task in tasks:
        REGISTRY.validate(task)

    path = tmp_path / "rebench.parquet"
    pq.write_table(pa.Table.from_pylist([rebench]), path)
    assert pa.Table.from_pylist([rebench]).schema.field("install_config").type.num_fields > 0
    res = cli(str(path), "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0, res.stderr
    (task,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert task["created_at"] == "2025-01-03T10:21:44+00:00"
    assert task["test_cmd"] == rebench["install_config"]["test_cmd"]
    REGISTRY.validate(task)


def test_cli_parquet_without_pyarrow(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
            "from rolloutd.daemon.cli import main\n"
            f"sys.exit(main(['tasks', 'convert', {str(path)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr == "rolloutd tasks: reading Parquet needs pyarrow: pip install pyarrow (or export the dataset as JSON lines)\n"
