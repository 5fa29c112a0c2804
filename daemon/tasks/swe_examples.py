"""Tiny SWE-style repositories, generated locally: an issue, a failing test, a known fix.

    tasks = make_swe_repos(Path("/tmp/swe"))   # -> list of ``swe`` task dicts

Each repository is a small Python package with a bug, committed as ``base_commit``. The
instance's ``test_patch`` adds a test that fails at the base commit (``FAIL_TO_PASS``); the
existing tests (``PASS_TO_PASS``) pass before and after the fix. ``patch`` is the known fix
(the SWE-bench field name for the gold patch): not shown to the model, used by tests.
Nothing is downloaded; generation is deterministic apart from the commit ids' timestamps,
which are pinned too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Instance:
    name: str
    issue: str
    files: dict[str, str]      # the base commit
    test_change: dict[str, str]  # files as the test patch leaves them
    fix: dict[str, str]        # files as the known fix leaves them
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]


_PYPROJECT = '[project]\nname = "{name}"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\n' \
             'testpaths = ["tests"]\n'

INSTANCES: tuple[Instance, ...] = (
    Instance(
        name="textkit",
        issue=(
            "slugify() keeps upper-case letters\n\n"
            "`textkit.slug.slugify('Hello World')` returns `'Hello-World'`. Slugs are used in "
            "URLs and must be lower case: the expected result is `'hello-world'`."
        ),
        files={
            "textkit/__init__.py": "",
            "textkit/slug.py": (
                '"""URL slugs."""\n\n\n'
                "def slugify(text):\n"
                '    words = text.strip().split()\n'
                '    return "-".join(words)\n'
            ),
            "tests/test_slug.py": (
                "from textkit.slug import slugify\n\n\n"
                "def test_spaces():\n"
                '    assert slugify("a b  c") == "a-b-c"\n'
            ),
        },
        test_change={
            "tests/test_slug.py": (
                "from textkit.slug import slugify\n\n\n"
                "def test_spaces():\n"
                '    assert slugify("a b  c") == "a-b-c"\n\n\n'
                "def test_lowercase():\n"
                '    assert slugify("Hello World") == "hello-world"\n'
            ),
        },
        fix={
            "textkit/slug.py": (
                '"""URL slugs."""\n\n\n'
                "def slugify(text):\n"
                '    words = text.strip().lower().split()\n'
                '    return "-".join(words)\n'
            ),
        },
        fail_to_pass=("tests/test_slug.py::test_lowercase",),
        pass_to_pass=("tests/test_slug.py::test_spaces",),
    ),
    Instance(
        name="mathx",
        issue=(
            "clamp() returns the wrong bound for large values\n\n"
            "`mathx.core.clamp(15, 0, 10)` returns `0`, but a value above the upper bound "
            "should be clamped to the upper bound, `10`."
        ),
        files={
            "mathx/__init__.py": "",
            "mathx/core.py": (
                '"""Small numeric helpers."""\n\n\n'
                "def clamp(x, lo, hi):\n"
                "    if x < lo:\n"
                "        return lo\n"
                "    if x > hi:\n"
                "        return lo\n"
                "    return x\n"
            ),
            "tests/test_core.py": (
                "from mathx.core import clamp\n\n\n"
                "def test_inside():\n"
                "    assert clamp(5, 0, 10) == 5\n\n\n"
                "def test_below():\n"
                "    assert clamp(-3, 0, 10) == 0\n"
            ),
        },
        test_change={
            "tests/test_upper.py": (
                "from mathx.core import clamp\n\n\n"
                "def test_above():\n"
                "    assert clamp(15, 0, 10) == 10\n"
            ),
        },
        fix={
            "mathx/core.py": (
                '"""Small numeric helpers."""\n\n\n'
                "def clamp(x, lo, hi):\n"
                "    if x < lo:\n"
                "        return lo\n"
                "    if x > hi:\n"
                "        return hi\n"
                "    return x\n"
            ),
        },
        fail_to_pass=("tests/test_upper.py::test_above",),
        pass_to_pass=("tests/test_core.py::test_inside", "tests/test_core.py::test_below"),
    ),
    Instance(
        name="wordcount",
        issue=(
            "count_words() counts empty strings between repeated spaces\n\n"
            "`wordcount.count.count_words('a  b')` (two spaces) returns 3. It should count "
            "words, not separators: the answer is 2. Leading and trailing spaces must not count "
            "either."
        ),
        files={
            "wordcount/__init__.py": "",
            "wordcount/count.py": (
                '"""Counting words."""\n\n\n'
                "def count_words(text):\n"
                "    if not text:\n"
                "        return 0\n"
                '    return len(text.split(" "))\n'
            ),
            "tests/test_count.py": (
                "from wordcount.count import count_words\n\n\n"
                "def test_empty():\n"
                '    assert count_words("") == 0\n\n\n'
                "def test_simple():\n"
                '    assert count_words("one two three") == 3\n'
            ),
        },
        test_change={
            "tests/test_count.py": (
                "from wordcount.count import count_words\n\n\n"
                "def test_empty():\n"
                '    assert count_words("") == 0\n\n\n'
                "def test_simple():\n"
                '    assert count_words("one two three") == 3\n\n\n'
                "def test_repeated_spaces():\n"
                '    assert count_words("a  b") == 2\n'
                '    assert count_words("  a b ") == 2\n'
            ),
        },
        fix={
            "wordcount/count.py": (
                '"""Counting words."""\n\n\n'
                "def count_words(text):\n"
                "    return len(text.split())\n"
            ),
        },
        fail_to_pass=("tests/test_count.py::test_repeated_spaces",),
        pass_to_pass=("tests/test_count.py::test_empty", "tests/test_count.py::test_simple"),
    ),
)

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "rolloutd examples", "GIT_AUTHOR_EMAIL": "examples@rolloutd.invalid",
    "GIT_COMMITTER_NAME": "rolloutd examples", "GIT_COMMITTER_EMAIL": "examples@rolloutd.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    proc = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip()}")
    return proc.stdout


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _diff_of(repo: Path, files: dict[str, str]) -> str:
    """The diff that turns the base commit into one with ``files`` (then undone)."""
    _write(repo, files)
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "--no-color", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD")
    return diff


def make_repo(inst: Instance, dest: Path) -> dict[str, Any]:
    """Create ``dest/<name>`` (replacing it) and return its ``swe`` task."""
    repo = dest / inst.name
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    _write(repo, {"pyproject.toml": _PYPROJECT.format(name=inst.name),
                  "README.md": f"# {inst.name}\n\nA tiny example repository for rolloutd.\n",
                  **inst.files})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{inst.name}: initial version")
    base = _git(repo, "rev-parse", "HEAD").strip()
    return {
        "kind": "swe",
        "instance_id": f"{inst.name}-1",
        "repo": f"examples/{inst.name}",
        "repo_path": str(repo.resolve()),
        "base_commit": base,
        "problem_statement": inst.issue,
        "test_patch": _diff_of(repo, inst.test_change),
        "patch": _diff_of(repo, inst.fix),
        "FAIL_TO_PASS": list(inst.fail_to_pass),
        "PASS_TO_PASS": list(inst.pass_to_pass),
    }


def make_swe_repos(dest: Path) -> list[dict[str, Any]]:
    """Generate every example repository under ``dest``; return their tasks."""
    dest.mkdir(parents=True, exist_ok=True)
    return [make_repo(inst, dest) for inst in INSTANCES]


def fixed_files(instance_id: str) -> dict[str, str]:
    """The known fix of an instance as whole files (what an agent would write)."""
    for inst in INSTANCES:
        if f"{inst.name}-1" == instance_id:
            return dict(inst.fix)
    raise KeyError(instance_id)
