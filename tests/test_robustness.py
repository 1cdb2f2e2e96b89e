"""Nothing is lost: preemption saves, a crashed save leaves the previous checkpoint, damage is reported."""

from __future__ import annotations

import re
import shutil
import signal

import psutil
import pytest
from conftest import launch, scalars, stop_at_iteration, train_args

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
    """A save that crashed leaves ``iter_N.tmp``: removed at start-up with one line; resume uses the previous
    checkpoint; the next save wins."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(init_ckpt, ckpt)
    partial, later = ckpt / "iter_0000002.tmp", ckpt / "iter_0000009.tmp"
    for folder in (partial, later):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"\x00" * 100)  # what a killed writer leaves behind
    proc = launch(1, train_args(tiny_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2",
                                "--tensorboard-dir", str(tmp_path / "tb"), iters=2))
    assert proc.stdout.count("a partial checkpoint an interrupted save left (the tracker never named it)") == 2
    assert f"removed {later}: a partial checkpoint" in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000002").is_dir() and not partial.exists() and not later.exists()
    assert sorted(scalars(tmp_path / "tb", tags.LM_LOSS)) == [1, 2]  # it resumed at iteration 0


def test_a_truncated_newest_shard_is_named_and_ckpt_fallback_loads_the_intact_one(tiny_data, tmp_path):
    """A shard of the newest checkpoint (4) truncated by a full disk: refused before any model is built, naming the
    file and the flag; with --ckpt-fallback the run loads 2 (one line), keeps the damaged one as
    iter_0000004.damaged (its iteration is saved anew, never over it) and goes on."""
    ckpt = tmp_path / "ckpt"
    launch(1, train_args(tiny_data, "--save", str(ckpt), "--save-interval", "2", iters=4))
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])  # truncated by a full disk
    resume = train_args(tiny_data, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2", iters=6)
    refused = launch(1, resume, check=False)
    assert refused.returncode != 0
    errors = re.findall(r"pretrain_llama\.py: error: .*", refused.stderr)
    assert errors == [f"pretrain_llama.py: error: checkpoint {ckpt / 'iter_0000004'}, the one "
                      f"{ckpt / 'latest_checkpointed_iteration.txt'} names, is damaged: {shard} has {size // 3} bytes "
                      f"but the index needs {size} (truncated); pass --ckpt-fallback to load the newest intact one, "
                      f"{ckpt / 'iter_0000002'}, instead, or restore the file"], refused.stderr[-3000:]
    proc = launch(1, [*resume, "--ckpt-fallback"])
    assert (f"notice: --ckpt-fallback: checkpoint {ckpt / 'iter_0000004'} is damaged ({shard} has {size // 3} bytes "
            f"but the index needs {size} (truncated)); loading {ckpt / 'iter_0000002'}, the newest intact one; the "
            f"damaged one is set aside as iter_N.damaged and the tracker names the one loaded") in proc.stdout
    assert f"--ckpt-fallback: set the damaged {ckpt / 'iter_0000004'} aside as {ckpt / 'iter_0000004.damaged'}" \
        in proc.stdout
    assert "resumed from" in proc.stdout and "at iteration 2 " in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ckpt / "iter_0000004.damaged" / shard.name).stat().st_size == size // 3  # kept as it was
    assert (ckpt / "iter_0000004" / shard.name).stat().st_size == size  # saved anew
