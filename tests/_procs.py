"""What tests read of a running process (by pid) from /proc."""

from __future__ import annotations


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
