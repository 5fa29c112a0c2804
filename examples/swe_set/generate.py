#!/usr/bin/env python3
"""Generate the SWE-smith-style task set: real projects, injected bugs, hidden tests.

    .venv/bin/python examples/swe_set/generate.py [PROJECT...]   # rewrites instances.jsonl

(with PROJECT names, only their rows are regenerated and the others kept).

For each project of PROJECTS: unpack its vendored sdist (``sdists/``), commit it as
"import NAME VERSION" in a fresh git repository, then try AST-located one-token mutations
of its source functions in a fixed pseudo-random order. A mutation is kept when 1 to 5
tests that pass on the import fail with it and each of them is a plain function or method
that can be cut from its test file. The instance's base commit holds the mutated source
with those tests removed; ``patch`` (gold) restores the source, ``test_patch`` restores the
tests, ``wrong_patch`` mutates another spot and leaves the bug. Every instance is then
validated in place by the project's own runner before it is written out.

The git repositories are reproducible (pinned identity and dates), so ``build.py`` can
replay instances.jsonl onto a fresh import and get the very same commit ids.
Nothing is downloaded; the only inputs are the sdists.
"""

from __future__ import annotations

import ast
import atexit
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDISTS = HERE / "sdists"
INSTANCES = HERE / "instances.jsonl"

#: Pinned commit identity and dates: the same inputs always give the same commit ids.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "swe-set",
    "GIT_AUTHOR_EMAIL": "swe-set@localhost",
    "GIT_COMMITTER_NAME": "swe-set",
    "GIT_COMMITTER_EMAIL": "swe-set@localhost",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}
PYTEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
UNITTEST_CMD = "python3 -m unittest -v"
MIN_F2P, MAX_F2P, MAX_P2P = 1, 5, 50
RUN_TIMEOUT = 120
#: Optional test dependencies a host venv may have and the images' python3 has not: hidden
#: from the test runs (importing them raises ImportError), so the tests that need them skip
#: here as they do in the image and are never PASS_TO_PASS.
HIDDEN_MODULES = ("numpy", "pandas", "wcwidth")


@dataclass(frozen=True)
class Project:
    """One source project: where its code and tests are and how its tests run."""

    name: str
    version: str
    licence: str
    sources: tuple[str, ...]  # files whose functions get mutated
    trial_targets: tuple[str, ...]  # what the runner gets while mutations are tried
    runner: str  # "pytest" or "unittest"
    instances: int = 6  # how many instances to keep
    #: untracked files kept out of git through .git/info/exclude (build artefacts)
    exclude: tuple[str, ...] = ()
    #: test ids never used as PASS_TO_PASS (they depend on what the interpreter was built with)
    p2p_skip: str = r"^$"
    max_tries: int = 80

    @property
    def sdist(self) -> Path:
        return SDISTS / f"{self.name}-{self.version}.tar.gz"

    @property
    def test_cmd(self) -> str:
        return PYTEST_CMD if self.runner == "pytest" else UNITTEST_CMD

    @property
    def directives(self) -> str:
        return "path" if self.runner == "pytest" else "module"

    @property
    def parser(self) -> str:
        return "parse_log_pytest" if self.runner == "pytest" else "parse_log_django"


PROJECTS: dict[str, Project] = {
    p.name: p
    for p in (
        Project("six", "1.16.0", "MIT", ("six.py",), ("test_six.py",), "pytest",
                # test_move_items* import tkinter, dbm, ...: not in every python3
                p2p_skip=r"::test_move_items", max_tries=150),
        Project(
            "toolz", "0.12.1", "BSD-3-Clause",
            ("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py"),
            ("toolz/tests",), "pytest",
            # versioneer's pre-generated file: the package imports it unconditionally
            exclude=("toolz/_version.py",),
        ),
        Project(
            "more-itertools", "10.2.0", "MIT",
            ("more_itertools/more.py", "more_itertools/recipes.py"),
            ("tests/test_more.py", "tests/test_recipes.py"), "unittest",
        ),
        Project("tabulate", "0.9.0", "MIT", ("tabulate/__init__.py",), ("test",), "pytest"),
    )
}


