"""The tests' cheaper launcher (conftest.launch: ranks forked from a process that imported the trainer
once) runs the same program as torchrun: the same numbers, the same exit status and error line."""

from __future__ import annotations

import re

import pytest
from conftest import launch, scalars, torchrun, train_args

from megatron_snip.training import tags

LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.mark.integration
def test_forked_ranks_train_bit_for_bit_as_torchrun_workers(tiny_data, tmp_path):
    def args(tb: str) -> list[str]:
        return train_args(tiny_data, *LAYOUT, "--tensorboard-dir", str(tmp_path / tb), iters=3)

    torchrun(4, args("torchrun"))
    launch(4, args("forked"))
    for tag in (tags.LM_LOSS, tags.GRAD_NORM):
        expected = scalars(tmp_path / "torchrun", tag)
        assert sorted(expected) == [1, 2, 3] and scalars(tmp_path / "forked", tag) == expected, tag


@pytest.mark.integration
@pytest.mark.parametrize("late", [0, 3])
def test_a_refused_launch_exits_78_with_one_error_line_from_forked_ranks(tiny_data, late):
    """Also when rank 0 starts late (a loaded node): rank 1 finds the problem first and waits for rank 0 to
    say it; the launcher, which stops the job at the first failed rank, then stops rank 1."""
    proc = launch(2, train_args(tiny_data, "--tensor-model-parallel-size", "3", iters=1), check=False,
                  script="tests/drivers/late_rank0.py", env={"LATE_S": str(late)})
    assert proc.returncode == 78
    assert len(re.findall(r"pretrain_llama\.py: error: ", proc.stderr)) == 1, proc.stderr
    assert "--tensor-model-parallel-size 3" in proc.stderr, proc.stderr
