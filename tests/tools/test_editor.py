"""The str_replace_editor tool through the real sandbox file operations."""

from __future__ import annotations

import os

from rolloutd.sandbox import Sandbox
from rolloutd.tools import Toolbox


async def ed(tb: Toolbox, **args):
    return await tb.call("editor", args, timeout_s=10)


async def test_create_view_and_ranges(toolbox: Toolbox, sandbox: Sandbox) -> None:
    path = f"{sandbox.workdir}/pkg/mod.py"
    r = await ed(toolbox, command="create", path=path, file_text="a = 1\n\tb = 2\nc = 3\n")
    assert r.ok and r.output == f"File created successfully at: {path}"
    assert (sandbox.workspace / "pkg/mod.py").read_text() == "a = 1\n\tb = 2\nc = 3\n"
    r = await ed(toolbox, command="view", path=path)
    assert r.output == (f"Here's the result of running `cat -n` on {path}:\n"
                        "     1\ta = 1\n     2\t\tb = 2\n     3\tc = 3\n")
    r = await ed(toolbox, command="view", path=path, view_range=[2, -1])
    assert r.output.endswith("     2\t\tb = 2\n     3\tc = 3\n")
    r = await ed(toolbox, command="view", path=path, view_range=[2, 9])
    assert r.ok and r.output.startswith("NOTE: We only show up to 3")
    r = await ed(toolbox, command="view", path=path, view_range=[5, 6])
    assert not r.ok and "[1, 3]" in r.output
    r = await ed(toolbox, command="create", path=path, file_text="x")
    assert not r.ok and "File already exists at" in r.output


async def test_view_directory(toolbox: Toolbox, sandbox: Sandbox) -> None:
    (sandbox.workspace / "d/sub").mkdir(parents=True)
    (sandbox.workspace / "d/sub/f.txt").write_text("x")
    (sandbox.workspace / "d/.hidden").write_text("x")
    r = await ed(toolbox, command="view", path=f"{sandbox.workdir}/d")
    assert f"{sandbox.workdir}/d/sub/\n{sandbox.workdir}/d/sub/f.txt" in r.output
    assert ".hidden" not in r.output.split("\n\n")[0]
    assert "1 hidden files/directories" in r.output


async def test_str_replace_zero_and_two_matches(bwrap_toolbox: Toolbox,
                                                bwrap_sandbox: Sandbox) -> None:
    path = "/workspace/f.txt"
    (bwrap_sandbox.workspace / "f.txt").write_text("x = 1\ny = 2\nx = 1\n")
    r = await ed(bwrap_toolbox, command="str_replace", path=path, old_str="z = 9", new_str="q")
    assert not r.ok
    assert r.output == f"No replacement was performed, old_str `z = 9` did not appear verbatim in {path}."
    r = await ed(bwrap_toolbox, command="str_replace", path=path, old_str="x = 1", new_str="q")
    assert not r.ok
    assert "Multiple occurrences of old_str `x = 1` (2 matches) in lines [1, 3]" in r.output
    r = await ed(bwrap_toolbox, command="str_replace", path=path, old_str="x = 1", new_str="x = 1")
    assert not r.ok and "must be different" in r.output
    assert (bwrap_sandbox.workspace / "f.txt").read_text() == "x = 1\ny = 2\nx = 1\n"


