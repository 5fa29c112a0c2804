"""Grading an eval log as the official SWE-bench harness grades it.

With the ``swebench`` package importable (the ``swe`` extra), its own parsers and grading
functions read the log: rolloutd's verdicts are the harness's. Without it, the built-in
equivalents below (and :mod:`._swe_parsers`) do; tests/tasks/test_swe_grading.py checks that
the two agree. The harness's rules, in short:

- the log is usable only with both markers, none of the harness's failure lines, a status
  map that is not empty, and a test command whose non-zero exit status is matched by a
  failed or erroring test in the map;
- a FAIL_TO_PASS test succeeds when PASSED or XFAIL (a truncated parametrised id matches by
  prefix when all its candidates agree); a PASS_TO_PASS test also when SKIPPED;
  ``fail_only`` instances fail only on an explicit FAILED;
- resolved (``RESOLVED_FULL``) when every FAIL_TO_PASS and every PASS_TO_PASS test succeeds.

The rest of :class:`Grade` (which listed tests the log never mentions, whether the markers
were there, the exit status) lets the handler tell a failure of evaluation from the model's.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.tasks._swe_parsers import ERROR, FAILED, PARSERS, PASSED, SKIPPED, XFAIL
from rolloutd.daemon.tasks._swe_specs import END, EXIT, START

FULL, PARTIAL, NO = "RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"
#: Lines of the harness's own log that void a run.
_VOID = (">>>>> Patch Apply Failed", ">>>>> Reset Failed", ">>>>> Tests Errored",
         ">>>>> Tests Timed Out")
_EXIT_RE = re.compile(rf"{re.escape(EXIT)}:\s*(-?\d+)")
MISSING = "MISSING"


@dataclass
class Grade:
    resolution: str
    found: bool  # the harness could read a run from the log
    status_map: dict[str, str]
    report: dict[str, dict[str, list[str]]]
    markers: bool
    exit_code: int | None
    grader: str
    missing: list[str] = field(default_factory=list)  # listed tests the log never names

    @property
    def resolved(self) -> bool:
        return self.resolution == FULL

    def outcomes(self, tests: Sequence[str]) -> dict[str, str]:
        """Each listed test's status in the log (MISSING when it is not there)."""
        return {t: self.status_map.get(_resolve(t, self.status_map) or "", MISSING) for t in tests}


def exit_code(log: str) -> int | None:
    match = _EXIT_RE.search(log)
    return int(match.group(1)) if match else None


def _resolve(case: str, sm: dict[str, str]) -> str | None:
    if case in sm:
        return case
    if case.count("[") > case.count("]"):  # an id the dataset truncated mid-parameter
        matches = [k for k in sm if k.startswith(case)]
        if matches and len({sm[k] in (PASSED, XFAIL) for k in matches}) == 1:
            return matches[0]
    return None


def _passed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is not None and sm[key] in (PASSED, XFAIL)


def _failed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is None or sm[key] in (FAILED, ERROR, SKIPPED)


def _maintained(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return _passed(case, sm) or (key is not None and sm[key] == SKIPPED)


def _builtin_logs_eval(log: str, parser: str) -> tuple[dict[str, str], bool]:
    if any(code in log for code in _VOID) or not (START in log and END in log):
        return {}, False
    sm = PARSERS[parser](log.split(START)[1].split(END)[0])
    if not sm:
        sm = PARSERS[parser](log)
    if not sm:
        return {}, False
    code = exit_code(log)
    if code not in (None, 0) and not any(s in (FAILED, ERROR) for s in sm.values()):
        return {}, False
    return sm, True


def _builtin_report(sm: dict[str, str], f2p: Sequence[str], p2p: Sequence[str],
                    eval_type: str) -> dict[str, dict[str, list[str]]]:
    def split(tests: Sequence[str], ok: Any) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"success": [], "failure": []}
        for t in tests:
            if eval_type == "fail_only":
                out["failure" if sm.get(t) == FAILED else "success"].append(t)
            elif ok(t, sm):
                out["success"].append(t)
            elif _failed(t, sm):
                out["failure"].append(t)
        return out
    return {"FAIL_TO_PASS": split(f2p, _passed), "PASS_TO_PASS": split(p2p, _maintained)}


