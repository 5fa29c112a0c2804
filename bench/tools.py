"""Tool latency benchmark: bash / IPython / editor through the Toolbox in a bwrap sandbox,
against SWE-ReX's LocalRuntime bash session and a tmux send-keys session as anchors.

    .venv/bin/python bench/tools.py [--n-bash 1000] [--n-anchor 100] [--state-root /tmp]

Editor writes go through Sandbox.write_file (O_TRUNC); on ext4 a truncate-and-rewrite costs
~2-3 ms by itself (auto_da_alloc starts writeback at close), so str_replace depends on where
the workspace lives: --state-root /dev/shm puts it on tmpfs.

Prints a table, then ONE line:
RESULT bash_p50_ms=F bash_p99_ms=F swerex_p50_ms=F tmux_p50_ms=F speedup_vs_swerex=F
       ipython_p50_ms=F editor_p50_ms=F
(editor_p50_ms is the slower of the view and str_replace p50s.)

SWE-ReX is asyncio-only, so it runs in a child process (this file with --swerex-child).
The tmux anchor is the terminal-bench pattern: `send-keys '<cmd>; tmux wait -S done' Enter`,
`tmux wait done`, `capture-pane`; each step is a tmux client process. Both anchors run on
the host without a sandbox (which only flatters them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def row(name: str, xs: list[float]) -> None:
    ms = [x * 1000 for x in xs]
    print(f"{name:<34} {len(ms):>6} {pct(ms, 50):>10.3f} {pct(ms, 90):>10.3f} "
          f"{pct(ms, 99):>10.3f} {statistics.mean(ms):>10.3f}")


# ---------------------------------------------------------------- SWE-ReX (asyncio child)
async def _swerex(n: int) -> list[float]:
    from swerex.runtime.abstract import (
        BashAction,
        CloseBashSessionRequest,
        CreateBashSessionRequest,
    )
    from swerex.runtime.local import LocalRuntime

    rt = LocalRuntime()
    await rt.create_session(CreateBashSessionRequest())
    out = []
    for i in range(n + 5):
        t = time.perf_counter()
        r = await rt.run_in_session(BashAction(command="echo hi", check="silent"))
        dt = time.perf_counter() - t
        assert r.output.strip() == "hi", r
        if i >= 5:
            out.append(dt)
    await rt.close_session(CloseBashSessionRequest())
    return out


def swerex_child(n: int) -> None:
    print(json.dumps(asyncio.run(_swerex(n))))


# ---------------------------------------------------------------- tmux
def tmux_bench(n: int) -> list[float]:
    sock = f"rolloutd-bench-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    env = {**os.environ, "PS1": "$ "}
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", "b", "-x", "200",
                    "-y", "50", "bash --noprofile --norc"], check=True, env=env)
    out = []
    try:
        for i in range(n + 5):
            subprocess.run([*tmux, "clear-history", "-t", "b"], check=True)
            t = time.perf_counter()
            subprocess.run([*tmux, "send-keys", "-t", "b", "echo hi; tmux wait -S done",
                            "Enter"], check=True)
            subprocess.run([*tmux, "wait", "done"], check=True)
            cap = subprocess.run([*tmux, "capture-pane", "-p", "-t", "b"], check=True,
                                 capture_output=True, text=True).stdout
            dt = time.perf_counter() - t
            assert "hi" in cap
            if i >= 5:
                out.append(dt)
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    return out


# ---------------------------------------------------------------- ours (trio)
async def ours(n_bash: int, n_other: int, state_root: str) -> dict[str, list[float]]:
    import trio

    from rolloutd.sandbox import SandboxSpec, open_backend
    from rolloutd.tools import open_toolbox

    state = Path(tempfile.mkdtemp(prefix="rtb-", dir=state_root))
    res: dict[str, list[float]] = {}
    try:
        backend = open_backend("bwrap", state_dir=state, boot_id="bench")
        t = time.perf_counter()
        async with backend.open(SandboxSpec()) as sb, \
                open_toolbox(sb, ["bash", "ipython", "editor", "finish"]) as tb:
            r = await tb.call("bash", {"command": "echo hi"}, timeout_s=30)
            res["bwrap open + shell + first echo"] = [time.perf_counter() - t]
            assert r.output == "hi\n", r
            xs = []
            for i in range(n_bash + 50):
                t = time.perf_counter()
                r = await tb.call("bash", {"command": "echo hi"}, timeout_s=10)
                dt = time.perf_counter() - t
                assert r.output == "hi\n", r
                if i >= 50:
                    xs.append(dt)
            res["bash `echo hi` (bwrap)"] = xs

            t = time.perf_counter()
            await tb.call("ipython", {"code": "x = 0"}, timeout_s=60)
            res["ipython kernel start + first cell"] = [time.perf_counter() - t]
            xs = []
            for i in range(n_other + 30):
                t = time.perf_counter()
                r = await tb.call("ipython", {"code": "x = 1"}, timeout_s=10)
                dt = time.perf_counter() - t
                assert r.ok, r
                if i >= 30:
                    xs.append(dt)
            res["ipython `x = 1`"] = xs

            (sb.workspace / "f.py").write_text("".join(f"line_{i} = {i}\n" for i in range(200)))
            view, repl = [], []
            for i in range(n_other + 20):
                t = time.perf_counter()
                r = await tb.call("editor", {"command": "view", "path": "/workspace/f.py"},
                                  timeout_s=10)
                dt = time.perf_counter() - t
                assert r.ok, r
                if i >= 20:
                    view.append(dt)
                old, new = ("line_7 = 7", "line_7 = 8") if i % 2 == 0 else \
                    ("line_7 = 8", "line_7 = 7")
                t = time.perf_counter()
                r = await tb.call("editor", {"command": "str_replace", "path": "/workspace/f.py",
                                             "old_str": old, "new_str": new}, timeout_s=10)
                dt = time.perf_counter() - t
                assert r.ok, r
                if i >= 20:
                    repl.append(dt)
            res["editor view (200 lines)"] = view
            res["editor str_replace"] = repl
            await trio.sleep(0)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-bash", type=int, default=1000)
    ap.add_argument("--n-other", type=int, default=300)
    ap.add_argument("--n-anchor", type=int, default=100)
    ap.add_argument("--state-root", default="/tmp",
                    help="where sandbox workspaces live (e.g. /dev/shm for tmpfs)")
    ap.add_argument("--swerex-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.swerex_child:
        swerex_child(args.swerex_child)
        return

    import trio

    res = trio.run(ours, args.n_bash, args.n_other, args.state_root)
    child = subprocess.run([sys.executable, __file__, "--swerex-child", str(args.n_anchor)],
                           check=True, capture_output=True, text=True)
    res["SWE-ReX LocalRuntime `echo hi` (host)"] = json.loads(child.stdout.strip().splitlines()[-1])
    res["tmux send-keys/wait/capture (host)"] = tmux_bench(args.n_anchor)

    print(f"{'operation':<34} {'n':>6} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10} "
          f"{'mean ms':>10}")
    for name, xs in res.items():
        row(name, xs)

    def p50(k: str) -> float:
        return pct([x * 1000 for x in res[k]], 50)

    bash_p50 = p50("bash `echo hi` (bwrap)")
    bash_p99 = pct([x * 1000 for x in res["bash `echo hi` (bwrap)"]], 99)
    swerex = p50("SWE-ReX LocalRuntime `echo hi` (host)")
    tmux = p50("tmux send-keys/wait/capture (host)")
    ipy = p50("ipython `x = 1`")
    editor = max(p50("editor view (200 lines)"), p50("editor str_replace"))
    speedup = swerex / bash_p50
    print()
    print(f"targets: bash p50 <= 1 ms: {'met' if bash_p50 <= 1 else 'MISSED'}; "
          f">= 50x SWE-ReX: {'met' if speedup >= 50 else 'MISSED'} ({speedup:.0f}x); "
          f"ipython p50 <= 5 ms: {'met' if ipy <= 5 else 'MISSED'}; "
          f"editor p50 <= 2 ms: {'met' if editor <= 2 else 'MISSED'}")
    print(f"RESULT bash_p50_ms={bash_p50:.3f} bash_p99_ms={bash_p99:.3f} "
          f"swerex_p50_ms={swerex:.3f} tmux_p50_ms={tmux:.3f} speedup_vs_swerex={speedup:.1f} "
          f"ipython_p50_ms={ipy:.3f} editor_p50_ms={editor:.3f}")


if __name__ == "__main__":
    main()
