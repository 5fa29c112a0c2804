"""Test runner copied into evaluation sandboxes; standalone (imports nothing of rolloutd).

    python _runner.py '{"tests": [node ids], "paths": [files], "out": "result.json"}'

Runs the pytest node ids in ``tests`` (or every test in ``paths``) from the current
directory and writes ``{"runner", "results": {node id: outcome}, "exit_code"}`` to ``out``.
Outcomes: passed, failed, error, skipped, missing (a node id that was not collected).
Uses pytest when the interpreter has it; otherwise a small built-in runner that handles
plain test functions and ``Test*`` classes (no fixtures), labelled ``"runner": "builtin"``
(``ROLLOUTD_TEST_RUNNER=builtin`` forces it).

It runs under the task's interpreter, which may be an old Python (SWE-bench images have
3.6+), so it uses no newer syntax: types are given as type comments.
"""

import importlib.util
import inspect
import json
import os
import sys
import traceback
from typing import Any, Dict, List, Set  # noqa: F401, UP035 (type comments; old interpreters)

Results = Dict[str, str]  # noqa: UP006


class _Collector:
    def __init__(self, wanted):
        # type: (Set[str]) -> None
        self.results = {}  # type: Results
        self.wanted = wanted

    def pytest_collection_modifyitems(self, session, config, items):
        # type: (Any, Any, List[Any]) -> None
        if not self.wanted:
            return
        keep = [item for item in items if item.nodeid in self.wanted]
        drop = [item for item in items if item.nodeid not in self.wanted]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_runtest_logreport(self, report):
        # type: (Any) -> None
        prev = self.results.get(report.nodeid)
        if report.when == "call":
            outcome = report.outcome
        elif report.failed:  # setup or teardown failed
            outcome = "error"
        elif report.skipped:
            outcome = "skipped"
        else:
            return
        if prev in ("failed", "error") and outcome != "error":
            return
        self.results[report.nodeid] = outcome

    def pytest_collectreport(self, report):
        # type: (Any) -> None
        if report.failed:
            self.results[report.nodeid or "<collection>"] = "error"


def _run_pytest(pytest, args):
    # type: (Any, Dict[str, Any]) -> Dict[str, Any]
    # Files, not node ids, are passed to pytest (one unknown node id would stop the whole
    # run); the collection hook keeps only the requested tests.
    collector = _Collector(set(args["tests"]))
    targets = list(dict.fromkeys([t.split("::", 1)[0] for t in args["tests"]] + list(args["paths"])))
    code = pytest.main(["-q", "-rN", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--continue-on-collection-errors",
                        "--rootdir", os.getcwd(), *targets],
                       plugins=[collector])
    return {"runner": "pytest", "results": collector.results, "exit_code": int(code)}


def _load(path):
    # type: (str) -> Any
    root = os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)
    name = "_rolloutd_test_" + path.replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, path))
    if spec is None or spec.loader is None:
        raise ImportError("cannot load " + path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _call(fn):
    # type: (Any) -> str
    try:
        fn()
        return "passed"
    except Exception:
        traceback.print_exc()
        return "failed"


def _builtin_node(nodeid, modules):
    # type: (str, Dict[str, Any]) -> str
    parts = nodeid.split("::")
    path = parts[0]
    try:
        if path not in modules:
            modules[path] = _load(path)
        module = modules[path]
    except Exception:
        traceback.print_exc()
        return "error"
    obj = module
    for name in parts[1:]:
        obj = getattr(obj, name.split("[", 1)[0], None)
        if obj is None:
            return "missing"
        if inspect.isclass(obj):
            try:
                obj = obj()
            except Exception:
                return "error"
    return _call(obj) if callable(obj) else "missing"


def _builtin_ids(path):
    # type: (str) -> List[str]
    module = _load(path)
    ids = []  # type: List[str]
    for name, obj in vars(module).items():
        if name.startswith("test") and inspect.isfunction(obj):
            ids.append(f"{path}::{name}")
        elif name.startswith("Test") and inspect.isclass(obj):
            ids += [f"{path}::{name}::{m}" for m in vars(obj) if m.startswith("test")]
    return ids


def _run_builtin(args):
    # type: (Dict[str, Any]) -> Dict[str, Any]
    modules = {}  # type: Dict[str, Any]
    results = {}  # type: Results
    ids = list(args["tests"])
    for path in args["paths"]:
        try:
            ids += _builtin_ids(path)
        except Exception:
            traceback.print_exc()
            results[path] = "error"
    for nodeid in ids:
        results[nodeid] = _builtin_node(nodeid, modules)
    ok = bool(results) and all(v == "passed" for v in results.values())
    return {"runner": "builtin", "results": results, "exit_code": 0 if ok else 1}


def _fill_missing(tests, results):
    # type: (List[str], Results) -> None
    """A requested test with no result is an error if its file failed to import."""
    for nodeid in tests:
        if nodeid not in results:
            path = nodeid.split("::", 1)[0]
            results[nodeid] = "error" if results.get(path) == "error" else "missing"


def main():
    # type: () -> None
    args = json.loads(sys.argv[1])
    out = os.path.abspath(args["out"])
    sys.argv = sys.argv[:1]
    # like `python -m pytest`: the project in the current directory is importable, and
    # this script's own directory is not (it may hold modules named like the stdlib's)
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.path.insert(0, os.getcwd())
    try:
        if os.environ.get("ROLLOUTD_TEST_RUNNER") == "builtin":
            raise ModuleNotFoundError("the built-in runner was asked for", name="pytest")
        import pytest
    except ModuleNotFoundError as exc:
        if exc.name != "pytest":
            raise
        result = _run_builtin(args)
    else:
        result = _run_pytest(pytest, args)
    _fill_missing(args["tests"], result["results"])
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