# ---------------------------------------------------------------------------- git


def git(repo: Path, *args: str, stdin: str | None = None) -> str:
    """Run git in ``repo`` with the pinned identity; return stdout; raise on failure."""
    proc = subprocess.run(
        ["git", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
        cwd=repo, input=stdin, capture_output=True, text=True,
        env={**os.environ, **GIT_ENV}, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def diff(repo: Path, old: str, new: str | None, paths: Iterable[str]) -> str:
    """``git diff`` between two commits (or a commit and the work tree) for ``paths``."""
    ends = [old] if new is None else [old, new]
    return git(repo, "diff", "--no-color", "--no-ext-diff", *ends, "--", *paths)


def commit_all(repo: Path, message: str) -> str:
    """Stage everything git does not ignore, commit, return the commit id."""
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def unpack(project: Project, dest: Path) -> None:
    """The sdist's files at ``dest`` (its top directory stripped, egg-info dropped)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(project.sdist) as tar:
        top = f"{project.name}-{project.version}/"
        for member in tar.getmembers():
            if not member.name.startswith(top) or not (member.isfile() or member.isdir()):
                continue
            rel = member.name[len(top):]
            if not rel or ".egg-info" in rel:
                continue
            member.name = rel
            tar.extract(member, dest, filter="data")


def import_repo(project: Project, dest: Path) -> str:
    """A git repository at ``dest`` holding the sdist as one commit on ``main``."""
    unpack(project, dest)
    git(dest, "init", "-q", "-b", "main")
    if project.exclude:
        exclude = dest / ".git/info/exclude"
        exclude.parent.mkdir(exist_ok=True)
        exclude.write_text("".join(f"/{p}\n" for p in project.exclude))
    return commit_all(dest, f"import {project.name} {project.version}")


def replay(project: Project, rows: list[dict], dest: Path) -> dict[str, str]:
    """The project's repository at ``dest`` with every row's base commit on a branch named
    after its instance id (rebuilt from the patches; ids checked); HEAD on ``main``."""
    root = import_repo(project, dest)
    shas = {}
    for row in rows:
        git(dest, "checkout", "-q", "-B", row["instance_id"], root)
        for patch in (row["patch"], row["test_patch"]):
            git(dest, "apply", "-R", "--whitespace=nowarn", "-", stdin=patch)
        sha = commit_all(dest, f"{row['instance_id']}: base")
        if sha != row["base_commit"]:
            raise RuntimeError(f"{row['instance_id']}: replay gives {sha}, "
                               f"instances.jsonl has {row['base_commit']}")
        shas[row["instance_id"]] = sha
    git(dest, "checkout", "-q", "main")
    return shas


# ---------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` by ``new`` at byte columns [col, end) of line ``line`` (1-based)."""

    path: str
    func: str
    line: int
    col: int
    end: int
    old: bytes
    new: bytes
    kind: str

    def apply(self, source: bytes) -> bytes:
        lines = source.splitlines(keepends=True)
        text = lines[self.line - 1]
        assert text[self.col:self.end] == self.old, (self, text)
        lines[self.line - 1] = text[:self.col] + self.new + text[self.end:]
        return b"".join(lines)


FLIPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
         "is not": "is", "is": "is not", "not in": "in", "in": "not in"}
_OP_RE = re.compile(rb"^(\s*\)*\s*)(is not|not in|<=|>=|==|!=|<|>|is|in)(\s*\(*\s*)$")


def _gap(lines: list[bytes], a: ast.AST, b: ast.AST) -> tuple[int, int, int] | None:
    """(line, start col, end col) of the text between nodes a and b when on one line."""
    if a.end_lineno != b.lineno:
        return None
    return a.end_lineno, a.end_col_offset, b.col_offset  # type: ignore[return-value]


def _sites(node: ast.AST, lines: list[bytes]) -> Iterator[tuple[int, int, int, bytes, bytes, str]]:
    """Mutation sites of one expression node: (line, col, end, old, new, kind)."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        gap = _gap(lines, node.left, node.comparators[0])
        if gap:
            line, a, b = gap
            m = _OP_RE.match(lines[line - 1][a:b])
            if m:
                op = m.group(2).decode()
                s, e = a + m.start(2), a + m.end(2)
                yield line, s, e, m.group(2), FLIPS[op].encode(), "flipped comparison"
    elif isinstance(node, ast.BoolOp):
        gap = _gap(lines, node.values[0], node.values[1])
        if gap:
            line, a, b = gap
            seg = lines[line - 1][a:b]
            word = b"and" if isinstance(node.op, ast.And) else b"or"
            other = b"or" if word == b"and" else b"and"
            m = re.match(rb"^(\s*\)*\s*)" + word + rb"(\s*\(*\s*)$", seg)
            if m:
                yield line, a + m.end(1), a + m.end(1) + len(word), word, other, "swapped and/or"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        if node.lineno == node.operand.lineno:
            line, a, b = node.lineno, node.col_offset, node.operand.col_offset
            seg = lines[line - 1][a:b]
            if re.fullmatch(rb"not\s+", seg):
                yield line, a, b, seg, b"", "dropped not"
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        gap = _gap(lines, node.left, node.right)
        if gap:
            line, a, b = gap
            m = re.match(rb"^(\s*\)*\s*)([-+])(\s*\(*\s*)$", lines[line - 1][a:b])
            if m:
                op = m.group(2)
                yield line, a + m.start(2), a + m.end(2), op, b"-" if op == b"+" else b"+", \
                    "swapped + and -"
    elif isinstance(node, ast.Return) and isinstance(node.value, ast.Name) \
            and node.value.lineno == node.value.end_lineno:
        v = node.value
        seg = lines[v.lineno - 1][v.col_offset:v.end_col_offset]
        yield v.lineno, v.col_offset, v.end_col_offset, seg, b"None", "changed return value"
    elif (isinstance(node, ast.Constant) and type(node.value) is int
          and node.lineno == node.end_lineno):
        line, a, b = node.lineno, node.col_offset, node.end_col_offset
        seg = lines[line - 1][a:b]
        if seg.isdigit():
            value = int(seg)
            new = value + 1 if value in (0, 1) else value - 1
            yield line, a, b, seg, str(new).encode(), "off-by-one constant"
    elif (isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)
          and node.value.value in (True, False) and type(node.value.value) is bool):
        v = node.value
        seg = lines[v.lineno - 1][v.col_offset:v.end_col_offset]
        yield v.lineno, v.col_offset, v.end_col_offset, seg, str(not v.value).encode(), \
            "changed return value"


def mutations(path: str, source: bytes) -> list[Mutation]:
    """Every mutation site inside the function bodies of a module, in source order."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found: list[Mutation] = []

    def visit_function(fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # not the docstring
        for stmt in body:
            for node in ast.walk(stmt):
                for line, col, end, old, new, kind in _sites(node, lines):
                    found.append(Mutation(path, name, line, col, end, old, new, kind))

    def visit_block(stmts: list[ast.stmt], prefix: str) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                visit_function(stmt, prefix + stmt.name)
            elif isinstance(stmt, ast.ClassDef):
                visit_block(stmt.body, f"{prefix}{stmt.name}.")
            elif isinstance(stmt, ast.If | ast.Try):  # e.g. ``if PY3: def ...``
                for block in (stmt.body, stmt.orelse, getattr(stmt, "finalbody", [])):
                    visit_block(block, prefix)
                for handler in getattr(stmt, "handlers", []):
                    visit_block(handler.body, prefix)

    visit_block(tree.body, "")
    unique = {(m.line, m.col): m for m in found}  # a node is walked once per enclosing stmt
    return sorted(unique.values(), key=lambda m: (m.line, m.col))


# ---------------------------------------------------------------------------- running tests


def host_command(project: Project, targets: Iterable[str]) -> list[str]:
    """The project's test command for this host (this interpreter stands for python3)."""
    argv = project.test_cmd.split()
    return [sys.executable, *argv[1:], *targets]


def targets_for(project: Project, test_files: Iterable[str]) -> list[str]:
    """Test files as the runner's targets (the row's ``test_directives``)."""
    if project.directives == "path":
        return list(test_files)
    return [f.removesuffix(".py").replace("/", ".") for f in test_files]


def hidden_modules_dir() -> Path:
    """A directory of stubs that shadow HIDDEN_MODULES (made once per process)."""
    global _HIDDEN_DIR
    if _HIDDEN_DIR is None:
        _HIDDEN_DIR = Path(tempfile.mkdtemp(prefix="swe-set-hidden-"))
        atexit.register(shutil.rmtree, _HIDDEN_DIR, True)
        for name in HIDDEN_MODULES:
            (_HIDDEN_DIR / f"{name}.py").write_text(
                f"raise ImportError('{name} is hidden: the images have no {name}')\n")
    return _HIDDEN_DIR


_HIDDEN_DIR: Path | None = None


def run_tests(project: Project, repo: Path, targets: Iterable[str]) -> tuple[dict[str, str], str]:
    """Run the project's tests in ``repo``; (test id -> status by the official parser, log)."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "COLUMNS": "200", "PYTHONPATH": str(hidden_modules_dir())}
    try:
        proc = subprocess.run(host_command(project, targets), cwd=repo, capture_output=True,
                              text=True, env=env, timeout=RUN_TIMEOUT, check=False)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return {}, "timeout"
    return PARSER_REGISTRY[project.parser](log, None), log


def passing(status: dict[str, str]) -> set[str]:
    return {t for t, s in status.items() if s == "PASSED"}


# ---------------------------------------------------------------------------- hidden tests


@dataclass(frozen=True)
class TestRef:
    """Where a test id's function is: file, class (or None) and function name."""

    __test__ = False
    file: str
    cls: str | None
    func: str


_DJANGO_ID = re.compile(r"^(\w+) \(([\w.]+)\.(\w+)\.(\w+)\)$")


def docstring_owners(log: str) -> dict[str, str | None]:
    """unittest -v shows a test with a docstring as ``name (module.Class.name)`` and, on the
    next line, ``First docstring line ... ok``: the parser's id is then the docstring line.
    Map each such id to the ``name (...)`` line (None when two tests share the docstring)."""
    owners: dict[str, str | None] = {}
    lines = log.splitlines()
    for prev, line in itertools.pairwise(lines):
        if _DJANGO_ID.match(prev.strip()) and " ... " in line:
            doc = line.strip().split(" ... ")[0]
            owners[doc] = None if doc in owners else prev.strip()
    return owners


def locate(project: Project, test_id: str, owners: dict[str, str | None]) -> TestRef | None:
    """The function behind a test id (a parametrized test's function, a docstring id's
    method), or None if it is not a plain function or method."""
    if project.runner == "pytest":
        parts = test_id.split("[", 1)[0].split("::")
        if len(parts) not in (2, 3):
            return None
        return TestRef(parts[0], parts[1] if len(parts) == 3 else None, parts[-1])
    test_id = owners.get(test_id) or test_id
    m = _DJANGO_ID.match(test_id)
    if not m or m.group(1) != m.group(4):
        return None
    return TestRef(m.group(2).replace(".", "/") + ".py", m.group(3), m.group(1))


def in_file(project: Project, test_id: str, test_file: str, owners: dict[str, str | None]) -> bool:
    """Whether a test id belongs to ``test_file``."""
    ref = locate(project, test_id, owners)
    return ref is not None and ref.file == test_file


def remove_tests(source: str, refs: list[TestRef]) -> str | None:
    """``source`` without the functions of ``refs`` (decorators included), or None when one
    is not found or a class would be left empty."""
    tree = ast.parse(source)
    cut: list[tuple[int, int]] = []
    for ref in refs:
        scope: list[ast.stmt] = tree.body
        if ref.cls is not None:
            classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ref.cls]
            if len(classes) != 1:
                return None
            scope = classes[0].body
        fns = [n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
               and n.name == ref.func]
        if len(fns) != 1:
            return None
        fn = fns[0]
        if ref.cls is not None and len(scope) == sum(1 for r in refs if r.cls == ref.cls):
            return None
        start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        cut.append((start, fn.end_lineno or fn.lineno))
    lines = source.splitlines(keepends=True)
    for start, end in sorted(cut, reverse=True):
        stop = end
        while stop < len(lines) and not lines[stop].strip() and start > 1 \
                and not lines[start - 2].strip():
            stop += 1
        del lines[start - 1:stop]
    return "".join(lines)


# ---------------------------------------------------------------------------- problem text


def stable(text: str) -> str:
    """``text`` without memory addresses (``0x7f..``, also where pytest cut a repr short),
    so that the same run always gives the same problem statement."""
    text = re.sub(r"0x[0-9a-f]+", "0x...", text)
    return re.sub(r"\.\.\.[0-9a-f]{4,}>", "...>", text)


def first_error(project: Project, log: str, test_id: str) -> str:
    """The first line of a failing test's error as the log shows it (addresses removed)."""
    return stable(_first_error(project, log, test_id))


def _first_error(project: Project, log: str, test_id: str) -> str:
    if project.runner == "pytest":
        name = test_id.split("::", 1)[1].replace("::", ".")
        m = re.search(rf"^_+ {re.escape(name)} _+$(.*?)(?=^_{{3,}} |^=+ )", log, re.M | re.S)
        block = m.group(1) if m else ""
        for line in block.splitlines():
            if line.startswith("E "):
                return line[1:].strip()[:300]
    else:
        m = re.search(rf"^(?:FAIL|ERROR): {re.escape(test_id)}$(.*?)(?=^={{20,}}|^-{{20,}}\nRan )",
                      log, re.M | re.S)
        block = m.group(1) if m else ""
        for line in block.splitlines():
            if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Exit)\b", line):
                return line.strip()[:300]
    return "the test fails"


