"""The disk under a run: free space, the mount point to name, sizes in words, and whether an
error was a write that failed for lack of space (``ENOSPC`` or ``EDQUOT``, raised directly or
as TensorStore's text inside Orbax's errors)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import jax
import numpy as np

SPACE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}
# Orbax's array writes go through TensorStore, whose errors are ValueErrors carrying the text.
SPACE_TEXT = {
    errno.ENOSPC: ("No space left on device", "os_error_code='28'"),
    errno.EDQUOT: ("Disk quota exceeded", "os_error_code='122'"),
}


def space_errno(err: BaseException | None) -> int | None:
    """``ENOSPC`` or ``EDQUOT`` when ``err`` (or an exception it was raised from or groups) is a
    write that failed for lack of space, else None."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            return e.errno
        text = str(e)
        for code, marks in SPACE_TEXT.items():
            if any(mark in text for mark in marks):
                return code
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def free_bytes(directory: Path) -> int:
    """Bytes free to this user on the disk holding ``directory`` (the seam tests patch)."""
    return shutil.disk_usage(directory).free


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds ``path``."""
    path = path.absolute()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def tree_bytes(tree) -> int:
    """Bytes of every array of ``tree`` (global arrays: all their shards)."""
    return sum(int(np.size(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
