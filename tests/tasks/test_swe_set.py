"""examples/swe_set: the shipped instances are well formed, replay to their commit ids from
the vendored sdists, and their FAIL_TO_PASS / PASS_TO_PASS facts hold under the projects'
own test runners (real runs; no images needed)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.daemon.tasks.swe import SweTaskModel

SWE_SET = Path(__file__).resolve().parents[2] / "examples" / "swe_set"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"swe_set_{name}", SWE_SET / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load("generate")
ROWS = gen.load_rows()
BY_PROJECT = gen.rows_by_project(ROWS)


def test_instances_cover_four_projects_and_both_runners():
    assert len(ROWS) >= 20
    assert len(BY_PROJECT) >= 4
    assert all(len(rows) >= 4 for rows in BY_PROJECT.values()), {
        p: len(r) for p, r in BY_PROJECT.items()}
    assert {r["log_parser"] for r in ROWS} == {"parse_log_pytest", "parse_log_django"}
    assert {r["test_directives"] for r in ROWS} == {"path", "module"}
    assert len({r["instance_id"] for r in ROWS}) == len(ROWS)
    for project in BY_PROJECT:
        assert gen.PROJECTS[project].sdist.is_file()


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["instance_id"])
def test_row_is_a_swe_task(row):
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    assert 1 <= len(f2p) <= 5 and len(p2p) <= 50 and not set(f2p) & set(p2p)
    assert all(isinstance(t, str) and t for t in f2p + p2p)
    task = SweTaskModel.model_validate(row)
    assert task.FAIL_TO_PASS == f2p
    assert row["repo_dir"] == "/testbed" and row["image"] == row["repo"]
    project = gen.PROJECTS[row["repo"].split("/", 1)[1]]
    assert row["version"] == project.version and row["test_cmd"] == project.test_cmd
    for key in ("patch", "test_patch", "wrong_patch"):
        assert row[key].startswith("diff --git "), key
    assert row["patch"] != row["wrong_patch"]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["instance_id"])
def test_problem_statement_does_not_give_the_fix(row):
    changed = re.findall(r"^[-+](?![-+])(.*\S.*)$", row["patch"], re.M)
    for line in changed:
        assert line.strip() not in row["problem_statement"]
    assert "diff --git" not in row["problem_statement"]
    assert not re.search(r"0x[0-9a-f]{4,}", row["problem_statement"])  # reproducible text


def test_every_base_commit_replays_from_the_sdists(tmp_path):
    for name, rows in BY_PROJECT.items():
        shas = gen.replay(gen.PROJECTS[name], rows, tmp_path / name)
        assert shas == {r["instance_id"]: r["base_commit"] for r in rows}
        head = gen.git(tmp_path / name, "log", "-1", "--format=%s", "HEAD").strip()
        assert head == f"import {name} {gen.PROJECTS[name].version}"


@pytest.mark.slow
@pytest.mark.parametrize("project", sorted(BY_PROJECT))
def test_first_instance_facts_hold_under_the_real_runner(project, tmp_path):
    """base + test patch: F2P fail, P2P pass; + gold: all pass; + wrong: some F2P fails."""
    row = BY_PROJECT[project][0]
    repo = tmp_path / project
    gen.replay(gen.PROJECTS[project], [row], repo)
    assert gen.validate(gen.PROJECTS[project], repo, row) == []


def test_toolz_needs_its_untracked_version_file(tmp_path):
    """The artefact: toolz/_version.py is ignored by git, so a clone cannot import toolz."""
    repo = tmp_path / "toolz"
    gen.replay(gen.PROJECTS["toolz"], BY_PROJECT["toolz"][:1], repo)
    status = gen.git(repo, "status", "--porcelain", "--ignored")
    assert "!! toolz/_version.py" in status
    probe = [sys.executable, "-c", "import toolz"]
    assert subprocess.run(probe, cwd=repo, capture_output=True).returncode == 0
    clone = tmp_path / "clone"
    gen.git(tmp_path, "clone", "-q", str(repo), str(clone))
    failed = subprocess.run(probe, cwd=clone, capture_output=True, text=True)
    assert failed.returncode != 0 and "_version" in failed.stderr
