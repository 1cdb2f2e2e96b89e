"""Faults in low precision: non-finite gradients are caught before the optimizer step, on every rank.

A test-only driver (tests/drivers/inject_nonfinite.py) writes a NaN/Inf into one element of one
parameter's gradient at a chosen iteration, on a chosen TP rank.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import resume_from, scalars, torchrun, train_args
from megatron_snip.arguments import ArgumentError, parse_args
from megatron_snip.training.safety import is_spike

DRIVER = "tests/drivers/inject_nonfinite.py"
LOSS, SKIPPED = "train/lm loss", "train/skipped iterations"


def inject(at: int, param: str, **more) -> dict:
    return {"INJECT_AT": str(at), "INJECT_PARAM": param, **{k: str(v) for k, v in more.items()}}


def test_fail_policy_raises_on_every_rank_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    param = "decoder.layers.3.mlp.linear_fc2.weight"  # only TP rank 1's shard is corrupted
    proc = torchrun(2, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                                  "--save-interval", "2", iters=6),
                    check=False, env=inject(4, param, INJECT_TP_RANK=1), script=DRIVER)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_llama.py: error: rank")]
    assert sorted(int(re.search(r"rank (\d)", e).group(1)) for e in errors) == [0, 1], proc.stderr[-3000:]
    for e in errors:  # the same iteration and the same culprit on every rank
        assert "non-finite gradients at iteration 4: rank 1 (tp 1, pp 0, dp 0): " + param in e
        assert e.count("decoder.layers") == 1 and "policy fail" in e
    assert "[train] iteration       3" in proc.stdout and "[train] iteration       4" not in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists() and not (ckpt / "iter_0000004.tmp").exists()
    # The good checkpoint loads (and resharded to one process) and evaluates.
    torchrun(1, train_args(tiny_data, "--load", str(ckpt), "--skip-train", "--tensorboard-dir",
                           str(tmp_path / "tb"), iters=6))
    assert list(scalars(tmp_path / "tb", "valid/lm loss")) == [2]


def test_skip_policy_skips_counts_and_resumes_exactly(tiny_data, tmp_path):
    layout = ("--pipeline-model-parallel-size", "2", "--non-finite-grad-policy", "skip")
    digests = tmp_path / "digests"
    digests.mkdir()
    proc = torchrun(2, train_args(tiny_data, *layout, "--save", str(tmp_path / "full"), "--save-interval", "4",
                                  "--tensorboard-dir", str(tmp_path / "tb_full")),
                    env=inject(3, "decoder.layers.0.self_attention.linear_qkv.weight", INJECT_VALUE="inf",
                               PARAM_DIGESTS=digests), script=DRIVER)
    assert "non-finite gradients at iteration 3: rank 0 (tp 0, pp 0, dp 0): decoder.layers.0." in proc.stdout
    assert "update skipped (1 in a row, 1 in the run)" in proc.stdout
    for rank in (0, 1):  # weights entering step 4 are those entering step 3: the skipped step changed nothing
        d = json.loads((digests / f"rank{rank}.json").read_text())
        assert d["3"] == d["4"] and len({d["2"], d["3"], d["5"], d["6"]}) == 4  # (step 1 runs at LR 0)
    assert scalars(tmp_path / "tb_full", SKIPPED) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}
    full = scalars(tmp_path / "tb_full", LOSS)
    ckpt = resume_from(tmp_path / "full", 4, tmp_path / "resumed")
    torchrun(2, train_args(tiny_data, *layout, "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb_res")))
    resumed = scalars(tmp_path / "tb_res", LOSS)
    assert sorted(resumed) == [5, 6] and {k: full[k] for k in resumed} == resumed  # bit-identical
    assert scalars(tmp_path / "tb_res", SKIPPED) == {5: 1, 6: 1}  # the count came back from the checkpoint


def test_too_many_consecutive_skips_fail(tiny_data, tmp_path):
    """A gradient that is NaN at every step (here: from step 2 on, max 1 skip) stops the run."""
    proc = torchrun(1, train_args(tiny_data, "--non-finite-grad-policy", "skip", "--max-consecutive-skips", "0",
                                  iters=3),
                    check=False, env=inject(2, "decoder.layers.1.mlp.linear_fc1.weight"), script=DRIVER)
    assert proc.returncode == 1
    assert "1 consecutive iterations skipped (--max-consecutive-skips 0): giving up" in proc.stderr


def test_a_checkpoint_never_holds_nonfinite_weights(tiny_data, tmp_path):
    """Without the check the NaN reaches the weights; the save at 4 refuses, the one at 2 stays the newest."""
    ckpt = tmp_path / "ckpt"
    proc = torchrun(1, train_args(tiny_data, "--no-check-for-nan-in-loss-and-grad", "--save", str(ckpt),
                                  "--save-interval", "2", iters=4),
                    check=False, env=inject(3, "decoder.layers.2.mlp.linear_fc2.weight"), script=DRIVER)
    assert proc.returncode == 1
    assert f"refusing to save {ckpt / 'iter_0000004'}: non-finite values in rank 0" in proc.stderr
    assert "decoder.layers.2.mlp.linear_fc2.weight" in proc.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_spike_is_relative_to_the_median_of_recent_losses():
    assert is_spike(7.0, [3.0, 3.2, 2.9], 2.0) == 3.0
    assert is_spike(5.9, [3.0, 3.2, 2.9], 2.0) is None
    assert is_spike(100.0, [3.0, 3.2], 2.0) is None  # too little history to judge


@pytest.mark.parametrize("flags, message", [
    (["--no-check-for-nan-in-loss-and-grad", "--non-finite-grad-policy", "skip"], "needs the check"),
    (["--spiky-loss-factor", "0.5"], "--spiky-loss-factor 0.5 must be > 1"),
    (["--max-consecutive-skips", "-1"], "--max-consecutive-skips must be >= 0"),
])
def test_bad_safety_flags_are_named(tiny_data, flags, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(train_args(tiny_data, *flags), world_size=1, cuda=False)