def problem_statement(project: Project, mut: Mutation, shown: list[str], log: str) -> str:
    """An issue-style report of the failing behaviour; it names no fix."""
    module = mut.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    func = mut.func
    checks = "\n".join(f"- `{t}`:\n      {first_error(project, log, t)}" for t in shown)
    return (
        f"`{module}.{func}` gives wrong results\n\n"
        f"With {project.name} {project.version}, `{func}` (in `{mut.path}`) no longer behaves "
        f"as documented. These checks of its behaviour fail:\n\n{checks}\n\n"
        f"`{func}` should behave as its documentation and the rest of the test suite "
        f"describe; other functions look unaffected.\n"
    )


# ---------------------------------------------------------------------------- instances


@dataclass
class Candidate:
    """A kept mutation and what it breaks."""

    mutation: Mutation
    f2p: list[str]
    p2p: list[str]
    refs: list[TestRef]
    log: str
    shown: list[str]  # the F2P ids as the log's headers name them (docstring ids resolved)


def spread(items: list[str], cap: int) -> list[str]:
    """At most ``cap`` of ``items`` (sorted), evenly spaced, deterministic."""
    items = sorted(items)
    if len(items) <= cap:
        return items
    step = len(items) / cap
    return [items[int(i * step)] for i in range(cap)]


