"""The dashboard (``/ui/``) in a real headless Chromium against a real ``rolloutd serve`` with
a bearer token and real rollouts.

The policy is the scripted backend, a labelled TEST DOUBLE (``calc`` rollouts: a calculator
tool call, then the answer); ``sleep`` rollouts (a test task) give a group with scripted
rewards and a failure. Chromium is driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no port, no extra package), so the test signs in through the
login form as a user would; ``--dump-dom`` and ``--screenshot`` show the page before signing
in. Screenshots are saved under the test's tmp_path (named in the output) as artefacts.

Needs the ``chromium`` Debian package (CI installs it in .ci/run): skipped without it,
except under CI, where a missing browser fails the test.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

from tests.daemon._bidi import FIREFOX, Firefox, Waits
from tests.hostile._daemon import Daemon, tool_call

TOKEN = "ui-test-token-0123"
CALC_REPLIES = [tool_call("calculator", expression="4821 * 392"), "The answer is 1889832"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--disable-sync", "--metrics-recording-only", "--mute-audio", "--hide-scrollbars"]
WINDOW = (1400, 1000)
#: Exec argv[3:] with fd argv[1] as its fd 3 and fd argv[2] as its fd 4 (DevTools' pipe).
ONTO_3_AND_4 = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); "
                "os.dup2(w, 4); os.close(r); os.close(w); os.execvp(sys.argv[3], sys.argv[3:])")

pytestmark = pytest.mark.slow


def installed(path: str | None, package: str) -> str:
    """The browser's path; without it the test fails under CI (.ci/run installs the Debian
    package) and skips elsewhere, saying why."""
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{package} is not installed (.ci/run installs the Debian package)")
        pytest.skip(f"{package} is not installed (apt-get install {package})")
    return path


@pytest.fixture
def chromium() -> str:
    return installed(CHROMIUM, "chromium")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a browser started in its own session, with every process of its group."""
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_chromium(chromium: str, profile: Path, *args: str, timeout_s: float = 90) -> str:
    """One headless run (``--dump-dom``, ``--screenshot``); its stdout."""
    proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _stop(proc)
        shutil.rmtree(profile, ignore_errors=True)
    return out.decode(errors="replace")


