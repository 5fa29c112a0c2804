"""bwrap's options for the helper's code and interpreter (sandbox/_bwrap.py:lib_binds)."""

from __future__ import annotations

from pathlib import Path

from rolloutd.sandbox._bwrap import lib_binds
from rolloutd.sandbox._runtime import Runtime


def test_the_lib_dir_and_the_runtime_beside_it_are_one_bind():
    runtime = Runtime(Path("/s/lib/rt-abc"), "/usr/lib/python3.11", "3.11")
    assert lib_binds("/s/lib/0123", runtime) == [
        "--ro-bind", "/s/lib", "/s/lib",
        "--ro-bind", "/usr/lib/python3.11", "/s/lib/rt-abc/lib/python3.11"]


def test_a_runtime_elsewhere_is_bound_on_its_own():
    runtime = Runtime(Path("/other/rt-abc"), "/usr/lib/python3.11", "3.11")
    assert lib_binds("/s/lib/0123", runtime) == [
        "--ro-bind", "/s/lib/0123", "/s/lib/0123",
        "--ro-bind", "/other/rt-abc", "/other/rt-abc",
        "--ro-bind", "/usr/lib/python3.11", "/other/rt-abc/lib/python3.11"]
    assert lib_binds("/s/lib/0123", None) == ["--ro-bind", "/s/lib/0123", "/s/lib/0123"]
