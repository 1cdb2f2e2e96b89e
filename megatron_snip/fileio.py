"""Writing files so that a crash never leaves a partial one behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's file-mode creation mask (read without changing it where Linux shows it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (a file another thread creates meanwhile gets 022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory, fsync, rename.

    A reader sees the old file or the new one, never a mix, even after a crash. The file gets the
    mode ``open()`` would give it (0666 less the umask: 0644 under umask 022), not mkstemp's 0600,
    so colleagues and evaluation jobs can read trackers, plans and records.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