def resolution(report: dict[str, dict[str, list[str]]]) -> str:
    def ratio(kind: str) -> float:
        done = len(report[kind]["success"]) + len(report[kind]["failure"])
        return 1.0 if done == 0 else len(report[kind]["success"]) / done
    f2p, p2p = ratio("FAIL_TO_PASS"), ratio("PASS_TO_PASS")
    if f2p == 1 and p2p == 1:
        return FULL
    return PARTIAL if 0 < f2p < 1 and p2p == 1 else NO


def swebench_version() -> str | None:
    """The installed swebench's version if its grading imports (no Docker needed), else None."""
    try:
        import swebench
        from swebench.harness import grading  # noqa: F401
    except ImportError:
        return None
    return str(getattr(swebench, "__version__", "?"))


def swebench_parsers() -> set[str]:
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except ImportError:
        return set()
    return set(PARSER_REGISTRY)


def _swebench_grade(log: str, *, parser: str, f2p: Sequence[str], p2p: Sequence[str],
                    eval_type: str, instance_id: str, repo: str, version: str,
                    ) -> tuple[dict[str, str], bool, dict[str, dict[str, list[str]]], str]:
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType
    from swebench.harness.grading import (
        get_eval_tests_report,
        get_logs_eval,
        get_resolution_status,
    )
    from swebench.types import TestSpec

    spec = TestSpec(instance_id=instance_id, image="", eval_script_list=[], repo=repo,
                    version=version, FAIL_TO_PASS=list(f2p), PASS_TO_PASS=list(p2p),
                    log_parser=parser, eval_type=eval_type)
    fd, path = tempfile.mkstemp(prefix="rolloutd-eval-", suffix=".log")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(log)
        sm, found = get_logs_eval(spec, path)
    finally:
        os.unlink(path)
    gold = {FAIL_TO_PASS: list(f2p), PASS_TO_PASS: list(p2p)}
    report = get_eval_tests_report(sm, gold, eval_type=EvalType(eval_type))
    if not found:  # the harness's run_instance: an unreadable log resolves nothing
        return dict(sm), False, {k: report[k] for k in (FAIL_TO_PASS, PASS_TO_PASS)}, NO
    return dict(sm), True, {k: report[k] for k in (FAIL_TO_PASS, PASS_TO_PASS)}, \
        str(get_resolution_status(report))


def grade(log: str, *, parser: str, f2p: Sequence[str], p2p: Sequence[str],
          eval_type: str = "pass_and_fail", instance_id: str = "", repo: str = "",
          version: str = "", use_swebench: bool | None = None) -> Grade:
    """Grade ``log`` (blocking: run it in a thread). ``use_swebench``: None = when importable."""
    version_of = swebench_version() if use_swebench is not False else None
    if use_swebench and version_of is None:
        raise RuntimeError("the swebench package is not importable")
    if version_of is not None and parser in swebench_parsers():
        sm, found, report, status = _swebench_grade(
            log, parser=parser, f2p=f2p, p2p=p2p, eval_type=eval_type,
            instance_id=instance_id, repo=repo, version=version)
        grader = f"swebench {version_of}"
    else:
        sm, found = _builtin_logs_eval(log, parser)
        report = _builtin_report(sm, f2p, p2p, eval_type)
        status = resolution(report) if found else NO
        grader = "builtin"
    if not found:
        status = NO
    # what the log says of each listed test, read with the parser even when the harness
    # voided the run (so a listed test the parser cannot find is told from a failed one)
    names = sm or PARSERS.get(parser, lambda _: {})(
        log.split(START)[1].split(END)[0] if START in log and END in log else log)
    missing = [t for t in dict.fromkeys([*f2p, *p2p]) if _resolve(t, names) is None]
    return Grade(resolution=status, found=found, status_map=dict(names), report=report,
                 markers=START in log and END in log, exit_code=exit_code(log), grader=grader,
                 missing=missing)
