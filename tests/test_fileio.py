"""Atomic writes get the mode open() would give (the umask honoured), not mkstemp's owner-only 0600."""

from __future__ import annotations

import os
import stat

import pytest

from megatron_snip.fileio import umask, write_text_atomic


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        assert umask() == mask
        write_text_atomic(tmp_path / "latest_checkpointed_iteration.txt", "12")
        write_text_atomic(tmp_path / "latest_checkpointed_iteration.txt", "13")  # a replaced file too
        with open(tmp_path / "by_open.txt", "w") as f:  # what the rest of the run's files get
            f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "latest_checkpointed_iteration.txt").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "by_open.txt").stat().st_mode) == mode
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "13"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["by_open.txt", "latest_checkpointed_iteration.txt"]
