#!/usr/bin/env python3
"""Build one OCI image per project of the SWE set, and load its instances as tasks.

    .venv/bin/python examples/swe_set/build.py     # build (or find) the images, print them

Each image is the Debian test image of ``tests/_images.py`` (python3, pytest, git) plus one
layer: ``/testbed``, the project's git repository replayed from instances.jsonl (every
instance's base commit on a branch named after its instance id, HEAD on ``main``, the
import commit), files owned by root, WorkingDir ``/testbed``, tag ``latest``.

The toolz image carries an untracked build artefact, as real SWE-bench images do:
``toolz/_version.py`` (versioneer's generated file from the sdist) is kept out of git by
``.git/info/exclude`` but ``toolz/__init__.py`` imports it, so the tests pass when run in
/testbed and fail at import in a fresh clone of the repository.

Images are cached under ``~/.cache/rolloutd-swe-set/<VERSION>/<project>/`` (the parent is
``ROLLOUTD_SWE_SET_IMAGES`` when set): built in a temporary directory, renamed into place,
one flock per version; bump VERSION whenever the recipe changes.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO_ROOT))

import generate  # noqa: E402

from tests import _images  # noqa: E402

log = logging.getLogger("rolloutd.swe_set")

#: Bump on any change of the recipe below (the cache directory is named after it).
VERSION = "v1"
TAG = "latest"
ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ROLLOUTD_IMAGE=swe-set",
)


def default_cache() -> Path:
    """``ROLLOUTD_SWE_SET_IMAGES`` or ``~/.cache/rolloutd-swe-set`` (XDG_CACHE_HOME honoured)."""
    env = os.environ.get("ROLLOUTD_SWE_SET_IMAGES")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rolloutd-swe-set"


def rows_digest(rows: list[dict]) -> str:
    """A short digest of a project's rows: the image is rebuilt when they change."""
    ids = "\n".join(f"{r['instance_id']} {r['base_commit']}" for r in rows)
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


def _link_blob(src: str, dst: str) -> None:
    """Hard-link content-addressed blobs (never rewritten in place), copy the rest."""
    if f"{os.sep}blobs{os.sep}" in src:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def build_project(project: generate.Project, rows: list[dict], debian_oci: Path,
                  out: Path) -> None:
    """The project's image as an OCI layout at ``out/oci`` (``out`` is a fresh dir)."""
    testbed = out / "testbed"
    generate.replay(project, rows, testbed)
    layout = out / "oci"
    shutil.copytree(debian_oci, layout, copy_function=_link_blob)
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    base = f"{layout}:{_images.TAG}"
    _images.run(["umoci", "insert", *rootless, "--image", base, testbed, "/testbed"])
    args = ["umoci", "config", "--image", base, "--tag", TAG,
            "--config.workingdir", "/testbed"]
    for e in ENV:
        args += ["--config.env", e]
    _images.run(args)
    _images.run(["umoci", "rm", "--image", base])
    _images.finish_layout(layout)
    shutil.rmtree(testbed)
    (out / "rows").write_text(rows_digest(rows) + "\n")


def build_swe_set(cache: Path | None = None) -> dict[str, Path]:
    """Build (or find built) every project's image; project name -> OCI layout dir (tag
    ``latest``). Safe to call from several processes at once."""
    root = (cache if cache is not None else default_cache()).absolute() / VERSION
    root.mkdir(parents=True, exist_ok=True)
    by_project = generate.rows_by_project(generate.load_rows())
    layouts: dict[str, Path] = {}
    with _images.locked(root.parent / f"{VERSION}.lock"):
        debian_oci: Path | None = None
        for name, rows in sorted(by_project.items()):
            final = root / name
            fresh = (final / "rows").is_file() and \
                (final / "rows").read_text().strip() == rows_digest(rows)
            if _images.complete(final) and not fresh:
                shutil.rmtree(final)  # instances.jsonl changed: rebuild
            if not _images.complete(final):
                if debian_oci is None:
                    debian_oci = _images.build_test_images().debian_oci
                t0 = time.monotonic()
                with _images.building(final) as tmp:
                    build_project(generate.PROJECTS[name], rows, debian_oci, tmp)
                log.info("swe set: %s built in %.1f s", name, time.monotonic() - t0)
            layouts[name] = final / "oci"
    return layouts


def load_instances(images: dict[str, Path] | None = None) -> list[dict]:
    """instances.jsonl's rows with ``image`` set to ``oci:<layout>:latest`` of their project
    (the images are built first when ``images`` is None)."""
    if images is None:
        images = build_swe_set()
    rows = generate.load_rows()
    for row in rows:
        row["image"] = f"oci:{images[row['repo'].split('/', 1)[1]]}:{TAG}"
    return rows


#: The scripted agent of tests/tasks/test_swe_exact.py and bench/swe_set.py (a TEST DOUBLE,
#: not a model): one bash command that applies the patch :func:`with_patch` handed it.
APPLY_PATCH = ('if [ -n "${ROLLOUTD_BENCH_PATCH:-}" ]; then printf %s "$ROLLOUTD_BENCH_PATCH" '
               '| base64 -d | git apply --whitespace=nowarn - && echo applied; else echo no patch; fi')
VARIANTS = ("gold", "empty", "wrong")


def with_patch(row: dict, variant: str) -> dict:
    """The row as a task whose agent gets the ``variant``'s patch (gold, empty or wrong):
    ``env_setup`` exports it as ROLLOUTD_BENCH_PATCH, so the agent's shell has it (the
    patches themselves are left out of the task); ``id`` is ``<instance_id>:<variant>``."""
    task = {k: v for k, v in row.items() if k not in ("patch", "wrong_patch")}
    patch = {"gold": row["patch"], "wrong": row["wrong_patch"], "empty": ""}[variant]
    encoded = base64.b64encode(patch.encode()).decode()
    task["env_setup"] = f"export ROLLOUTD_BENCH_PATCH={shlex.quote(encoded)}"
    task["id"] = f"{row['instance_id']}:{variant}"
    return task


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.monotonic()
    for name, layout in build_swe_set().items():
        print(f"{name}: oci:{layout}:{TAG}")
    print(f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
