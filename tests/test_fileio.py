"""Atomic writes get the mode open() would give (the umask honoured), not mkstemp's owner-only 0600; the
start-up probe of an output folder is safe when every rank runs it at once."""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat

import pytest

from megatron_snip.arguments.errors import ArgumentError, HostProblem
from megatron_snip.cli import pretrain
from megatron_snip.fileio import check_writable, umask, write_text_atomic
from megatron_snip.training.requeue import CONFIG_ERROR_STATUS


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


def _probe_many(folder: str, times: int) -> list[str | None]:
    return [check_writable(folder) for _ in range(times)]


def test_every_rank_may_probe_one_folder_at_once(tmp_path):
    """Each process's probe and its renamed copy are its own (a renamed name shared by the ranks let one
    delete another's file: a rank of a 4-rank job refused a writable --save now and then)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_probe_many, [(str(tmp_path), 300)] * 4)
    assert all(r is None for rank in results for r in rank)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_one_host_cannot_write_is_reported_by_that_hosts_first_rank(monkeypatch, capsys, tmp_path):
    """Rank 0 speaks for the flags; a folder is checked per host, so the first rank of another host names
    its own problem (a silent exit 78 otherwise), and the other ranks of a host stay quiet."""
    problem = HostProblem(f"--save {tmp_path}: cannot create a file there: [Errno 30] Read-only file system "
                          f"(EROFS); give a folder this job can write")
    error = ArgumentError("--lr: must be positive", problem)
    for rank, local_rank, printed in (("2", "0", True), ("3", "1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert pretrain._refused(error, None) == CONFIG_ERROR_STATUS
        err = capsys.readouterr().err
        assert err == (f"pretrain_llama.py: error: rank {rank} on {socket.gethostname()}: {problem}\n" if printed
                       else "")