@dataclass(frozen=True)
class Baseline:
    """The trial tests' results on the import commit."""

    passed: set[str]
    owners: dict[str, str | None]  # docstring ids (unittest), see docstring_owners

    def siblings(self, test_id: str) -> set[str]:
        """A parametrized pytest id's passing siblings (the same function), itself included."""
        if "[" not in test_id:
            return {test_id}
        stem = test_id.split("[", 1)[0] + "["
        return {t for t in self.passed if t.startswith(stem)}


def try_mutation(project: Project, repo: Path, mut: Mutation, base: Baseline
                 ) -> Candidate | None:
    """Run the trial tests with ``mut`` applied; a Candidate if it breaks 1-5 plain tests."""
    path = repo / mut.path
    original = path.read_bytes()
    try:
        path.write_bytes(mut.apply(original))
        status, log = run_tests(project, repo, project.trial_targets)
    finally:
        path.write_bytes(original)
    if not status:
        return None
    broken = sorted(base.passed - passing(status))
    if not MIN_F2P <= len(broken) <= MAX_F2P:
        return None
    if any(not base.siblings(t) <= set(broken) for t in broken):
        return None  # a parametrized function that partly passes cannot be hidden
    found = [locate(project, t, base.owners) for t in broken]
    refs = sorted({r for r in found if r is not None}, key=lambda r: (r.file, r.cls or "", r.func))
    if len(refs) != len({(r.file, r.cls, r.func) for r in refs}) or None in found:
        return None
    files = sorted({r.file for r in refs})
    others = [t for t in base.passed & passing(status)
              if any(in_file(project, t, f, base.owners) for f in files)
              and not re.search(project.p2p_skip, t)]
    shown = [base.owners.get(t) or t for t in broken]
    return Candidate(mut, broken, spread(others, MAX_P2P), refs, log, shown)


