#!/usr/bin/env python3
"""Generate the tiny SWE-style example repositories and their task file.

    python examples/make_swe_repos.py [DEST]      # default: examples/swe-repos

Writes DEST/<name>/ (a git repository per instance: a small package with a bug, its
tests, one commit) and DEST/swe.jsonl (one ``swe`` task per line, with ``repo_path``
pointing at the repository). Submit them with ``rolloutd submit DEST/swe.jsonl``.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.daemon.tasks.swe_examples import make_swe_repos


def main(argv: list[str]) -> int:
    dest = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "swe-repos"
    tasks = make_swe_repos(dest.resolve())
    out = dest / "swe.jsonl"
    with out.open("w") as f:
        for task in tasks:
            f.write(json.dumps(task) + "\n")
    for task in tasks:
        print(f"{task['instance_id']:14} {task['repo_path']}  base {task['base_commit'][:10]}")
    print(f"wrote {len(tasks)} tasks to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