class Browser(Waits):
    """Headless Chromium driven over the DevTools protocol on a pipe (fd 3: commands in,
    fd 4: answers out, each message JSON ended by a NUL byte), one page attached."""

    def __init__(self, chromium: str, profile: Path) -> None:
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        # Above 4, so moving them to 3 and 4 cannot clobber one with the other.
        child_r = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
        for fd in (cmd_r, out_w):
            os.close(fd)
        argv = [sys.executable, "-c", ONTO_3_AND_4, str(child_r), str(child_w),
                chromium, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"]
        self.proc = subprocess.Popen(argv, pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(child_r)
        os.close(child_w)
        self._w = cmd_w
        self._r = out_r
        self._buf = b""
        self._next = 0
        self.profile = profile
        self.session: str | None = None
        try:
            # The first answer waits for the browser to start (slow on a busy CI machine).
            target = self.call("Target.createTarget", {"url": "about:blank"}, browser=True,
                               timeout_s=90)["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                     browser=True)["sessionId"]
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False})
        except BaseException:
            self.close()
            raise

    def call(self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False,
             timeout_s: float = 30) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if not browser and self.session is not None:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    result: dict[str, Any] = answer.get("result", {})
                    return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method}")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buf += chunk

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(data["data"]))
        print(f"screenshot: {path}")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                os.write(self._w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        except OSError:
            pass
        _stop(self.proc)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


def _submit(h: httpx.Client, task: dict[str, Any], n: int, **extra: Any) -> dict[str, Any]:
    r = h.post("/v1/rollouts", json={"task": task, "n": n, "wait": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def firefox() -> str:
    return installed(FIREFOX, "firefox-esr")


class Page(Protocol):
    """What the page checks drive: Browser (Chromium) or tests.daemon._bidi.Firefox."""

    def goto(self, url: str) -> None: ...
    def js(self, expression: str) -> Any: ...
    def wait_for(self, expression: str, timeout_s: float = 20, poll_s: float = 0.1) -> Any: ...
    def screenshot(self, path: Path) -> None: ...


@contextmanager
def daemon_with_rollouts(tmp_path: Path) -> Iterator[tuple[Daemon, httpx.Client, dict[str, Any]]]:
    """A daemon holding 7 rollouts: 2 calc (labelled ui-test), a group of 4 sleep samples
    with rewards 0, 1, 0.5, 1 (``ui-group``) and a sleep rollout failed in eval."""
    daemon = Daemon(tmp_path / "state", token=TOKEN, sandbox_backend="local", log_level="warning",
                    backends=[{"kind": "scripted", "replies": CALC_REPLIES}])
    daemon.start_sync()
    try:
        with httpx.Client(base_url=daemon.url, headers=daemon.headers) as h:
            calc = _submit(h, {"kind": "calc", "expression": "4821 * 392", "examples": 0}, 2,
                           labels=["ui-test"])
            group = _submit(h, {"kind": "sleep", "rewards": [0.0, 1.0, 0.5, 1.0]}, 4, group_id="ui-group")
            _submit(h, {"kind": "sleep", "fail_stage": "eval"}, 1)
            traj = calc["rollouts"][0]
            assert traj["status"] == "completed" and len(traj["turns"]) == 2, traj
            yield daemon, h, {"calc": calc, "group": group}
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop_sync()


def check_pages(browser: Page, h: httpx.Client, ui: str, made: dict[str, Any], shots: Path) -> None:
    """Every page of the dashboard, signed in through its login form, in ``browser``."""
    calc, group = made["calc"], made["group"]
    traj = calc["rollouts"][0]
    browser.goto(ui)
    browser.wait_for("!document.getElementById('login').hidden")
    browser.js(f"document.getElementById('token').value = {json.dumps(TOKEN)};"
               "document.getElementById('login-form').requestSubmit(); true")

    # Overview: the status counts, then a live update as more rollouts finish.
    count = "(document.getElementById('count-{}') || {{}}).innerText || ''"
    browser.wait_for(f"({count.format('completed')}).startsWith('6')")
    assert browser.js(count.format("failed")).startswith("1")
    assert browser.js(count.format("submitted")).startswith("7")
    assert browser.js("document.getElementById('stages').innerText").count("\n") >= 3
    assert "healthy" in browser.js("document.getElementById('backends').innerText")
    assert TOKEN not in browser.js("location.href")
    assert browser.js("sessionStorage.getItem('rolloutd.token')") == TOKEN
    browser.screenshot(shots / "overview.png")
    _submit(h, {"kind": "sleep"}, 3)
    browser.wait_for(f"({count.format('completed')}).startsWith('9')", timeout_s=15)
    browser.wait_for("document.querySelectorAll('#throughput polyline').length === 1",
                     timeout_s=15)
    # The last hour, from the daemon's per-minute buckets: throughput and mean reward.
    browser.wait_for("document.getElementById('history').innerText.includes('10 in the last 60 min')",
                     timeout_s=15)
    assert browser.js("document.querySelectorAll('#reward-series polyline, #reward-series circle')"
                      ".length") >= 1
    status = h.get("/v1/status").json()
    rewarded = [b for b in status["history"]["buckets"] if b["rewarded"]]
    mean = (sum(b["mean_reward"] * b["rewarded"] for b in rewarded)
            / sum(b["rewarded"] for b in rewarded))
    assert f"{mean:.3f} over the {sum(b['rewarded'] for b in rewarded)} rewarded" in browser.js(
        "document.getElementById('history').innerText")
    # Tool latency: one row per tool (the calc rollouts' calculator calls).
    rows = browser.js("[...document.querySelectorAll('#tools tbody tr')]"
                      ".map(tr => [...tr.cells].map(td => td.innerText))")
    assert len(rows) == 1 and rows[0][:3] == ["calculator", "2", "0"], rows
    assert rows[0][3].endswith(("ms", " s")) and rows[0][5] == "2 calls", rows
    # The image cache's figures (this daemon ran no image task: an empty store).
    assert browser.js("document.querySelector('#images-count .v').innerText") == "0"
    assert browser.js("document.querySelector('#images-bytes .v').innerText") == "0 B"
    assert browser.js("document.querySelector('#images-hit-rate .v').innerText") == "—"
    browser.screenshot(shots / "overview-updated.png")

    # Rollout browser: filters and pagination.
    browser.goto(f"{ui}#/rollouts?kind=calc")
    browser.wait_for("document.querySelectorAll('#rollout-table tbody tr').length === 2")
    listed = browser.js("[...document.querySelectorAll('#rollout-table tbody tr td:first-child')]"
                        ".map(td => td.innerText)")
    assert sorted(listed) == sorted(t["id"] for t in calc["rollouts"])
    browser.screenshot(shots / "rollouts.png")
    browser.goto(f"{ui}#/rollouts?limit=25&status=completed")
    browser.wait_for("document.getElementById('page-info') && "
                     "document.getElementById('page-info').innerText.includes('of 9')")

    # Trajectory: its turns, the tool call, the sampled tokens coloured by logprob.
    browser.goto(f"{ui}#/rollout/{traj['id']}")
    browser.wait_for("document.querySelectorAll('#turns .turn').length === 2")
    sampled = sum(traj["loss_mask"])
    assert browser.js("document.querySelectorAll('#turns .tok.m1').length") == sampled
    coloured = browser.js("[...document.querySelectorAll('#turns .tok.m1')]"
                          ".filter(t => t.style.backgroundColor).length")
    assert coloured == sampled
    first = traj["loss_mask"].index(1)
    title = browser.js(f"document.querySelector('#all-tokens .tok[data-i=\"{first}\"]').title")
    pieces = h.get(f"/v1/rollouts/{traj['id']}/tokens").json()["pieces"]
    assert title == (f"id {traj['token_ids'][first]} · logprob {traj['logprobs'][first]:.4f} · mask 1"
                     f" · text {json.dumps(pieces[first])}")
    # each token shows its decoded text (newlines as ↵): the turn reads as the model wrote it
    shown = browser.js("[...document.querySelectorAll('#all-tokens .tok')].map(t => t.textContent)"
                       ".join('')")
    assert shown.replace("↵", "") == "".join(pieces)
    turn0 = browser.js("document.querySelector('#turns .turn .tokens').innerText")
    assert '<tool_call>{"name": "calculator"' in turn0
    assert browser.js("document.querySelectorAll('#all-tokens .tok.m0').length") == (
        len(traj["token_ids"]) - sampled)
    text = browser.js("document.getElementById('main').innerText")
    assert "calculator" in text and "1889832" in text and "4821 * 392" in text
    assert browser.js("document.querySelectorAll('#messages .msg').length") == len(traj["messages"])
    assert browser.js("document.querySelectorAll('#timing .bar').length") == 2
    # the waterfall at real start times: queue, init, run, turn 0's LLM call and calculator
    # call, turn 1's LLM call, eval; each span where it started (seconds since submit)
    kinds = browser.js("[...document.querySelectorAll('#waterfall .wf-row')].map(r => r.dataset.kind)")
    assert kinds == ["queue", "init", "run", "llm", "tool", "llm", "eval"]
    starts = browser.js("[...document.querySelectorAll('#waterfall .wf-row')]"
                        ".map(r => Number(r.dataset.start))")
    assert starts[0] == 0 and all(x > 0 for x in starts[1:]) and starts == sorted(starts)
    assert starts[4] == pytest.approx(traj["turns"][0]["tool_calls"][0]["start_s"], abs=1e-5)
    assert browser.js("document.getElementById('reward').innerText") == "1"
    browser.screenshot(shots / "trajectory.png")

    # Replay: the recorded turns fed back against a fresh sandbox; a link to the new rollout.
    browser.js("document.getElementById('replay').click(); true")
    browser.wait_for("!!document.getElementById('replay-link')")
    replay_id = browser.js("document.getElementById('replay-link').innerText")
    assert replay_id != traj["id"]
    browser.js("document.getElementById('replay-link').click(); true")
    browser.wait_for(f"(document.getElementById('traj-id') || {{}}).innerText === {json.dumps(replay_id)}")
    for _ in range(100):  # until the replay has finished
        if h.get(f"/v1/rollouts/{replay_id}").json()["status"] == "completed":
            break
        time.sleep(0.1)
    browser.goto(f"{ui}#/")
    browser.goto(f"{ui}#/rollout/{replay_id}")
    browser.wait_for("(document.getElementById('replay-info') || {}).innerText?.includes('equal: yes')")
    assert traj["id"] in browser.js("document.getElementById('replay-info').innerText")
    browser.screenshot(shots / "replay.png")

    # Group: every sample side by side, with GRPO advantages.
    browser.goto(f"{ui}#/group/{group['group_id']}")
    browser.wait_for("document.querySelectorAll('#group-table tbody tr').length === 4")
    advantages = browser.js("[...document.querySelectorAll('[data-advantage]')]"
                            ".map(td => Number(td.dataset.advantage))")
    rewards = [0.0, 1.0, 0.5, 1.0]
    mean = sum(rewards) / 4
    std = (sum((r - mean) ** 2 for r in rewards) / 3) ** 0.5
    assert advantages == pytest.approx([(r - mean) / (std + 1e-4) for r in rewards])
    assert browser.js("document.querySelectorAll('#group-grid .group-col').length") == 4
    # where samples diverge (these sleep samples share their messages)
    assert "identical" in browser.js("document.getElementById('main').innerText")
    assert browser.js("firstDifference([{a: 1}, {b: 2}], [{a: 1}, {b: 3}])") == 1
    assert browser.js("firstDifference([{a: 1}], [{a: 1}, {b: 3}])") == 1
    assert browser.js("firstDifference([{a: 1}], [{a: 1}])") is None
    browser.screenshot(shots / "group.png")

    # A failed rollout shows its error's stage and type.
    failed = h.get("/v1/rollouts", params={"status": "failed"}).json()["rollouts"][0]
    browser.goto(f"{ui}#/rollout/{failed['id']}")
    browser.wait_for("!!document.getElementById('traj-error')")
    assert browser.js("document.getElementById('traj-error').innerText").startswith("error in eval")

    # A batch's rollouts carry its id: the browser filters by it.
    r = h.post("/v1/batches", json={"prompts": [{"kind": "sleep", "rewards": [0.0, 1.0]}],
                                    "group_size": 2, "keep": 1})
    assert r.status_code == 202, r.text
    batch_id = r.json()["id"]
    deadline = time.monotonic() + 30
    while h.get(f"/v1/batches/{batch_id}").json()["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    browser.goto(f"{ui}#/rollouts?batch_id={batch_id}")
    browser.wait_for("document.querySelectorAll('#rollout-table tbody tr').length === 2")
    assert browser.js("document.querySelector('#filters [name=batch_id]').value") == batch_id
    first = browser.js("document.querySelector('#rollout-table tbody tr td a').innerText")
    browser.goto(f"{ui}#/rollout/{first}")
    browser.wait_for(f"(document.getElementById('traj-batch') || {{}}).innerText === {json.dumps(batch_id)}")

    # A refused token brings the login form back.
    browser.js("sessionStorage.setItem('rolloutd.token', 'wrong'); true")
    browser.goto(f"{ui}#/")
    browser.wait_for("!document.getElementById('login').hidden && "
                     "document.getElementById('login-error').innerText.includes('refused')")


def test_dashboard_in_chromium(tmp_path: Path, chromium: str) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with daemon_with_rollouts(tmp_path) as (daemon, h, made):
        ui = f"{daemon.url}/ui/"
        # Before signing in, the page shows only the login form (the data calls get 401).
        dom = run_chromium(chromium, tmp_path / "profile-dump", "--virtual-time-budget=5000",
                           "--dump-dom", ui)
        assert '<section id="login">' in dom, dom[-3000:]
        assert TOKEN not in dom
        run_chromium(chromium, tmp_path / "profile-shot", "--virtual-time-budget=5000",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}",
                     f"--screenshot={shots / 'login.png'}", ui)
        assert (shots / "login.png").stat().st_size > 1000
        browser = Browser(chromium, tmp_path / "profile")
        try:
            check_pages(browser, h, ui, made, shots)
        finally:
            browser.close()


def test_dashboard_in_firefox(tmp_path: Path, firefox: str) -> None:
    """The same pages in Firefox ESR, driven over WebDriver BiDi (tests/daemon/_bidi.py)."""
    shots = tmp_path / "screenshots-firefox"
    shots.mkdir()
    with daemon_with_rollouts(tmp_path) as (daemon, h, made):
        ui = f"{daemon.url}/ui/"
        browser = Firefox(firefox, tmp_path / "profile-firefox", window=WINDOW)
        try:
            browser.goto(ui)
            browser.wait_for("!document.getElementById('login').hidden")
            assert TOKEN not in browser.js("document.documentElement.outerHTML")
            browser.screenshot(shots / "login.png")
            check_pages(browser, h, ui, made, shots)
        finally:
            browser.close()


HARNESS_SCRIPT = """
import openai
client = openai.OpenAI()
client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think."}])
msgs = [{"role": "user", "content": "What is 1+1?"}]
r = client.chat.completions.create(model="m", messages=msgs)
msgs += [{"role": "assistant", "content": r.choices[0].message.content},
         {"role": "user", "content": "Sure?"}]
client.chat.completions.create(model="m", messages=msgs)
print("HARNESS DONE")
"""


def test_harness_rollout_in_chromium(tmp_path: Path, chromium: str) -> None:
    """A harness-driven rollout (docs/agents.md) with two segments: the page shows the
    harness panel, and each turn's tokens from its own segment."""
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="rh-"))  # short: sandbox socket paths fit in 107 bytes
    daemon = Daemon(state / "state", token=TOKEN, sandbox_backend="local", log_level="warning",
                    backends=[{"kind": "scripted", "replies": ["Hmm.", "Maybe 2.", "The answer is 2."]}])
    daemon.start_sync()
    browser = None
    try:
        with httpx.Client(base_url=daemon.url, headers=daemon.headers) as h:
            task = {"kind": "math", "question": "What is 1+1?", "answer": "2",
                    "agent": {"command": [sys.executable, "-c", HARNESS_SCRIPT]}}
            traj = _submit(h, task, 1)["rollouts"][0]
            assert traj["status"] == "completed", traj
            assert len(traj["segments"]) == 2 and [t["segment"] for t in traj["turns"]] == [0, 1, 1]
            browser = Browser(chromium, tmp_path / "profile")
            ui = f"{daemon.url}/ui/"
            browser.goto(ui)
            browser.wait_for("!document.getElementById('login').hidden")
            browser.js(f"document.getElementById('token').value = {json.dumps(TOKEN)};"
                       "document.getElementById('login-form').requestSubmit(); true")
            browser.wait_for("!!document.getElementById('count-completed')")
            browser.goto(f"{ui}#/rollout/{traj['id']}")
            browser.wait_for("!!document.getElementById('harness')")
            panel = browser.js("document.getElementById('harness').innerText")
            assert "calls 3 · merged 1" in panel and "segments 2" in panel, panel
            assert "exit 0" in panel
            sampled = sum(sum(s["loss_mask"]) for s in traj["segments"])
            assert browser.js("document.querySelectorAll('#turns .tok.m1').length") == sampled
            assert "segment 1 (merged)" in browser.js("document.getElementById('turns').innerText")
            browser.screenshot(tmp_path / "harness.png")
    finally:
        if browser is not None:
            browser.close()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop_sync()
        shutil.rmtree(state, ignore_errors=True)
