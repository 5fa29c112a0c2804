#!/usr/bin/env python3
"""Validate every instance inside its built image (Debian's python3 and pytest 7.2).

    sudo .venv/bin/python examples/swe_set/check_images.py     # root: it uses chroot

For each project: ``umoci unpack`` its image, then for each instance, in ``/testbed`` under
chroot and in place (``git checkout --detach BASE``, apply, run ``test_cmd`` + the test
patch's targets, ``git reset --hard``, ``git clean -fd``): base + test_patch: every
FAIL_TO_PASS fails and every PASS_TO_PASS passes; + gold: all pass; + wrong: some F2P fails.
The log is parsed with the row's official SWE-bench parser. Prints one line per instance and
exits 1 if any instance fails. It takes about three minutes on two cores.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build  # noqa: E402

GIT = "git -c safe.directory='*'"


def targets(row: dict) -> list[str]:
    """The test patch's files as the row's test_directives make them targets."""
    files = re.findall(r"^diff --git a/(\S+) ", row["test_patch"], re.M)
    if row["test_directives"] == "path":
        return files
    return [f.removesuffix(".py").replace("/", ".") for f in files]


def run_in_image(rootfs: Path, row: dict, patches: list[str]) -> set[str]:
    """The ids that pass with ``patches`` applied to the row's base commit in /testbed."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    work = rootfs / "tmp/swe-set-check"
    work.mkdir(parents=True, exist_ok=True)
    steps = ["cd /testbed", f"{GIT} checkout -q -f --detach {row['base_commit']}"]
    for i, patch in enumerate(patches):
        (work / f"{i}.diff").write_text(patch)
        steps.append(f"{GIT} apply /tmp/swe-set-check/{i}.diff")
    test = " ".join([row["test_cmd"], *map(shlex.quote, targets(row))])
    steps.append(f"{{ {test} > /tmp/swe-set-check/log 2>&1 || true; }}")
    script = " && ".join(steps) + f"; {GIT} reset -q --hard && {GIT} clean -qfd"
    subprocess.run(["chroot", str(rootfs), "sh", "-ec", script], check=True)
    status = PARSER_REGISTRY[row["log_parser"]]((work / "log").read_text(), None)
    return {t for t, s in status.items() if s == "PASSED"}


def check(rootfs: Path, row: dict) -> list[str]:
    """What is wrong with one instance in its image (empty when it holds)."""
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    ok = run_in_image(rootfs, row, [row["test_patch"]])
    problems = [f"passes without the fix: {t}" for t in f2p if t in ok]
    problems += [f"P2P fails with the bug: {t}" for t in p2p if t not in ok]
    ok = run_in_image(rootfs, row, [row["patch"], row["test_patch"]])
    problems += [f"fails with the gold patch: {t}" for t in f2p + p2p if t not in ok]
    ok = run_in_image(rootfs, row, [row["wrong_patch"], row["test_patch"]])
    if all(t in ok for t in f2p):
        problems.append("the wrong patch passes every FAIL_TO_PASS test")
    return problems


def main() -> int:
    layouts = build.build_swe_set()
    rows = build.load_instances(layouts)
    failed = 0
    for name, layout in sorted(layouts.items()):
        with tempfile.TemporaryDirectory(prefix=f"swe-set-{name}-") as tmp:
            bundle = Path(tmp) / "bundle"
            subprocess.run(["umoci", "unpack", "--image", f"{layout}:{build.TAG}", str(bundle)],
                           check=True, capture_output=True)
            for row in (r for r in rows if r["repo"] == f"swe-set/{name}"):
                problems = check(bundle / "rootfs", row)
                failed += bool(problems)
                print(row["instance_id"], "ok" if not problems else "; ".join(problems[:3]),
                      flush=True)
    print(f"{len(rows) - failed} of {len(rows)} instances hold in their images")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