def wrong_variants(mut: Mutation, buggy: bytes) -> list[Mutation]:
    """Other mutations of the buggy source, same function first, then nearest lines."""
    others = [m for m in mutations(mut.path, buggy) if (m.line, m.col) != (mut.line, mut.col)]
    return sorted(others, key=lambda m: (m.func != mut.func, abs(m.line - mut.line), m.col))


def make_instance(project: Project, repo: Path, root: str, cand: Candidate, n: int) -> dict | None:
    """Commit the instance's base on its branch, build its patches, validate it; the row or
    None if validation fails."""
    iid = f"{project.name}-{n}"
    mut = cand.mutation
    git(repo, "checkout", "-q", "-B", iid, root)
    src = repo / mut.path
    buggy = mut.apply(src.read_bytes())
    src.write_bytes(buggy)
    test_files = sorted({r.file for r in cand.refs})
    for f in test_files:
        reduced = remove_tests((repo / f).read_text(), [r for r in cand.refs if r.file == f])
        if reduced is None:
            git(repo, "checkout", "-q", "-f", "main")
            return None
        (repo / f).write_text(reduced)
    base = commit_all(repo, f"{iid}: base")
    row = {
        "kind": "swe", "instance_id": iid, "repo": f"swe-set/{project.name}",
        "version": project.version, "base_commit": base,
        "problem_statement": problem_statement(project, mut, cand.shown, cand.log),
        "patch": diff(repo, base, root, [mut.path]),
        "test_patch": diff(repo, base, root, test_files),
        "wrong_patch": "",
        "FAIL_TO_PASS": json.dumps(cand.f2p), "PASS_TO_PASS": json.dumps(cand.p2p),
        "repo_dir": "/testbed", "test_cmd": project.test_cmd,
        "test_directives": project.directives, "log_parser": project.parser,
        "image": f"swe-set/{project.name}",
    }
    for wrong in wrong_variants(mut, buggy)[:5]:
        src.write_bytes(wrong.apply(buggy))
        row["wrong_patch"] = diff(repo, base, None, [mut.path])
        git(repo, "checkout", "-q", "-f", base, "--", ".")
        problems = validate(project, repo, row)
        if not problems:
            return row
        print(f"  {iid}: rejected: {problems[0]}", file=sys.stderr)
    return None


