"""SWE grading: the built-in parsers and grading agree with the official harness's (the
``swebench`` package, a dev extra) on real logs made here by pytest and unittest and on the
published log forms of Django's and SymPy's runners; the spec table and eval script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutd.daemon.tasks._swe_grading import grade
from rolloutd.daemon.tasks._swe_parsers import PARSERS
from rolloutd.daemon.tasks._swe_specs import (
    END,
    START,
    build_script,
    directives,
    eval_spec,
    record_exit_code,
    touched_files,
)

swebench_parsers = pytest.importorskip("swebench.harness.log_parsers").PARSER_REGISTRY

TESTS = textwrap.dedent('''
    import pytest

    def test_ok(): pass
    def test_fails(): assert 1 == 2, "one - two"
    @pytest.mark.skip(reason="not today")
    def test_skipped(): pass
    @pytest.mark.xfail
    def test_xfail(): assert False
    @pytest.fixture
    def broken(): raise RuntimeError("fixture")
    def test_error(broken): pass
    @pytest.mark.parametrize("p", ["/abs/path/x", "a b", "1-2"])
    def test_param(p): assert p != "1-2"
    class TestGroup:
        def test_method(self): pass
''')
UNITTESTS = textwrap.dedent('''
    import unittest

    class Cases(unittest.TestCase):
        def test_ok(self): pass
        def test_fails(self): self.assertEqual(1, 2)
        def test_error(self): raise RuntimeError("boom")
        @unittest.skip("later")
        def test_skipped(self): pass
        def test_prints(self): print("some output")
''')
DJANGO_LOG = textwrap.dedent('''
    test_add (admin_views.tests.AdminViewBasicTest) ... ok
    test_change (admin_views.tests.AdminViewBasicTest) ... FAIL
    test_delete (admin_views.tests.AdminViewBasicTest) ... ERROR
    test_skip (admin_views.tests.AdminViewBasicTest) ... skipped 'no db'
    test_slow (admin_views.tests.AdminViewBasicTest) ... System check identified no issues (0 silenced).
    ok
    ======================================================================
    FAIL: test_change (admin_views.tests.AdminViewBasicTest)
    ERROR: test_delete (admin_views.tests.AdminViewBasicTest)
''')
SYMPY_LOG = textwrap.dedent('''
    sympy/core/tests/test_basic.py[3]
    test_equality ok
    test_matches_basic F
    test_has E
    ________________ sympy/core/tests/test_basic.py:test_matches_basic ________________
''')


def run_log(argv: list[str], cwd: Path) -> str:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    return f"+ : '{START}'\n{out.stdout}{out.stderr}+ : '{END}'\n>>>>> Test Exit Code: {out.returncode}\n"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("swe-logs")
    (d / "tests").mkdir()
    (d / "tests" / "__init__.py").write_text("")
    (d / "tests" / "test_mod.py").write_text(TESTS)
    (d / "tests" / "test_unit.py").write_text(UNITTESTS)
    return {
        "pytest": run_log([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                           "tests/test_mod.py"], d),
        "pytest-long": run_log([sys.executable, "-m", "pytest", "-rA", "--tb=long", "-vv",
                                "-p", "no:cacheprovider", "tests/test_mod.py"], d),
        "unittest": run_log([sys.executable, "-m", "unittest", "-v", "tests.test_unit"], d),
        "django": f"+ : '{START}'\n{DJANGO_LOG}+ : '{END}'\n",
        "sympy": f"+ : '{START}'\n{SYMPY_LOG}+ : '{END}'\n",
    }


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_builtin_parser_agrees_with_the_harness(logs, name):
    assert name in swebench_parsers
    for log in logs.values():
        assert PARSERS[name](log) == swebench_parsers[name](log, None), (name, log[:400])


def test_parsers_read_real_runner_output(logs):
    pytest_map = PARSERS["parse_log_pytest"](logs["pytest"])
    assert pytest_map["tests/test_mod.py::test_ok"] == "PASSED"
    assert pytest_map["tests/test_mod.py::test_fails"] == "FAILED"
    # pytest's -rA reports a skip as "SKIPPED [1] path:line: reason": the harness drops it
    assert "tests/test_mod.py::test_skipped" not in pytest_map
    assert pytest_map["tests/test_mod.py::test_xfail"] == "XFAIL"
    assert pytest_map["tests/test_mod.py::test_error"] == "ERROR"
    assert pytest_map["tests/test_mod.py::TestGroup::test_method"] == "PASSED"
    unit = PARSERS["parse_log_django"](logs["unittest"])
    assert unit["test_ok (tests.test_unit.Cases.test_ok)"] == "PASSED"
    assert unit["test_fails (tests.test_unit.Cases.test_fails)"] == "FAILED"
    assert unit["test_error (tests.test_unit.Cases.test_error)"] == "ERROR"
    assert unit["test_skipped (tests.test_unit.Cases.test_skipped)"] == "SKIPPED"
    assert PARSERS["parse_log_django"](logs["django"])[
        "test_slow (admin_views.tests.AdminViewBasicTest)"] == "PASSED"
    assert PARSERS["parse_log_sympy"](logs["sympy"]) == {
        "sympy/core/tests/test_basic.py:test_matches_basic": "FAILED",
        "test_equality": "PASSED", "test_matches_basic": "FAILED", "test_has": "ERROR"}


CASES = [  # (log, parser, FAIL_TO_PASS, PASS_TO_PASS)
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_ok"], ["tests/test_mod.py::TestGroup::test_method"]),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_ok"], ["tests/test_mod.py::test_skipped"]),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_skipped"], []),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_xfail"], ["tests/test_mod.py::test_fails"]),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_ok", "tests/test_mod.py::test_error"], []),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_missing"], []),
    ("pytest", "parse_log_pytest_options", ["tests/test_mod.py::test_param[/x]"], []),
    ("pytest", "parse_log_pytest", ["tests/test_mod.py::test_param[a"], []),  # a truncated id
    ("pytest-long", "parse_log_pytest_v2", ["tests/test_mod.py::test_param[a b]"], []),
    ("unittest", "parse_log_django", ["test_ok (tests.test_unit.Cases.test_ok)"],
     ["test_prints (tests.test_unit.Cases.test_prints)"]),
    ("unittest", "parse_log_django", ["test_ok (tests.test_unit.Cases.test_ok)"],
     ["test_fails (tests.test_unit.Cases.test_fails)"]),
    ("django", "parse_log_django", ["test_add (admin_views.tests.AdminViewBasicTest)"],
     ["test_skip (admin_views.tests.AdminViewBasicTest)"]),
    ("sympy", "parse_log_sympy", ["test_equality"], []),
    ("sympy", "parse_log_sympy", ["test_equality"], ["test_has"]),
]


@pytest.mark.parametrize(("log", "parser", "f2p", "p2p"), CASES)
@pytest.mark.parametrize("eval_type", ["pass_and_fail", "fail_only"])
def test_grading_agrees_with_the_harness(logs, log, parser, f2p, p2p, eval_type):
    ours = grade(logs[log], parser=parser, f2p=f2p, p2p=p2p, eval_type=eval_type, use_swebench=False)
    theirs = grade(logs[log], parser=parser, f2p=f2p, p2p=p2p, eval_type=eval_type, use_swebench=True)
    assert theirs.grader.startswith("swebench ") and ours.grader == "builtin"
    assert (ours.resolution, ours.found, ours.report) == (theirs.resolution, theirs.found, theirs.report)
    assert ours.missing == theirs.missing


def test_grading_voids_what_the_harness_voids(logs):
    log = logs["pytest"]
    no_markers = log.replace(START, "start").replace(END, "end")
    wrong_exit = log.replace(">>>>> Test Exit Code: 1", ">>>>> Test Exit Code: 2").replace(
        "FAILED", "PASSED").replace("ERROR", "PASSED")
    for text in (no_markers, wrong_exit, log + "\n>>>>> Tests Timed Out\n"):
        for use in (False, True):
            g = grade(text, parser="parse_log_pytest", f2p=["tests/test_mod.py::test_ok"], p2p=[],
                      use_swebench=use)
            assert (g.found, g.resolved) == (False, False)
    g = grade(no_markers, parser="parse_log_pytest", f2p=["tests/test_mod.py::test_ok"], p2p=[])
    assert g.markers is False


def test_spec_table_directives_and_script():
    django = eval_spec({"repo": "django/django", "version": "3.0"}, python="python3")
    assert django.test_cmd.startswith("./tests/runtests.py --verbosity 2")
    assert django.log_parser == "parse_log_django" and django.source == "table:django/django"
    assert directives(django, ["tests/admin_views/tests.py", "tests/x/fixture.json"]) == \
        ["admin_views.tests"]
    assert "--parallel" not in eval_spec({"repo": "django/django", "version": "1.9"}, python="p").test_cmd
    sympy = eval_spec({"repo": "sympy/sympy", "version": "1.5"}, python="python3")
    assert "bin/test -C --verbose" in sympy.test_cmd and sympy.log_parser == "parse_log_sympy"
    own = eval_spec({"repo": "django/django", "test_cmd": "python3 -m unittest -v",
                     "test_directives": "module", "log_parser": "parse_log_django"}, python="p")
    assert (own.source, directives(own, ["tests/test_more.py"])) == ("task", ["tests.test_more"])
    default = eval_spec({"repo": "someone/else"}, python="/usr/bin/python3")
    assert default.test_cmd == "/usr/bin/python3 -m pytest -rA -p no:cacheprovider"
    patch = "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/x\n+++ b/x\n" \
            "diff --git a/docs/x.md b/docs/x.md\n"
    assert touched_files(patch) == ["tests/test_a.py", "docs/x.md"]
    script = build_script(default, repo_dir="/testbed", base_commit="abc", env_setup="true",
                          files=touched_files(patch), test_patch_path="/tmp/t.patch")
    lines = script.splitlines()
    test_line = lines.index(f": '{START}'") + 1
    assert lines[test_line] == "/usr/bin/python3 -m pytest -rA -p no:cacheprovider tests/test_a.py"
    assert lines[test_line + 1].endswith("=$?") and "Test Exit Code" in lines[test_line + 3]
    # a row's own eval script (swebench >= 5) runs as it is, its exit status recorded
    row = eval_spec({"eval_script": f"cd /testbed\n: '{START}'\npytest -rA\n: '{END}'\n",
                     "log_parser": "parse_log_pytest"}, python="p")
    assert row.source == "eval_script"
    assert record_exit_code(row.script or "").splitlines()[2:5] == [
        "pytest -rA", "ROLLOUTD_TEST_EXIT_CODE=$?", f": '{END}'"]
