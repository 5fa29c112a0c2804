"""The dashboard with 10,000 finished rollouts in a real daemon's result store: every page
loads in at most 2 s, in Chromium and in Firefox.

The store is filled through the API like any client would: 1,250 groups of 8 ``sleep``
rollouts (a labelled test task: no sandbox, no model, 0 s per stage; rewards vary, one group
in 50 fails in eval) and a group of 2 ``calc`` rollouts (the scripted backend, a labelled
TEST DOUBLE) whose trajectory has real tokens. Each page is then loaded afresh (from
about:blank, so the script, the API calls and the rendering all count) and timed in the page
with ``performance.now()`` (milliseconds since the navigation started) at the moment the
test sees its content rendered (polled every 20 ms). Screenshots are saved under the test's
tmp_path (named in the output); the times are printed as ``LOAD browser page ms``.

Needs the ``chromium`` and ``firefox-esr`` Debian packages (CI installs both in .ci/run):
skipped without them, except under CI, where a missing browser fails the test.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon._bidi import FIREFOX, Firefox
from tests.daemon.test_dashboard_browser import (
    CALC_REPLIES,
    CHROMIUM,
    TOKEN,
    WINDOW,
    Browser,
    Page,
    _submit,
    chromium,  # noqa: F401  (fixture)
    firefox,  # noqa: F401  (fixture)
)
from tests.hostile._daemon import Daemon

pytestmark = pytest.mark.slow

GROUPS = 1250
GROUP_SIZE = 8
FINISHED = GROUPS * GROUP_SIZE + 2  # and the 2 calc rollouts
#: The budget of one page load, navigation to content rendered (issue 23).
BUDGET_MS = 2000.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A daemon whose result store holds 10,002 finished rollouts."""
    if CHROMIUM is None and FIREFOX is None and not os.environ.get("CI"):
        pytest.skip("neither chromium nor firefox-esr is installed")  # under CI: each test fails
    tmp = tmp_path_factory.mktemp("scale")
    daemon = Daemon(tmp / "state", token=TOKEN, sandbox_backend="local", log_level="warning",
                    backends=[{"kind": "scripted", "replies": CALC_REPLIES}],
                    n_init=64, n_run=64, n_eval=64, queue_size=20_000,
                    max_results=50_000, result_ttl_s=86_400)
    daemon.start_sync()
    try:
        with httpx.Client(base_url=daemon.url, headers=daemon.headers, timeout=60) as h:
            t0 = time.monotonic()
            calc = _submit(h, {"kind": "calc", "expression": "4821 * 392", "examples": 0}, 2,
                           labels=["scale"])
            for g in range(GROUPS):
                task: dict[str, Any] = {"kind": "sleep", "rewards": [0.0, 0.25, 0.5, 1.0, 1.0, 0.0, 0.75, 1.0]}
                if g % 50 == 49:
                    task["fail_stage"] = "eval"
                r = h.post("/v1/rollouts", json={"task": task, "n": GROUP_SIZE, "group_id": f"scale-{g:04d}",
                                                 "labels": ["scale", f"batch-{g % 10}"]})
                assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while True:
                counts = h.get("/v1/status").json()["rollouts"]
                done = sum(counts.get(s, 0) for s in ("completed", "failed"))
                if done >= FINISHED:
                    break
                assert time.monotonic() < deadline, counts
                time.sleep(0.5)
            listing = h.get("/v1/rollouts", params={"limit": 1}).json()
            assert listing["total"] == FINISHED, listing
            print(f"filled the store with {FINISHED} finished rollouts in {time.monotonic() - t0:.1f} s")
            yield {"daemon": daemon, "calc": calc, "counts": counts}
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop_sync()


def timed_load(browser: Page, url: str, ready: str) -> float:
    """Milliseconds from navigating to ``url`` (a fresh document) until ``ready`` holds."""
    browser.goto("about:blank")
    browser.wait_for("location.href === 'about:blank'")
    browser.goto(url)
    ms = browser.wait_for(f"location.href === {json.dumps(url)} && ({ready}) ? performance.now() : 0",
                          timeout_s=30, poll_s=0.02)
    return float(ms)


@pytest.mark.parametrize("which", ["chromium", "firefox"])
def test_pages_with_10000_rollouts(store: dict[str, Any], which: str, request: pytest.FixtureRequest,
                                   tmp_path: Path) -> None:
    binary = request.getfixturevalue(which)
    shots = tmp_path / f"screenshots-{which}-10000"
    shots.mkdir()
    daemon: Daemon = store["daemon"]
    ui = f"{daemon.url}/ui/"
    traj = store["calc"]["rollouts"][0]
    browser: Browser | Firefox = (Browser(binary, tmp_path / "profile") if which == "chromium"
                                  else Firefox(binary, tmp_path / "profile-firefox", window=WINDOW))
    try:
        browser.goto(ui)
        browser.wait_for("!document.getElementById('login').hidden")
        browser.js(f"sessionStorage.setItem('rolloutd.token', {json.dumps(TOKEN)}); true")
        rows = "document.querySelectorAll('#rollout-table tbody tr').length"
        info = "(document.getElementById('page-info') || {innerText: ''}).innerText"
        pages = {
            "overview": (f"{ui}#/", "(document.getElementById('count-completed') || {innerText: ''})"
                                    ".innerText.length > 0"),
            "rollouts-first": (f"{ui}#/rollouts", f"{rows} === 50"),
            "rollouts-later": (f"{ui}#/rollouts?limit=500&offset=9500", f"{rows} === 500"),
            "rollouts-filtered": (f"{ui}#/rollouts?status=failed&offset=100", f"{rows} === 50"),
            "trajectory": (f"{ui}#/rollout/{traj['id']}", "document.querySelectorAll('#turns .turn').length === 2"),
            "group": (f"{ui}#/group/scale-0617", "document.querySelectorAll('#group-table tbody tr').length === 8"),
        }
        times: dict[str, float] = {}
        for name, (url, ready) in pages.items():
            times[name] = timed_load(browser, url, ready)
            print(f"LOAD {which} {name} {times[name]:.0f} ms")
            browser.screenshot(shots / f"{name}.png")
            if name == "overview":
                completed = store["counts"]["completed"]
                assert browser.js("document.querySelector('#count-completed .v').innerText") == str(completed)
            elif name == "rollouts-first":
                assert browser.js(info) == f"1–50 of {FINISHED}"
            elif name == "rollouts-later":
                assert browser.js(info) == f"9501–10000 of {FINISHED}"
                assert browser.js("!!document.querySelector('.pager a[href*=\"offset=10000\"]')")
            elif name == "rollouts-filtered":
                assert browser.js(info) == f"101–150 of {GROUPS // 50 * GROUP_SIZE}"
            elif name == "group":
                assert browser.js("document.querySelectorAll('#group-grid .group-col').length") == 8
        slow = {k: v for k, v in times.items() if v > BUDGET_MS}
        assert not slow, f"pages over {BUDGET_MS:.0f} ms in {which}: {slow}"
    finally:
        browser.close()