def patched_run(project: Project, repo: Path, row: dict, patches: list[str]) -> dict[str, str]:
    """In place: base commit + ``patches`` applied, the test patch's files run; reset after."""
    git(repo, "checkout", "-q", "-f", "--detach", row["base_commit"])
    try:
        for p in patches:
            git(repo, "apply", "--whitespace=nowarn", "-", stdin=p)
        files = re.findall(r"^diff --git a/(\S+) ", row["test_patch"], re.M)
        status, _ = run_tests(project, repo, targets_for(project, files))
        return status
    finally:
        git(repo, "reset", "-q", "--hard")
        git(repo, "clean", "-q", "-fd")


def validate(project: Project, repo: Path, row: dict) -> list[str]:
    """What is wrong with an instance (empty when valid), checked by real runs in ``repo``:
    base + test patch: F2P fail, P2P pass; + gold: all pass; + wrong: some F2P fails."""
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    problems = []
    ok = passing(patched_run(project, repo, row, [row["test_patch"]]))
    problems += [f"passes without the fix: {t}" for t in f2p if t in ok]
    problems += [f"P2P fails with the bug: {t}" for t in p2p if t not in ok]
    ok = passing(patched_run(project, repo, row, [row["patch"], row["test_patch"]]))
    problems += [f"fails with the gold patch: {t}" for t in f2p + p2p if t not in ok]
    ok = passing(patched_run(project, repo, row, [row["wrong_patch"], row["test_patch"]]))
    if all(t in ok for t in f2p):
        problems.append("the wrong patch passes every FAIL_TO_PASS test")
    return problems


