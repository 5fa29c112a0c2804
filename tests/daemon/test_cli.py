"""The rolloutd command line against a real daemon: submit with progress, status, errors."""

from __future__ import annotations

import json

import pytest
import trio

from rolloutd.daemon.cli import CliError, main, read_tasks
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings


def test_read_tasks_names_the_bad_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"kind": "sleep"}\n\n{"kind": "sleep"\n')
    with pytest.raises(CliError, match=r"t\.jsonl:3: not valid JSON"):
        read_tasks(f)
    f.write_text('{"kind": "sleep"}\n["not", "an", "object"]\n')
    with pytest.raises(CliError, match=r"t\.jsonl:2: a task must be a JSON object"):
        read_tasks(f)
    f.write_text("\n")
    with pytest.raises(CliError, match="no tasks"):
        read_tasks(f)
    with pytest.raises(CliError, match="cannot read"):
        read_tasks(tmp_path / "missing.jsonl")


def test_cli_errors_exit_2_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["submit", str(bad), "--url", "http://127.0.0.1:9"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    cfg = tmp_path / "c.toml"
    cfg.write_text("nonsense_key = 1\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "nonsense_key" in capsys.readouterr().err


async def test_submit_and_status_against_a_daemon(tmp_path, nursery, capsys):
    node = Node(make_settings(tmp_path), services=Services())
    await nursery.start(node.run)
    url = node.urls[0]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"kind": "sleep", "run_s": 0.01}\n{"kind": "sleep", "reward": 0.5}\n')
    out = tmp_path / "out.jsonl"
    rc = await trio.to_thread.run_sync(main, ["submit", str(tasks), "--n", "3", "--out", str(out), "--url", url])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {r["status"] for r in rows} == {"completed"}
    assert sorted(r["reward"] for r in rows) == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    err = capsys.readouterr().err
    assert "6 rollouts" in err and "completed 6" in err

    rc = await trio.to_thread.run_sync(main, ["status", "--url", url])
    text = capsys.readouterr().out
    assert rc == 0 and "stages" in text and "run" in text and "completed 6" in text
    rc = await trio.to_thread.run_sync(main, ["status", "--url", url, "--json"])
    assert json.loads(capsys.readouterr().out)["rollouts"]["completed"] == 6
    rc = await trio.to_thread.run_sync(main, ["status", "--url", url, "--federation"])
    assert "not enabled" in capsys.readouterr().out
    node.request_stop()


async def test_unreachable_daemon_exits_1(capsys):
    rc = await trio.to_thread.run_sync(main, ["status", "--url", "http://127.0.0.1:9"])
    assert rc == 1 and "unreachable" in capsys.readouterr().err


def test_read_tasks_checks_each_task_with_its_handler(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"kind": "sleep"}\n{"kind": "sleep", "run_s": -1}\n')
    with pytest.raises(CliError, match=r"t\.jsonl:2: sleep task: 'run_s'"):
        read_tasks(f)
    f.write_text('{"kind": "nope"}\n')
    with pytest.raises(CliError, match=r"t\.jsonl:1: unknown task kind 'nope'"):
        read_tasks(f)


def test_serve_started_with_signals_blocked_still_drains_on_sigterm(tmp_path):
    """A daemon started from a process that blocked SIGTERM and SIGINT (and ignored SIGINT, as
    a non-interactive shell does for `cmd &`) used to keep the mask: SIGTERM stayed pending and
    the daemon never drained (issue 15, point 4)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.hostile._daemon import REPO, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
    env.update(ROLLOUTD_STATE_DIR=str(tmp_path / "state"), ROLLOUTD_CACHE_DIR=str(tmp_path / "c"),
               ROLLOUTD_SANDBOX_BACKEND="local")
    blocker = ("import os, signal, sys; "
               "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}); "
               "signal.signal(signal.SIGINT, signal.SIG_IGN); "
               f"os.execv(sys.executable, [sys.executable, '-m', 'rolloutd.daemon.cli', 'serve', "
               f"'--port', '{port}'])")
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", blocker], env=env, cwd=REPO, stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2) as http:
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "not ready"
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        with open(f"/proc/{proc.pid}/status") as f:
            status = f.read()
        assert "SigBlk:\t0000000000000000" in status, status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_images_commands_against_a_daemon(tmp_path, nursery, capsys, test_images):
    node = Node(make_settings(tmp_path, image_cache_dir=tmp_path / "store"), services=Services())
    await nursery.start(node.run)
    url = node.urls[0]

    async def cli(*argv: str) -> tuple[int, str, str]:
        rc = await trio.to_thread.run_sync(main, ["images", *argv, "--url", url])
        got = capsys.readouterr()
        return rc, got.out, got.err

    rc, _, err = await cli("import", test_images.oci_ref(test_images.debian_oci), "--name",
                           "local/deb")
    assert rc == 0 and "sha256:" in err and "local/deb" in err, err
    rc, out, _ = await cli("ls", "--json")
    listed = json.loads(out)
    assert rc == 0 and [i["names"] for i in listed] == [["local/deb"]]
    rc, out, _ = await cli("ls")
    assert rc == 0 and "deb" in out
    rc, _, err = await cli("import", "oci:/nonexistent:x")
    assert rc == 1 and "not_found" in err and "does not exist" in err
    rc, _, err = await cli("pull", "localhost:1/nothing:here")  # no registry: a clear error
    assert rc == 1 and "invalid_image" in err, err
    rc, out, _ = await cli("rm", "local/deb")  # a name with '/': the CLI finds its digest
    assert rc == 0 and listed[0]["digest"] in out
    rc, _, err = await cli("rm", "local/deb")
    assert rc == 1 and "not_found" in err
    rc, _, _ = await cli("import", test_images.oci_ref(test_images.busybox_oci))
    rc, out, _ = await cli("gc", "--max-gb", "0")
    assert rc == 0 and "removed 1 image(s)" in out
    node.request_stop()
