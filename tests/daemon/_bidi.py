"""Headless Firefox driven over WebDriver BiDi (its websocket at ``/session``), for the
dashboard's browser tests.

The websocket is wsproto (already installed: hypercorn needs it) over a plain blocking
socket; the client offers what the Chromium driver of test_dashboard_browser.py offers:
``goto``, ``js``, ``wait_for``, ``screenshot``, ``close``. Firefox runs in its own session
(process group) with a throwaway profile; ``close`` ends the BiDi session, then the whole
group, and removes the profile.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

from tests.hostile._daemon import free_port

FIREFOX = shutil.which("firefox-esr") or shutil.which("firefox")
#: Preferences of the throwaway profile: no first-run pages, updates, telemetry or network
#: calls of its own.
PREFS = {
    "browser.shell.checkDefaultBrowser": False,
    "browser.startup.homepage_override.mstone": "ignore",
    "browser.startup.page": 0,
    "browser.aboutwelcome.enabled": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "datareporting.healthreport.uploadEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.auto": False,
    "app.update.enabled": False,
    "app.normandy.enabled": False,
    "extensions.update.enabled": False,
    "browser.safebrowsing.malware.enabled": False,
    "browser.safebrowsing.phishing.enabled": False,
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
    "browser.newtabpage.enabled": False,
    "remote.prefs.recommended": True,
}


class Waits:
    """``wait_for`` over a driver's ``js`` (Chromium's and Firefox's drivers share it)."""

    def js(self, expression: str) -> Any:
        raise NotImplementedError

    def wait_for(self, expression: str, timeout_s: float = 20, poll_s: float = 0.1) -> Any:
        """The value of ``expression`` once it is truthy (an exception counts as false: the
        page may still be loading)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.js(f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()")
            except RuntimeError:
                value = None  # a navigation replaced the context under the evaluation
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.js("document.body ? document.body.innerText.slice(0, 2000) : ''")
                raise AssertionError(f"timed out waiting for {expression!r}; the page says:\n{text}")
            time.sleep(poll_s)


class Firefox(Waits):
    """Headless Firefox with one browsing context, driven over WebDriver BiDi."""

    def __init__(self, firefox: str, profile: Path, *, window: tuple[int, int] = (1400, 1000)) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "user.js").write_text(
            "".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n" for k, v in PREFS.items()))
        self.profile = profile
        self.port = free_port()
        env = {**os.environ, "MOZ_HEADLESS": "1", "MOZ_CRASHREPORTER_DISABLE": "1"}
        self.proc = subprocess.Popen(
            [firefox, "--headless", "--no-remote", "--remote-debugging-port", str(self.port),
             "--profile", str(profile), f"--width={window[0]}", f"--height={window[1]}", "about:blank"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.sock: socket.socket | None = None
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._next = 0
        self._text = ""
        self._inbox: list[dict[str, Any]] = []
        self.context = ""
        try:
            self._connect(timeout_s=90)  # the first start of a profile is slow on a busy machine
            self.call("session.new", {"capabilities": {}})
            tree = self.call("browsingContext.getTree", {})
            self.context = tree["contexts"][0]["context"]
            self.call("browsingContext.setViewport",
                      {"context": self.context, "viewport": {"width": window[0], "height": window[1]}})
        except BaseException:
            self.close()
            raise

    # ---- the websocket --------------------------------------------------------------------

    def _connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"firefox exited with {self.proc.returncode}")
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("firefox did not open its remote port") from None
                time.sleep(0.2)
        self._send(Request(host=f"127.0.0.1:{self.port}", target="/session"))
        while True:
            for event in self._events(deadline):
                if isinstance(event, AcceptConnection):
                    return
                if isinstance(event, RejectConnection):
                    raise RuntimeError(f"firefox refused the BiDi websocket ({event.status_code})")

    def _send(self, event: Any) -> None:
        assert self.sock is not None
        self.sock.sendall(self.ws.send(event))

    def _events(self, deadline: float) -> list[Any]:
        """The events of the next chunk read from the socket (waits up to ``deadline``)."""
        assert self.sock is not None
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.sock], [], [], left)[0]:
            raise TimeoutError("firefox did not answer in time")
        data = self.sock.recv(1 << 20)
        if not data:
            raise RuntimeError("firefox closed its BiDi websocket")
        self.ws.receive_data(data)
        events = list(self.ws.events())
        for event in events:
            if isinstance(event, Ping):
                self._send(event.response())
        return events

    def call(self, method: str, params: dict[str, Any], *, timeout_s: float = 30) -> dict[str, Any]:
        self._next += 1
        self._send(TextMessage(json.dumps({"id": self._next, "method": method, "params": params})))
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self._events(deadline):
                if isinstance(event, TextMessage):
                    self._text += event.data
                    if not event.message_finished:
                        continue
                    msg = json.loads(self._text)
                    self._text = ""
                    if msg.get("id") != self._next:
                        continue  # an event (none subscribed) or an older answer
                    if msg.get("type") == "error":
                        raise RuntimeError(f"{method}: {msg.get('error')}: {msg.get('message')}")
                    result: dict[str, Any] = msg.get("result", {})
                    return result
                if isinstance(event, BytesMessage | CloseConnection):
                    raise RuntimeError(f"unexpected websocket event {event!r}")

    # ---- what the tests use ---------------------------------------------------------------

    def goto(self, url: str) -> None:
        self.call("browsingContext.navigate", {"context": self.context, "url": url, "wait": "none"})

    def js(self, expression: str) -> Any:
        result = self.call("script.evaluate", {
            "expression": expression, "target": {"context": self.context}, "awaitPromise": True,
            "resultOwnership": "none", "serializationOptions": {"maxObjectDepth": 4}})
        if result.get("type") == "exception":
            details = result.get("exceptionDetails", {})
            raise RuntimeError(f"{expression}: {details.get('text')}")
        return _value(result["result"])

    def screenshot(self, path: Path) -> None:
        data = self.call("browsingContext.captureScreenshot",
                         {"context": self.context, "origin": "document"})["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"screenshot: {path}")

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.call("browser.close", {}, timeout_s=10)
            except (OSError, RuntimeError, TimeoutError):
                pass
            self.sock.close()
            self.sock = None
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def _value(remote: dict[str, Any]) -> Any:
    """A BiDi RemoteValue as Python."""
    kind = remote.get("type")
    if kind in ("undefined", "null"):
        return None
    if kind in ("string", "boolean"):
        return remote["value"]
    if kind == "number":
        v = remote["value"]
        if isinstance(v, str):  # NaN, -0, Infinity, -Infinity
            return {"NaN": float("nan"), "-0": -0.0, "Infinity": float("inf"),
                    "-Infinity": float("-inf")}[v]
        return v
    if kind in ("array", "set"):
        return [_value(x) for x in remote.get("value", [])]
    if kind in ("object", "map"):
        return {(k if isinstance(k, str) else _value(k)): _value(v) for k, v in remote.get("value", [])}
    return remote.get("value", f"<{kind}>")
