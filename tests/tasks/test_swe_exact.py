"""swe in the instance's own image, scored as the harness scores it: the SWE set
(examples/swe_set: real projects from their sdists, real injected bugs, one image per project)
with its gold, empty and wrong patches, in real bwrap sandboxes, evaluated in place. The
policy is the scripted test double: it applies the patch INIT's env_setup exported. Every
instance runs here (about a minute); bench/swe_set.py runs them all through a daemon."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import trio

from rolloutd.daemon.demo import swe_set_module
from rolloutd.daemon.tasks._swe_grading import grade
from rolloutd.daemon.trajectory import Status

from .conftest import tool_call

pytestmark = pytest.mark.slow
BUILD = swe_set_module()  # examples/swe_set/build.py: images, instances, the scripted agent
APPLY = BUILD.APPLY_PATCH
with_patch = BUILD.with_patch


@pytest.fixture(scope="session")
def swe_set(test_images) -> list[dict[str, Any]]:
    """The SWE set's instances, their images built (cached) on the test Debian image."""
    return BUILD.load_instances()


def subset(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first: dict[str, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["repo"], row)
    return list(first.values())


def listed(row: dict[str, Any], key: str) -> list[str]:
    value = row[key]
    return json.loads(value) if isinstance(value, str) else list(value)


async def test_every_instance_gold_resolves_empty_and_wrong_do_not(image_harness, swe_set):
    rows = swe_set  # all of them (about a minute here): bench/swe_set.py does it through a daemon
    assert len(rows) >= 20 and len(subset(rows)) >= 4
    await image_harness.script([tool_call("bash", command=APPLY), tool_call("finish", answer="done")])
    results: dict[str, Any] = {}
    intake = trio.CapacityLimiter(8)  # the harness's intake holds 16

    async def one(row: dict[str, Any], variant: str) -> None:
        async with intake:
            results[f"{row['instance_id']}:{variant}"] = await image_harness.run(
                with_patch(row, variant), timeout_s=600)

    async with trio.open_nursery() as n:
        for row in rows:
            for variant in ("gold", "empty", "wrong"):
                n.start_soon(one, row, variant)
    for key, tr in sorted(results.items()):
        variant = key.rsplit(":", 1)[1]
        assert tr.status is Status.completed, (key, tr.error, tr.reward_info.get("eval_log_tail"))
        assert tr.reward == (1.0 if variant == "gold" else 0.0), (key, tr.reward_info)
        info = tr.reward_info
        if variant == "empty":
            assert info["reason"] == "empty_patch"
            continue
        # the same log, graded by the official harness's own functions, gives the same verdict
        row = next(r for r in rows if key.startswith(r["instance_id"] + ":"))
        official = grade(info["eval_log"], parser=info["eval_spec"]["log_parser"],
                         f2p=listed(row, "FAIL_TO_PASS"), p2p=listed(row, "PASS_TO_PASS"),
                         use_swebench=True)
        assert official.resolved == (variant == "gold") == info["resolved"], key
        assert "PASSED" in info["FAIL_TO_PASS"].values() or variant == "wrong"


async def test_the_agent_works_in_place_in_the_images_environment(image_harness, swe_set):
    row = subset(swe_set)[0]
    await image_harness.script([
        tool_call("bash", command="pwd; git status --short | head -3; git rev-parse HEAD; "
                                  "python3 -m pytest --version"),
        tool_call("bash", command=APPLY),
        tool_call("finish", answer="done"),
    ])
    tr = await image_harness.run(with_patch(row, "gold"), timeout_s=600)
    assert tr.status is Status.completed and tr.reward == 1.0, (tr.error, tr.reward_info)
    shell = tr.messages[3]["content"]
    assert shell.startswith(row["repo_dir"])  # the agent starts in the image's repository
    head = [line for line in shell.splitlines() if len(line) == 40][0]
    assert head == row["base_commit"] or row["base_commit"] in shell
    assert "pytest" in shell  # the image's test runner is the agent's too
    assert tr.reward_info["grader"].startswith("swebench ")  # the harness's grading, installed


async def test_untracked_build_artefacts_stay_for_evaluation(image_harness, swe_set):
    """The image of one project carries a generated, git-ignored module its package imports
    (as SWE-bench images carry build artefacts): a re-clone would lose it, in place keeps it."""
    row = next(r for r in swe_set if r["repo"] == "swe-set/toolz")
    artefact = "toolz/_version.py"  # versioneer's, imported by toolz/__init__.py (README)
    await image_harness.script([
        tool_call("bash", command=f"git status --porcelain --ignored -- {shlex.quote(artefact)}; "
                                  f"git ls-files --error-unmatch {shlex.quote(artefact)} || echo untracked"),
        tool_call("bash", command=APPLY),
        tool_call("finish", answer="done"),
    ])
    tr = await image_harness.run(with_patch(row, "gold"), timeout_s=600)
    assert "untracked" in tr.messages[3]["content"]
    assert tr.status is Status.completed and tr.reward == 1.0, (tr.error, tr.reward_info)
    assert artefact not in tr.reward_info["patch"]
