"""The ipython tool: a real ipykernel inside a real sandbox over the ipc transport."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from rolloutd.sandbox import Sandbox
from rolloutd.tools import Toolbox


async def py(tb: Toolbox, code: str, timeout_s: float = 20.0):
    return await tb.call("ipython", {"code": code}, timeout_s=timeout_s)


async def test_state_results_display_and_errors(toolbox: Toolbox, sandbox: Sandbox) -> None:
    r = await py(toolbox, "x = 41")
    assert r.ok and r.output == "[Code executed successfully with no output]"
    r = await py(toolbox, "print('hello'); x + 1")
    assert r.ok and r.output == "hello\nOut[2]: 42\n"
    r = await py(toolbox, "from IPython.display import display, HTML\n"
                          "display(HTML('<b>x</b>')); display({'a': 1})")
    assert r.ok and "<IPython.core.display.HTML object>" in r.output and "{'a': 1}" in r.output
    r = await py(toolbox, "import os; os.getcwd()")
    assert sandbox.workdir in r.output
    r = await py(toolbox, "print('before'); 1/0")
    assert not r.ok
    assert r.output.startswith("before\n")
    assert "ZeroDivisionError" in r.output and "\x1b" not in r.output
    # output written to fd 1 by a subprocess reaches the model too
    r = await py(toolbox, "import subprocess; subprocess.run(['echo', 'from-sub']); None")
    assert "from-sub" in r.output


async def test_ipc_transport_in_the_control_dir(bwrap_toolbox: Toolbox,
                                                bwrap_sandbox: Sandbox) -> None:
    await py(bwrap_toolbox, "1")
    conns = list(bwrap_sandbox.control_dir.glob("k*.json"))
    assert len(conns) == 1
    conn = json.loads(conns[0].read_text())
    assert conn["transport"] == "ipc"
    assert conn["ip"].startswith(str(bwrap_sandbox.control_dir))
    prefix = conn["ip"]
    for port in (conn["shell_port"], conn["iopub_port"], conn["control_port"]):
        assert (bwrap_sandbox.control_dir / f"{prefix.rsplit('/', 1)[1]}-{port}").is_socket()
    r = await py(bwrap_toolbox, "import psutil\n"
                 "sorted({c.laddr.ip for c in psutil.Process().net_connections('inet')})")
    if r.ok:  # the only inet socket is ipykernel's internal fork pipe, on loopback
        assert r.output.strip() in ("Out[2]: []", "Out[2]: ['127.0.0.1']")


async def test_interrupt_on_timeout_keeps_state(bwrap_toolbox: Toolbox) -> None:
    await py(bwrap_toolbox, "y = 'kept'")
    t0 = time.monotonic()
    r = await py(bwrap_toolbox, "import time\nprint('working')\ntime.sleep(100)", timeout_s=1.0)
    assert time.monotonic() - t0 < 3.5
    assert r.timed_out and not r.ok
    assert r.output.startswith("working\n") and "KeyboardInterrupt" in r.output
    assert "variables defined so far are kept" in r.output
    r = await py(bwrap_toolbox, "y")
    assert r.output == "Out[3]: 'kept'\n"


async def test_kernel_crash_and_restart(bwrap_toolbox: Toolbox) -> None:
    await py(bwrap_toolbox, "z = 5")
    r = await py(bwrap_toolbox, "import os; os._exit(3)")
    assert not r.ok and "The kernel died (exit status 3)" in r.output
    r = await py(bwrap_toolbox, "z")
    assert not r.ok and "NameError" in r.output
    r = await py(bwrap_toolbox, "z = 6; z")
    assert r.ok and r.output.endswith("6\n")


async def test_kernel_files_are_never_written_through_planted_links(
        bwrap_toolbox: Toolbox, bwrap_sandbox: Sandbox) -> None:
    """The control dir is writable from inside. The ipython tool used to name a restarted
    kernel's files after the first's (``k<tag><gen>.json``, ``..._init.py``) and write them
    through whatever was there: a symlink planted at the next generation's names led the
    daemon (root in production) into any host file. Names are now random per start and
    created with O_EXCL|O_NOFOLLOW (tools/_control.py)."""
    outside = Path(tempfile.mkdtemp(prefix="rlt-victim", dir="/tmp"))
    try:
        victim = outside / "victim"
        victim.write_text("intact\n")
        assert (await py(bwrap_toolbox, "1")).ok
        # every way to read "<stem><generation>" off the names there, next three generations
        plant = (
            "import glob, os\n"
            f"ctl = {str(bwrap_sandbox.control_dir)!r}\n"
            "for p in glob.glob(ctl + '/k*.json'):\n"
            "    name = os.path.basename(p)[:-5]\n"
            "    i = len(name)\n"
            "    while name[i - 1].isdigit():\n"
            "        i -= 1\n"
            "        for g in range(int(name[i:]) + 1, int(name[i:]) + 4):\n"
            "            for suffix in ('.json', '_init.py'):\n"
            "                link = f'{ctl}/{name[:i]}{g}{suffix}'\n"
            f"                os.path.lexists(link) or os.symlink({str(victim)!r}, link)\n"
            "os._exit(3)")
        r = await py(bwrap_toolbox, plant)
        assert "The kernel died" in r.output, r.output
        r = await py(bwrap_toolbox, "6 * 7")
        assert r.ok and r.output.endswith("42\n"), r.output
        assert victim.read_text() == "intact\n"
    finally:
        shutil.rmtree(outside, ignore_errors=True)
