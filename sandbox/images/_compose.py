"""Compose a multi-layer image's rootfs: a hardlink farm of its unpacked layers.

Layers are applied bottom first. Before a layer's entries go in, its opaque dirs are
emptied and its whiteouts removed (both hide what the layers below put there). Regular
files and symlinks are hardlinked from the layer dirs (no data is copied; the rootfs is
never written to); directories are made with the mode of the topmost layer that has them.
"""

from __future__ import annotations

import os
import stat

from ._unpack import LayerResult, remove_entry


def _inside(root: str, rel: str) -> str | None:
    """``root/rel`` if no component of ``rel``'s parent is a symlink or a non-directory."""
    path = root
    parts = rel.split("/")
    for part in parts[:-1]:
        path = os.path.join(path, part)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return None
        except FileNotFoundError:
            return None
    return os.path.join(path, parts[-1])


def compose(dest: str, layers: list[tuple[str, LayerResult]]) -> None:
    """Build the rootfs in the existing empty dir ``dest`` from ``(layer_dir, info)``
    pairs, bottom first."""
    for layer_dir, info in layers:
        for rel in info.opaque:
            target = _inside(dest, rel) if rel else dest
            if target is not None and os.path.isdir(target) and not os.path.islink(target):
                for entry in os.listdir(target):
                    remove_entry(os.path.join(target, entry))
        for rel in info.whiteouts:
            target = _inside(dest, rel)
            if target is not None:
                remove_entry(target)
        _merge(layer_dir, dest)


def _merge(src_root: str, dest_root: str) -> None:
    dir_modes: list[tuple[str, int, int]] = []
    for top, dirnames, filenames in os.walk(src_root):
        rel_top = os.path.relpath(top, src_root)
        out_top = dest_root if rel_top == "." else os.path.join(dest_root, rel_top)
        for name in dirnames:
            src = os.path.join(top, name)
            out = os.path.join(out_top, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):  # os.walk lists symlinks to dirs as dirs
                remove_entry(out)
                os.link(src, out, follow_symlinks=False)
                continue
            try:
                if not stat.S_ISDIR(os.lstat(out).st_mode):
                    os.unlink(out)
                    os.mkdir(out, 0o700)
            except FileNotFoundError:
                os.mkdir(out, 0o700)
            dir_modes.append((out, stat.S_IMODE(st.st_mode), st.st_mtime_ns))
        for name in filenames:
            out = os.path.join(out_top, name)
            remove_entry(out)
            os.link(os.path.join(top, name), out, follow_symlinks=False)
    for out, mode, mtime_ns in reversed(dir_modes):
        os.chmod(out, mode)
        os.utime(out, ns=(mtime_ns, mtime_ns))
