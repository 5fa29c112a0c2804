"""sandbox/_libc.py's network namespace for the calling thread (root only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rolloutd.sandbox._libc import own_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unshare(CLONE_NEWNET) needs "
                                "CAP_SYS_ADMIN; tests/sandbox/test_spares.py covers the "
                                "rootless fallback")


def here() -> str:
    return os.readlink("/proc/thread-self/ns/net")


LOOPBACK = ("import os, socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1); "
            "c = socket.create_connection(s.getsockname(), timeout=5); a, _ = s.accept(); "
            "c.sendall(b'up'); print(os.readlink('/proc/self/ns/net'), a.recv(2).decode(), "
            "sum(1 for line in open('/proc/net/dev') if ':' in line))")


def test_a_process_started_in_the_block_keeps_the_namespace_and_the_thread_returns():
    home = here()
    with own_netns():
        inside = here()
        child = subprocess.run([sys.executable, "-c", LOOPBACK], capture_output=True,
                               text=True, check=True, timeout=30)
    assert here() == home != inside
    # its namespace, its loopback up (127.0.0.1 answers), and no other device
    assert child.stdout.split() == [inside, "up", "1"]


def test_the_thread_returns_when_the_block_raises():
    home = here()
    with pytest.raises(ValueError), own_netns():
        raise ValueError("boom")
    assert here() == home
