"""Writing files so that a crash never leaves a partial one behind, with the modes the umask gives, in
folders checked writable before a run starts."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's file-mode creation mask (read without changing it where Linux shows it)."""
    with contextlib.suppress(OSError):  # no /proc (not Linux): set and restore below
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
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


def check_writable(directory: str | os.PathLike) -> str | None:
    """Whether a run can write in ``directory``: create, write, rename and delete a probe file there (or,
    where the folder does not exist yet, in its nearest existing parent, which must take the new folder;
    nothing is left behind and no folder is created). None if all worked, else what failed, e.g.
    ``"cannot create a file there: [Errno 30] Read-only file system (EROFS)"``. The probe's name is
    unique to this host and process, so every rank of a job may probe the same folder at once."""
    folder = Path(os.path.abspath(directory))
    where = "there"
    while not folder.exists():
        folder, where = folder.parent, "in its parent " + str(folder.parent)
    if not folder.is_dir():
        return f"cannot create the folder: [Errno {errno.ENOTDIR}] {os.strerror(errno.ENOTDIR)} (ENOTDIR: {folder} " \
               f"is a file)"
    probe = folder / f".write_probe.{socket.gethostname()}.{os.getpid()}"
    renamed = probe.with_name(probe.name + ".renamed")  # not with_suffix: that would drop the pid
    steps = ((f"create a file {where}", lambda: probe.open("x").close()),
             (f"write a file {where}", lambda: probe.write_text("probe")),
             (f"rename a file {where}", lambda: os.replace(probe, renamed)),
             (f"delete a file {where}", lambda: os.remove(renamed)))
    for what, step in steps:
        try:
            step()
        except OSError as e:
            for leftover in (probe, renamed):
                with contextlib.suppress(OSError):
                    os.remove(leftover)
            name = errno.errorcode.get(e.errno, "?") if e.errno is not None else "?"
            return f"cannot {what}: [Errno {e.errno}] {e.strerror} ({name})"
    return None