async def test_str_replace_undo_tabs_and_trailing_newline(bwrap_toolbox: Toolbox,
                                                          bwrap_sandbox: Sandbox) -> None:
    host = bwrap_sandbox.workspace / "Makefile"
    original = "all:\n\tcc -o x x.c\n\techo done"  # tabs, no trailing newline
    host.write_text(original)
    os.chmod(host, 0o755)
    r = await ed(bwrap_toolbox, command="str_replace", path="/workspace/Makefile",
                 old_str="\tcc -o x x.c", new_str="\tcc -O2 -o x x.c")
    assert r.ok, r.output
    assert "has been edited" in r.output and "     2\t\tcc -O2 -o x x.c" in r.output
    assert host.read_text() == "all:\n\tcc -O2 -o x x.c\n\techo done"
    assert os.stat(host).st_mode & 0o777 == 0o755  # mode kept
    r = await ed(bwrap_toolbox, command="insert", path="/workspace/Makefile", insert_line=1,
                 new_str="\t@echo start\n")
    assert r.ok and host.read_text() == "all:\n\t@echo start\n\tcc -O2 -o x x.c\n\techo done"
    r = await ed(bwrap_toolbox, command="insert", path="/workspace/Makefile", insert_line=9,
                 new_str="x")
    assert not r.ok and "[0, 4]" in r.output
    r = await ed(bwrap_toolbox, command="undo_edit", path="/workspace/Makefile")
    assert r.ok and host.read_text() == "all:\n\tcc -O2 -o x x.c\n\techo done"
    r = await ed(bwrap_toolbox, command="undo_edit", path="/workspace/Makefile")
    assert r.ok and host.read_text() == original
    r = await ed(bwrap_toolbox, command="undo_edit", path="/workspace/Makefile")
    assert not r.ok and r.output == "No edit history found for /workspace/Makefile."


async def test_undo_of_create_removes_the_file(bwrap_toolbox: Toolbox,
                                                bwrap_sandbox: Sandbox) -> None:
    r = await ed(bwrap_toolbox, command="create", path="/workspace/new.txt", file_text="hi\n")
    assert r.ok
    r = await ed(bwrap_toolbox, command="undo_edit", path="/workspace/new.txt")
    assert r.ok and not (bwrap_sandbox.workspace / "new.txt").exists()


async def test_symlink_outside_the_sandbox_is_refused(bwrap_toolbox: Toolbox,
                                                     bwrap_sandbox: Sandbox, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    os.symlink(secret, bwrap_sandbox.workspace / "link.txt")  # host path: outside the sandbox
    os.symlink("/etc/passwd", bwrap_sandbox.workspace / "passwd")
    for path in ("/workspace/link.txt", "/workspace/passwd"):
        for args in ({"command": "view"},
                     {"command": "str_replace", "old_str": "root", "new_str": "toor"},
                     {"command": "create", "file_text": "x"}):
            r = await ed(bwrap_toolbox, path=path, **args)
            assert not r.ok, (path, args, r.output)
            assert "host secret" not in r.output and "root:" not in r.output
    assert secret.read_text() == "host secret\n"


async def test_binary_huge_missing_relative(bwrap_toolbox: Toolbox,
                                            bwrap_sandbox: Sandbox) -> None:
    (bwrap_sandbox.workspace / "bin.dat").write_bytes(b"\x7fELF\x00\x01\x02")
    r = await ed(bwrap_toolbox, command="view", path="/workspace/bin.dat")
    assert not r.ok and "appears to be binary" in r.output
    (bwrap_sandbox.workspace / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    r = await ed(bwrap_toolbox, command="view", path="/workspace/latin1.txt")
    assert not r.ok and "UTF-8" in r.output
    with open(bwrap_sandbox.workspace / "huge.txt", "wb") as f:
        f.truncate(11 * 1024 * 1024)
    r = await ed(bwrap_toolbox, command="view", path="/workspace/huge.txt")
    assert not r.ok and "too large" in r.output
    r = await ed(bwrap_toolbox, command="view", path="/workspace/nope.txt")
    assert r.output == "The path /workspace/nope.txt does not exist. Please provide a valid path."
    r = await ed(bwrap_toolbox, command="view", path="rel.txt")
    assert not r.ok and "Maybe you meant /workspace/rel.txt?" in r.output
    r = await ed(bwrap_toolbox, command="frobnicate", path="/workspace")
    assert not r.ok and "Unrecognized command frobnicate" in r.output
    r = await ed(bwrap_toolbox, command="str_replace", path="/workspace")
    assert not r.ok


async def test_long_file_is_clipped(bwrap_toolbox: Toolbox, bwrap_sandbox: Sandbox) -> None:
    (bwrap_sandbox.workspace / "long.txt").write_text("".join(f"line {i}\n" for i in range(5000)))
    r = await ed(bwrap_toolbox, command="view", path="/workspace/long.txt")
    assert r.ok and "<response clipped>" in r.output and len(r.output) < 17_000
