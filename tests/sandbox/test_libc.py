"""sandbox/_libc.py's network namespace for the calling thread (root only)."""

from __future__ import annotations

import os
import subprocess

import pytest

from rolloutd.sandbox._libc import own_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unshare(CLONE_NEWNET) needs "
                                "CAP_SYS_ADMIN; tests/sandbox/test_spares.py covers the "
                                "rootless fallback")


def here() -> str:
    return os.readlink("/proc/thread-self/ns/net")


def test_a_process_started_in_the_block_keeps_the_namespace_and_the_thread_returns():
    home = here()
    with own_netns():
        inside = here()
        child = subprocess.run(["sh", "-c", "readlink /proc/self/ns/net; "
                                "cat /proc/net/if_inet6; cat /proc/net/dev | grep -c :"],
                               capture_output=True, text=True, check=True)
    assert here() == home != inside
    ns, lo6, devices = child.stdout.split("\n")[:3]
    assert ns == inside and lo6.endswith(" lo") and lo6.startswith("0" * 31 + "1")
    assert devices == "1"  # loopback only, and up (it has ::1)


def test_the_thread_returns_when_the_block_raises():
    home = here()
    with pytest.raises(ValueError), own_netns():
        raise ValueError("boom")
    assert here() == home
