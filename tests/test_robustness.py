"""Nothing is lost: preemption saves, a crashed save leaves the previous checkpoint, damage is reported."""

from __future__ import annotations

import shutil
import signal

import psutil
import pytest
from conftest import scalars, stop_at_iteration, torchrun, train_args

from megatron_snip.training import tags

pytestmark = pytest.mark.integration  # every test here launches processes


def test_sigterm_saves_and_exits_zero(tiny_data, tmp_path):
    """SLURM signals every task; each finishes its iteration, all save together, exit 0."""
    ckpt = tmp_path / "ckpt"

    def every_worker(proc):
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        for w in workers:
            w.send_signal(signal.SIGTERM)

    proc, output = stop_at_iteration(train_args(tiny_data, "--save", str(ckpt), "--log-interval", "1", iters=100000),
                                     2, 3, every_worker)
    assert proc.returncode == 0, output[-4000:]
    assert "exit signal received" in output
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 100000 and (ckpt / f"iter_{saved:07d}").is_dir()


def test_partial_save_is_ignored_and_replaced(tiny_data, init_ckpt, tmp_path):
    """A save that crashed leaves ``iter_N.tmp``: resume uses the previous checkpoint; the next save wins."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(init_ckpt, ckpt)
    partial = ckpt / "iter_0000002.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\x00" * 100)  # what a killed writer leaves behind
    torchrun(1, train_args(tiny_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2",
                           "--tensorboard-dir", str(tmp_path / "tb"), iters=2))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000002").is_dir() and not partial.exists()
    assert sorted(scalars(tmp_path / "tb", tags.LM_LOSS)) == [1, 2]  # it resumed at iteration 0


def test_damaged_shard_is_reported(tiny_data, init_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(init_ckpt, ckpt)
    shard = next((ckpt / "iter_0000000").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated by a full disk
    proc = torchrun(1, train_args(tiny_data, "--load", str(ckpt)), check=False)
    assert proc.returncode != 0
    assert "cannot load checkpoint" in proc.stderr and "point" in proc.stderr and "earlier iteration" in proc.stderr