def generate_project(project: Project, work: Path) -> list[dict]:
    """The validated instances of one project (its repository is built under ``work``)."""
    repo = work / project.name
    root = import_repo(project, repo)
    status, log = run_tests(project, repo, project.trial_targets)
    base = Baseline(passing(status), docstring_owners(log))
    candidates = [m for p in project.sources for m in mutations(p, (repo / p).read_bytes())]
    random.Random(f"{project.name}-{project.version}").shuffle(candidates)
    rows: list[dict] = []
    used_funcs: set[tuple[str, str]] = set()
    for tries, mut in enumerate(candidates):
        if len(rows) >= project.instances or tries >= project.max_tries:
            break
        if (mut.path, mut.func) in used_funcs:
            continue
        cand = try_mutation(project, repo, mut, base)
        if cand is None:
            continue
        row = make_instance(project, repo, root, cand, len(rows) + 1)
        git(repo, "checkout", "-q", "-f", "main")
        if row is not None:
            used_funcs.add((mut.path, mut.func))
            rows.append(row)
            print(f"  {row['instance_id']}: {mut.kind} in {mut.func} ({mut.path}:{mut.line}), "
                  f"{len(cand.f2p)} F2P, {len(cand.p2p)} P2P", file=sys.stderr)
    return rows


def main(names: list[str]) -> None:
    """Regenerate the rows of the projects ``names`` (all when empty); keep the others."""
    unknown = set(names) - set(PROJECTS)
    if unknown:
        raise SystemExit(f"unknown projects: {sorted(unknown)}; known: {sorted(PROJECTS)}")
    old = rows_by_project(load_rows()) if names and INSTANCES.is_file() else {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="swe-set-") as tmp:
        for project in PROJECTS.values():
            if names and project.name not in names:
                rows += old.get(project.name, [])
                continue
            print(f"{project.name} {project.version}:", file=sys.stderr)
            rows += generate_project(project, Path(tmp))
    with open(INSTANCES, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} instances to {INSTANCES}", file=sys.stderr)


def load_rows(path: Path = INSTANCES) -> list[dict]:
    """The rows of instances.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_by_project(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by project name (``repo`` is ``swe-set/<name>``)."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["repo"].split("/", 1)[1], []).append(row)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
