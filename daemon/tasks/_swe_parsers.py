"""Test-log parsers with the official SWE-bench harness's semantics, for Python projects.

Each parser reads the text a test command printed and returns ``{test id: status}`` with the
harness's statuses (PASSED, FAILED, SKIPPED, ERROR, XFAIL) and its test ids: pytest's node
ids from the ``-rA`` summary, Django's and unittest's ``test_x (module.Class)`` form,
SymPy's bare ``test_x``. They are looked up by the harness's own names (``parse_log_django``)
and rolloutd uses them when the ``swebench`` package is not installed;
tests/tasks/test_swe_grading.py checks that both give the same maps on the same logs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)

Parser = Callable[[str], dict[str, str]]

#: ``SKIPPED [3] path:line: reason`` is pytest's skip summary: its ``[3]`` is not a test.
_COUNT = re.compile(r"\[\d+\]\Z")
_OPTION = re.compile(r"(.*?)\[(.*)\]")
_COLOUR = re.compile(r"\[(\d+)m")
_CONTROL = str.maketrans("", "", "".join(map(chr, range(1, 32))))


def _summary_line(line: str) -> tuple[str, str] | None:
    """(status, test id) of a pytest ``-rA`` summary line, or None."""
    if not line.startswith(STATUSES):
        return None
    if line.startswith(FAILED):
        line = line.replace(" - ", " ")
    words = line.split()
    if len(words) < 2 or (words[0] == SKIPPED and _COUNT.match(words[1])):
        return None
    return words[0], words[1]


def pytest(log: str) -> dict[str, str]:
    """pytest ``-rA``: ``PASSED tests/test_x.py::test_y`` lines."""
    found: dict[str, str] = {}
    for line in log.split("\n"):
        hit = _summary_line(line)
        if hit is not None:
            found[hit[1]] = hit[0]
    return found


def pytest_options(log: str) -> dict[str, str]:
    """pytest ``-rA`` where a parameter that is an absolute path keeps only its last part."""
    found: dict[str, str] = {}
    for line in log.split("\n"):
        hit = _summary_line(line)
        if hit is None:
            continue
        status, name = hit
        option = _OPTION.search(name)
        if option is not None:
            main, param = option.groups()
            if param.startswith("/") and not param.startswith("//") and "*" not in param:
                param = "/" + param.split("/")[-1]
            name = f"{main}[{param}]"
        found[name] = status
    return found


def pytest_v2(log: str) -> dict[str, str]:
    """pytest with colours and control characters stripped; ids may contain spaces, and old
    pytest's ``path::test STATUS`` lines count too."""
    found: dict[str, str] = {}
    for raw in log.split("\n"):
        line = _COLOUR.sub("", raw).translate(_CONTROL)
        if line.startswith(STATUSES):
            if line.startswith(FAILED):
                line = line.split(" - ", 1)[0]
            words = line.split()
            if len(words) >= 2 and not (words[0] == SKIPPED and _COUNT.match(words[1])):
                found[" ".join(words[1:])] = words[0]
        elif line.endswith(STATUSES):
            words = line.split()
            if len(words) >= 2:
                found[" ".join(words[:-1])] = words[-1]
    return found


_DJANGO_OK = (" ... ok", " ... OK", " ...  OK")
_DJANGO_SPLIT = (
    r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
    r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
    r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
)


def django(log: str) -> dict[str, str]:
    """Django's runner (and unittest's) at verbosity 2: ``test_x (module.Class) ... ok``."""
    found: dict[str, str] = {}
    previous: str | None = None
    for raw in log.split("\n"):
        line = raw.strip()
        if "--version is equivalent to version" in line:
            found["--version is equivalent to version"] = PASSED
        if " ... " in line:
            previous = line.split(" ... ")[0]
        for suffix in _DJANGO_OK:
            if line.endswith(suffix):
                if line.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    line = line.split("...", 1)[-1].strip()  # a migration's output ran into it
                found[line.rsplit(suffix, 1)[0]] = PASSED
                break
        if " ... skipped" in line:
            found[line.split(" ... skipped")[0]] = SKIPPED
        if line.endswith(" ... FAIL"):
            found[line.split(" ... FAIL")[0]] = FAILED
        if line.startswith("FAIL:"):
            found[line.split()[1].strip()] = FAILED
        if line.endswith(" ... ERROR"):
            found[line.split(" ... ERROR")[0]] = ERROR
        if line.startswith("ERROR:"):
            found[line.split()[1].strip()] = ERROR
        if line.lstrip().startswith("ok") and previous is not None:
            found[previous] = PASSED  # the test printed between "..." and its "ok"
    for pattern in _DJANGO_SPLIT:  # a long message of Django's split a result line
        for match in re.finditer(pattern, log, re.MULTILINE):
            found[match.group(1)] = PASSED
    return found


def seaborn(log: str) -> dict[str, str]:
    """seaborn's pytest output: ``FAILED id`` and ``id PASSED ...`` lines."""
    found: dict[str, str] = {}
    for line in log.split("\n"):
        words = line.split()
        if len(words) < 2:
            continue
        if line.startswith(FAILED):
            found[words[1]] = FAILED
        elif f" {PASSED} " in line:
            if words[1] == PASSED:
                found[words[0]] = PASSED
        elif line.startswith(PASSED):
            found[words[1]] = PASSED
    return found


_SYMPY_FAILURE = re.compile(r"(_*) (.*)\.py:(.*) (_*)")


def sympy(log: str) -> dict[str, str]:
    """SymPy's bin/test: ``test_x ok`` / ``test_x F`` / ``test_x E`` and failure headers."""
    found: dict[str, str] = {}
    for match in _SYMPY_FAILURE.findall(log):
        found[f"{match[1]}.py:{match[2]}"] = FAILED
    for raw in log.split("\n"):
        line = raw.strip()
        if not line.startswith("test_"):
            continue
        if line.endswith(" E"):
            found[line.split()[0]] = ERROR
        if line.endswith(" F"):
            found[line.split()[0]] = FAILED
        if line.endswith(" ok"):
            found[line.split()[0]] = PASSED
    return found


def matplotlib(log: str) -> dict[str, str]:
    """pytest ``-rA`` with matplotlib's mouse-button enum names as their numbers."""
    return pytest(log.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3"))


#: The harness's parser names (as swebench's PARSER_REGISTRY has them) -> parser.
PARSERS: dict[str, Parser] = {
    "parse_log_pytest": pytest,
    "parse_log_pytest_options": pytest_options,
    "parse_log_pytest_v2": pytest_v2,
    "parse_log_django": django,
    "parse_log_seaborn": seaborn,
    "parse_log_sympy": sympy,
    "parse_log_matplotlib": matplotlib,
    **{f"parse_log_{name}": pytest for name in
       ("astroid", "flask", "marshmallow", "pvlib", "pyvista", "sqlfluff", "xarray")},
    **{f"parse_log_{name}": pytest_options for name in ("pydicom", "requests", "pylint")},
    **{f"parse_log_{name}": pytest_v2 for name in ("astropy", "scikit", "sphinx")},
}
